"""A layer's backward cut into B and W (meshtrain/engine/split_backward.py): the same gradients as
the whole pullback, W only the weight matmuls, and the whole pullback again where the cut would
stash a weight's gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshtrain.engine.stage_state import LayerResiduals
from meshtrain.models import FAMILIES
from meshtrain.testing import MOE_TINY, TINY, tiny_config

pytestmark = pytest.mark.fast


def layer_and_inputs(config=TINY):
    """The config's model's first layer, its parameters, an input and an output cotangent (fp32)."""
    spec = tiny_config(config=config).model
    model = FAMILIES[spec.family](spec)
    params = model.init(jax.random.key(0))
    p_layer = jax.tree.map(lambda p: p[0], params["blocks"])
    x = jax.random.normal(jax.random.key(1), (2, 16, model.cfg.d_model), jnp.float32)
    g = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    stats = jax.eval_shape(model.block, p_layer, x)[1]
    g_stats = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, jnp.float32), stats)
    return LayerResiduals(model.block, g_stats), p_layer, x, g


def whole_and_split(layers, p_layer, x, g):
    """((d params, d x) of the whole pullback, the same from B then W), traced as the pipeline does."""
    def both(p_layer, x, g):
        _, (saved, _) = layers.forward(p_layer, x)
        g_x, stash = layers.input_grad(p_layer, saved, g)
        return layers.pullback(p_layer, saved, g), (layers.weight_grad(p_layer, saved, stash, jnp.zeros_like(g)), g_x)

    return jax.jit(both)(p_layer, x, g)


def traced_cut(layers, p_layer, x):
    """The layer's cut (`Split`, or None where W reruns the pullback), read while tracing it."""
    found = {}

    def trace(p, x):
        found["cut"] = layers._split(p, layers.forward(p, x)[1][0], x, (), {})[0].cut
        return x

    jax.jit(trace)(p_layer, x)
    return found["cut"]


def assert_same(whole, split):
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_b_then_w_give_the_pullbacks_gradients_and_w_runs_only_the_weight_matmuls():
    layers, p_layer, x, g = layer_and_inputs()
    assert_same(*whole_and_split(layers, p_layer, x, g))

    cut = traced_cut(layers, p_layer, x)
    weights = [p for p in jax.tree.leaves(p_layer) if p.ndim >= 2]  # q, k, v, o, gate, up, down
    w_ops = [e.primitive.name for e in cut.w_eqns]
    assert w_ops.count("dot_general") == len(weights) == 7
    assert set(w_ops) <= {"dot_general", "transpose", "reshape", "convert_element_type", "mul", "add", "add_any",
                          "reduce_sum", "broadcast_in_dim", "sharding_constraint", "rsqrt", "div", "integer_pow",
                          "logistic", "sub", "neg", "square", "sqrt"}
    # the stash: activation-shaped cotangents and the norms' small gradients; never a weight's
    assert all(v.aval.shape[:2] == x.shape[:2] or v.aval.ndim == 1 for v in cut.stash)
    assert len(cut.stash) < len(w_ops)


def test_a_weight_gradient_made_inside_an_equation_kept_whole_falls_back_to_the_whole_pullback():
    """A scan over two matmuls: its transpose computes dx and dw in one equation B needs, so the cut
    would stash dw per microbatch; W runs the whole pullback instead, with the same gradients."""
    w = jax.random.normal(jax.random.key(0), (2, 8, 8), jnp.float32)

    def layer(p, x):
        return jax.lax.scan(lambda h, w_i: (jnp.tanh(h @ w_i), None), x, p)[0], {}

    layers = LayerResiduals(layer, {})
    x = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)
    g = jnp.ones_like(x)
    assert traced_cut(layers, w, x) is None
    stash = layers.input_grad(w, layers.forward(w, x)[1][0], g)[1]
    assert len(stash) == 1 and stash[0].shape == g.shape  # the output cotangent, for W's pullback
    assert_same(*whole_and_split(layers, w, x, g))


def test_an_moe_layer_gives_the_pullbacks_gradients_through_b_and_w():
    """moe_tiny's layer on one device: no shard_map, and its grouped matmul is the loop, one scan
    making dx and dw (the fallback: W reruns the pullback); B then W give the pullback's gradients."""
    layers, p_layer, x, g = layer_and_inputs(MOE_TINY)
    assert_same(*whole_and_split(layers, p_layer, x, g))
    assert traced_cut(layers, p_layer, x) is None


@pytest.mark.parametrize("check_vma", [False, True])
def test_a_shard_map_making_dx_and_dw_is_cut_into_a_b_part_and_a_w_part(check_vma):
    """Experts as a shard_map (two matmuls and an all_to_all between them): B's part keeps the
    all_to_all and the input gradient's matmuls and returns each device's stash; W's part takes it
    and runs the two weight matmuls; the gradients are the pullback's. A shard_map that checks its
    values' varying axes is kept whole (W reruns the pullback), with the same gradients."""
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])

    def experts(x, w1, w2):
        h = jax.lax.all_to_all(jnp.tanh(x @ w1[0]), "expert", 0, 0, tiled=True)
        return h @ w2[0]

    def layer(p, x):
        shard = jax.shard_map(experts, mesh=mesh, in_specs=(P("expert"), P("expert"), P("expert")),
                              out_specs=P("expert"), axis_names={"expert"}, check_vma=check_vma)
        return shard(x, *(jnp.broadcast_to(p[k], (2, *p[k].shape)) for k in ("w1", "w2"))), {}

    p = {k: jax.random.normal(jax.random.key(i), (8, 8), jnp.float32) for i, k in enumerate(("w1", "w2"))}
    x = jax.random.normal(jax.random.key(3), (4, 8), jnp.float32)
    layers = LayerResiduals(layer, {})
    with jax.set_mesh(mesh):
        assert_same(*whole_and_split(layers, p, x, jnp.ones_like(x)))
        cut = traced_cut(layers, p, x)
    if check_vma:
        assert cut is None
        return
    w_ops = [e.primitive.name for e in cut.w_eqns]
    b_ops = [e.primitive.name for e in cut.b_eqns]
    assert w_ops.count("shard_map") == 1 and b_ops.count("shard_map") == 1
    w_body = next(e for e in cut.w_eqns if e.primitive.name == "shard_map").params["jaxpr"]
    assert [e.primitive.name for e in w_body.eqns].count("dot_general") == 2  # dw1, dw2
    assert "all_to_all" not in [e.primitive.name for e in w_body.eqns]
