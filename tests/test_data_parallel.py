"""One data-parallel gradient reduction per step: the compiled program's collectives do not grow
with microbatches at any ZeRO stage, and accumulating per data shard computes the same run."""
import jax
import numpy as np
import pytest
from conftest import run_tiny, tiny_config

from meshtrain.engine.program import TrainProgram
from meshtrain.planner import hlo


def reductions(zero: int, microbatches: int) -> tuple[float, float]:
    """(count, payload bytes) per step of the collectives other than pipeline sends, on data=8."""
    cfg = tiny_config("parallel.mesh=data=8", f"parallel.zero={zero}", f"parallel.microbatches={microbatches}",
                      "train.batch_size=32")
    return hlo.reduction_totals(hlo.collectives(TrainProgram.from_config(cfg).lower().compile().as_text(), 8))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_collectives_do_not_grow_with_microbatches(zero):
    (count_1, bytes_1), (count_4, bytes_4) = reductions(zero, 1), reductions(zero, 4)
    print(f"parallel.zero={zero}: 1 microbatch {count_1:.0f} collectives {bytes_1:,.0f} B; "
          f"4: {count_4:.0f}, {bytes_4:,.0f} B")
    assert bytes_4 <= 1.1 * bytes_1
    # zero 2 at one microbatch is XLA's reduction: the CPU backend combines the gradients into a
    # few all-reduces + slices (read as reduce-scatters, meshtrain/planner/hlo.py; a combined one whose
    # elements are not all sliced counts once per kind), where the once-per-step path issues one
    # reduce-scatter per gradient: the counts differ, the bytes do not
    assert count_4 <= 1.1 * count_1 or (zero == 2 and bytes_4 == pytest.approx(bytes_1, rel=0.1))
    # at least the whole gradient crosses the data axis once (4 B per parameter)
    num_params = TrainProgram.from_config(tiny_config("parallel.mesh=data=8")).num_params
    assert bytes_4 >= 4 * num_params / (8 if zero >= 2 else 1)


@pytest.mark.parametrize("mesh,zero", [("data=4,fsdp=2", 3), ("data=2,tensor=4", 2), ("data=2,tensor=4", 3),
                                       ("2x2x2", 3)])
def test_accumulating_per_data_shard_matches_single_device(mesh, zero, reference_run):
    reference, ref_losses, ref_params = reference_run
    trainer, losses, params = run_tiny(f"parallel.mesh={mesh}", f"parallel.zero={zero}", "parallel.microbatches=2")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    np.testing.assert_allclose(trainer.grad_norms, reference.grad_norms, rtol=1e-5, atol=0)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_zero3_pipeline_where_data_divides_only_the_layers():
    """data=3 divides no width of this model, so ZeRO-3 shards the stacked layers over it, inside
    each pipeline stage's block (pipeline major, data minor): every stage gathers its own layers."""
    common = ("model.num_layers=12", "model.vocab_size=264", "train.batch_size=24")
    reference, ref_losses, ref_params = run_tiny("parallel.mesh=1", *common, devices=jax.devices()[:1])
    trainer, losses, _ = run_tiny("parallel.mesh=data=3,pipeline=2", "parallel.zero=3", "parallel.microbatches=4",
                                  *common, devices=jax.devices()[:6])
    assert trainer.program.state_shardings["params"]["blocks"]["wq"].spec[0] == ("pipeline", "data")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    np.testing.assert_allclose(trainer.grad_norms, reference.grad_norms, rtol=1e-5, atol=0)
    for a, b in zip(jax.tree.leaves(trainer.unpermuted_params()), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
