"""The train step: compiled once ahead of time, state donated, bf16 through the sharded trainer."""
import jax
import numpy as np
from conftest import run_tiny


def test_step_is_compiled_once_and_donates_its_state():
    trainer, _, _ = run_tiny("parallel.mesh=data=8", "parallel.zero=3")
    assert isinstance(trainer.compiled_step, jax.stages.Compiled)  # a new shape is an error, not a recompile
    old = trainer.state
    trainer.state, metrics = trainer.compiled_step(old, trainer.train_batches(100))
    assert all(x.is_deleted() for x in jax.tree.leaves(old))  # donated: updated in place
    assert {"loss", "grad_norm", "lr"} <= set(metrics)
    assert trainer.state["params"]["blocks"]["wq"].sharding == trainer.program.state_shardings["params"]["blocks"]["wq"]


def test_bf16_on_a_3d_mesh_tracks_fp32(reference_run):
    _, ref_losses, _ = reference_run
    _, losses, params = run_tiny("parallel.mesh=2x2x2", "parallel.precision=bf16")
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))  # fp32 master weights
