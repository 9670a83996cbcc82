"""Every layout computes the same training run as one device (fp32)."""
import jax
import numpy as np
import pytest
from conftest import max_param_diff, run_tiny

LAYOUTS = [
    ("data=8", 0), ("data=8", 1), ("data=8", 2), ("data=8", 3),
    ("fsdp=8", 1),
    ("data=2,tensor=4", 1),
    ("2x2x2", 0), ("2x2x2", 3),
]


@pytest.mark.parametrize("mesh,zero", LAYOUTS)
def test_layout_matches_single_device(mesh, zero, reference_run):
    _, ref_losses, ref_params = reference_run
    _, losses, params = run_tiny(f"parallel.mesh={mesh}", f"parallel.zero={zero}")
    assert len(losses) == len(ref_losses) == 5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert max_param_diff(params, ref_params) < 1e-5
    assert losses[-1] != losses[0]  # training moved


def test_fixed_seed_is_deterministic(reference_run):
    from conftest import tiny_config

    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    _, ref_losses, _ = reference_run
    trainer = Trainer(tiny_config("parallel.mesh=1", "parallel.precision=fp32"), devices=jax.devices()[:1])
    losses = [r["loss"] for r in trainer.fit(log=MetricsLog("/tmp", primary=False))]
    assert losses == list(ref_losses)  # bitwise
