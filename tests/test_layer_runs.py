"""parallel.bf16_layers: the layers a low-precision recipe leaves in bf16 (meshtrain/models/layer_runs.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, run_tiny, tiny_config

from meshtrain.core.errors import LayoutError, UserError
from meshtrain.models import layer_runs
from meshtrain.models.base import scan_blocks
from meshtrain.ops import recipes
from meshtrain.testing import DEEPSEEK_V3_TINY


@pytest.mark.fast
def test_runs_of_layers_scan_as_one_scan_each_kept_one_in_bf16():
    """The scan cut into runs gives one scan's output and statistics (summed, PER_LAYER_STATS stacked in
    order), and the kept runs are traced with their projections in bf16 (jnp.einsum)."""
    seen = []

    def layer(p, x):
        seen.append(recipes.projection_einsum("recipe"))  # what the block's projections would run
        return x * p["w"], {"expert_load": p["w"], "total": p["w"].sum()}

    blocks = {"w": jnp.arange(1.0, 13.0).reshape(4, 3) / 4}
    x = jnp.ones((3,))
    kept = np.array([True, False, False, True])
    assert layer_runs.runs(kept) == [(0, 1, True), (1, 3, False), (3, 4, True)]
    whole, whole_stats = scan_blocks(layer, blocks, x)
    cut, cut_stats = scan_blocks(layer, blocks, x, bf16=kept)
    np.testing.assert_array_equal(cut, whole)
    assert jax.tree.map(np.asarray, cut_stats).keys() == whole_stats.keys()
    np.testing.assert_array_equal(cut_stats["expert_load"], whole_stats["expert_load"])  # [layers, 3], in order
    np.testing.assert_allclose(cut_stats["total"], whole_stats["total"])
    assert seen[1:] == [jnp.einsum, "recipe", jnp.einsum]  # whole (the recipe's), then run by run
    assert layer_runs.recipe_share(kept) == 0.5 and layer_runs.recipe_share(None) == 1.0


@pytest.mark.fast
@pytest.mark.parametrize("policy", ["none", "full", "save_matmuls"])
def test_a_layer_kept_in_bf16_is_traced_so_under_every_remat_policy(policy):
    """jax.checkpoint reuses a trace by function and shapes: a kept run after a recipe run of the same layer
    would get the recipe's einsums (a B200 plan of nvfp4 kept no layer under save_matmuls) unless each has
    its own checkpoint (meshtrain/ops/remat.py)."""
    from meshtrain.ops import remat

    def layer(p, x):  # x 2 in bf16, x 3 under the recipe
        return x * p["w"] * (2.0 if recipes.projection_einsum("recipe") is jnp.einsum else 3.0), {}

    blocks = {"w": jnp.arange(1.0, 5.0)[:, None] / 4}
    kept = np.array([False, True, False, True])
    out, _ = scan_blocks(remat.apply(layer, policy, ()), blocks, jnp.ones((1,)), bf16=kept)
    factors = np.where(kept, 2.0, 3.0)
    np.testing.assert_allclose(out, [np.prod(np.arange(1.0, 5.0) / 4 * factors)])


def test_a_recipe_with_every_layer_kept_is_bf16_and_with_the_last_kept_is_neither():
    """The tiny model's 4 layers (3 steps, one device): mxfp8 with all kept trains bitwise as bf16; with
    the last kept, apart from both (three layers mxfp8, one bf16)."""
    common = ("parallel.mesh=1", "train.steps=3")
    one = jax.devices()[:1]
    _, bf16, _ = run_tiny(*common, "parallel.precision=bf16", devices=one)
    _, every, _ = run_tiny(*common, "parallel.precision=mxfp8", "parallel.bf16_layers=[0,1,2,-1]", devices=one)
    _, mxfp8, _ = run_tiny(*common, "parallel.precision=mxfp8", devices=one)
    _, last, _ = run_tiny(*common, "parallel.precision=mxfp8", "parallel.bf16_layers=[-1]", devices=one)
    np.testing.assert_array_equal(every, bf16)
    assert not np.array_equal(last, mxfp8) and not np.array_equal(last, bf16)
    np.testing.assert_allclose(last, bf16, rtol=2e-3)


@pytest.mark.fast
@pytest.mark.parametrize("sets,config,error,message", [
    (("parallel.bf16_layers=[4]",), TINY, UserError,
     r"^parallel.bf16_layers=\[4\]: \[4\] outside the model's 4 layers; use indices from -4 to 3 \(-1 the last\)$"),
    (("parallel.bf16_layers=[last]",), TINY, UserError,
     r"^parallel.bf16_layers=\['last'\] is not a list of layer indices; write e.g. \[-2, -1\] \(the last two\)$"),
    (("parallel.bf16_layers=[0]",), DEEPSEEK_V3_TINY, UserError,
     r"^parallel.bf16_layers=\[0\]: layer\(s\) \[0\] are among the first 1 this family runs apart"),
    ((), TINY, UserError, r"^parallel.bf16_layers=\[-1\] has no effect with parallel.precision='bf16'"),
])
def test_bf16_layers_that_name_no_stacked_layer_are_refused_in_one_line(sets, config, error, message):
    precision = () if not sets else ("parallel.precision=fp8",)
    with pytest.raises(error, match=message):
        tiny_config(*precision, *(sets or ("parallel.precision=bf16", "parallel.bf16_layers=[-1]")), config=config)


@pytest.mark.fast
def test_bf16_layers_on_a_pipeline_are_refused_in_one_line():
    from meshtrain.engine.program import TrainProgram

    cfg = tiny_config("parallel.mesh=data=4,pipeline=2", "parallel.precision=fp8", "parallel.bf16_layers=[-1]")
    with pytest.raises(LayoutError, match=r"^parallel.bf16_layers=\[-1\] on a pipeline \(pipeline=2\) is not built"):
        TrainProgram.from_config(cfg, devices=jax.devices()[:8])
