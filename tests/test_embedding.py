"""The embedding lookup (meshtrain/ops/embedding.py): rows and table gradient equal a plain
jnp.take's on 1 device, with the batch split over expert x fsdp (the MoE pods), the sequence over
context and the vocabulary over tensor (evenly and, padded by XLA, unevenly); and on the MoE pod's
axes the gradient is reduce-scattered onto the table's shards, with no all-reduce of a whole table."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.ops.embedding import lookup
from meshtrain.parallel.mesh import build_mesh
from meshtrain.parallel.sharding import activation_rules, make_rules
from meshtrain.planner import hlo

pytestmark = pytest.mark.fast
MESHES = {"expert x fsdp": {"expert": 4, "fsdp": 2}, "fsdp x tensor x context": {"fsdp": 2, "tensor": 2, "context": 2}}


def inputs(V, B=8, L=6, D=16):
    kt, ki, kc = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kt, (V, D)), jax.random.randint(ki, (B, L), 0, V), jax.random.normal(kc, (B, L, D)))


def rows_and_grad(look, table, ids, cotangent):
    rows, pull = jax.vjp(lambda t: look(t, ids), table)
    return rows, pull(cotangent)[0]


def sharded(mesh_axes, V):
    mesh = build_mesh(mesh_axes, jax.devices()[:8])
    table, ids, cot = inputs(V)
    batch = tuple(a for a in ("expert", "fsdp") if a in mesh_axes)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = put(table, P("tensor" if "tensor" in mesh_axes and V % 2 == 0 else None, "fsdp")), \
        put(ids, P(batch, mesh_axes.get("context") and "context")), \
        put(cot, P(batch, mesh_axes.get("context") and "context"))

    def step(table, ids, cot):
        with activation_rules(make_rules(), mesh):
            return rows_and_grad(lookup, table, ids, cot)
    return mesh, jax.jit(step), args


@pytest.mark.parametrize("name,V", [("expert x fsdp", 64), ("fsdp x tensor x context", 64),
                                    ("fsdp x tensor x context", 63)])
def test_rows_and_table_gradient_equal_a_plain_take(name, V):
    mesh, step, args = sharded(MESHES[name], V)
    with jax.set_mesh(mesh):
        rows, grad = step(*args)
    ref_rows, ref_grad = rows_and_grad(lambda t, i: jnp.take(t, i, axis=0), *inputs(V))
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_the_gradient_is_reduce_scattered_onto_the_tables_shards():
    """expert=4 x fsdp=2: the table's gradient sums over the 8 batch shards as a reduce-scatter over
    fsdp (an all-reduce sliced in half on XLA:CPU) and an all-reduce of its half over expert; before,
    one all-reduce of the whole table over all 8 (issue 39, section 3)."""
    V, D = 64, 16
    mesh, step, args = sharded(MESHES["expert x fsdp"], V)
    with jax.set_mesh(mesh):
        text = step.lower(*args).compile().as_text()
    table = [c for c in hlo.read(text, 8) if c.kind in ("all-reduce", "reduce-scatter") and c.payload >= V * D]
    assert sorted((c.kind, len(c.groups[0]), c.payload) for c in table) == [
        ("all-reduce", 4, V * D * 4 // 2), ("reduce-scatter", 2, V * D * 4 // 2)]
