"""k microbatches accumulated inside the step give the update of one batch k times larger."""
import jax
import numpy as np
import pytest
from conftest import run_tiny


def test_microbatches_match_one_large_batch():
    common = ("parallel.mesh=data=2", "optim.warmup_steps=0", "train.steps=3")
    _, big_losses, big_params = run_tiny(*common, devices=jax.devices()[:2])
    _, acc_losses, acc_params = run_tiny(*common, "parallel.microbatches=4", devices=jax.devices()[:2])
    np.testing.assert_allclose(acc_losses, big_losses, rtol=1e-6)
    # Accumulating changes the summation order; Adam divides by sqrt(v), so for a near-zero gradient
    # that rounding moves the update by a visible fraction of lr = 3e-3: compare to 1e-4.
    for a, b in zip(jax.tree.leaves(acc_params), jax.tree.leaves(big_params)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_microbatch_split_spans_every_data_shard():
    from meshtrain.parallel.batching import split_microbatches

    tokens = np.arange(8)[:, None].repeat(3, axis=1)  # row i holds i
    micro = split_microbatches(tokens, 4)
    assert micro.shape == (4, 2, 3)
    # microbatch m takes rows m, m+4: one from each half of the batch (each data shard)
    assert [list(m[:, 0]) for m in micro] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_weights_gathered_once_train_as_per_microbatch():
    """parallel.gather_once: the microbatches share one gather of the weights over fsdp (XLA's partitioning)
    and, beside a manual `data` axis, over the fsdp it leaves to XLA: the same run as the per-microbatch
    gathers' on the same mesh, and one device's losses (its parameters within the accumulation's rounding
    above)."""
    from conftest import max_param_diff

    common = ("optim.warmup_steps=0", "train.steps=3", "parallel.microbatches=2", "parallel.zero=3")
    _, ref_losses, _ = run_tiny(*common, "parallel.mesh=1", devices=jax.devices()[:1])
    for mesh in ("fsdp=4", "data=2,fsdp=2"):
        runs = [run_tiny(*common, f"parallel.mesh={mesh}", f"parallel.gather_once={once}", devices=jax.devices()[:4])
                for once in ("false", "true")]
        (_, per_micro, per_micro_params), (_, once, once_params) = runs
        np.testing.assert_allclose(once, ref_losses, rtol=1e-5, atol=0)
        np.testing.assert_allclose(once, per_micro, rtol=1e-6, atol=0)
        assert max_param_diff(once_params, per_micro_params) < 1e-6


@pytest.mark.fast
@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_gather_once_is_refused_beside_a_forward_only_pass(objective):
    """DPO's reference and GRPO's policy score the batch forward-only outside the microbatch loop's copy."""
    import dataclasses

    from conftest import tiny_config

    from meshtrain.config.validate import check_config
    from meshtrain.core.errors import UserError

    cfg = tiny_config("parallel.gather_once=true")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective=objective))
    with pytest.raises(UserError, match=rf"^parallel.gather_once shares one gather of the weights among the train "
                                        rf"step's microbatches, and train.objective={objective}'s forward-only pass "
                                        rf"would still gather them per layer; set parallel.gather_once=false$"):
        check_config(cfg, effective=False)
