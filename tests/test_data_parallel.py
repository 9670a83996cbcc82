"""One data-parallel gradient reduction per step: the compiled program's collectives do not grow
with microbatches at any ZeRO stage, and accumulating per data shard computes the same run."""
import jax
import numpy as np
import pytest

from conftest import run_tiny, tiny_config
from meshtrain import hlo
from meshtrain.program import TrainProgram


def reductions(zero: int, microbatches: int) -> tuple[float, float]:
    """(count, payload bytes) per step of the collectives other than pipeline sends, on data=8."""
    cfg = tiny_config("mesh=data=8", f"zero={zero}", f"train.microbatches={microbatches}", "train.batch_size=32")
    return hlo.reduction_totals(hlo.collectives(TrainProgram(cfg).lower().compile().as_text(), 8))


@pytest.mark.parametrize("zero", [1, 3])
def test_data_parallel_collectives_do_not_grow_with_microbatches(zero):
    (count_1, bytes_1), (count_4, bytes_4) = reductions(zero, 1), reductions(zero, 4)
    print(f"zero={zero}: 1 microbatch {count_1:.0f} collectives {bytes_1:,.0f} B; 4: {count_4:.0f}, {bytes_4:,.0f} B")
    assert count_4 <= 1.1 * count_1 and bytes_4 <= 1.1 * bytes_1
    # at least the whole gradient crosses the data axis once (4 B per parameter)
    assert bytes_4 >= 4 * TrainProgram(tiny_config("mesh=data=8")).num_params / (8 if zero >= 2 else 1)


@pytest.mark.parametrize("mesh,zero", [("data=4,fsdp=2", 3), ("data=2,tensor=4", 2)])
def test_accumulating_per_data_shard_matches_single_device(mesh, zero, reference_run):
    reference, ref_losses, ref_params = reference_run
    trainer, losses, params = run_tiny(f"mesh={mesh}", f"zero={zero}", "train.microbatches=2")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    np.testing.assert_allclose(trainer.grad_norms, reference.grad_norms, rtol=1e-5, atol=0)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
