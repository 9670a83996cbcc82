"""Collective traffic: meshtrain/planner/hlo.py's reading of compiled programs (the CPU backend's rewrites
undone: bf16 collectives widened to f32, reduce-scatters run as all-reduce + dynamic slice,
all-reduces of values it then adds) on hand-built programs, and meshtrain/planner/traffic.py's formulas
against the compiled train step, per collective kind, within 10%."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.engine.program import TrainProgram
from meshtrain.planner import hlo, ticks, traffic
from meshtrain.planner.hlo import KINDS, replica_groups


def compiled_text(fn, mesh, *args):
    return jax.jit(fn).lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
                               for a, s in args]).compile().as_text()


@pytest.mark.fast
def test_a_bf16_all_reduce_widened_by_the_cpu_is_counted_at_bf16():
    """psum of a bf16 array: the CPU program reduces f32 (convert, all-reduce, convert back); a
    GPU reduces bf16. A psum of an f32 cast of bf16 values stays f32: the program asked for it."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    arg = (jnp.zeros((8 * 256,), jnp.bfloat16), P("x"))
    bf16 = jax.shard_map(lambda a: jax.lax.psum(a * 2, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    f32 = jax.shard_map(lambda a: jax.lax.psum((a * 2).astype(jnp.float32), "x"), mesh=mesh, in_specs=P("x"),
                        out_specs=P())
    raw = hlo.collectives(compiled_text(bf16, mesh, arg), 8, correct=False)["all-reduce"]
    assert raw["dtypes"] == {"f32": 256 * 4}  # the CPU backend's f32
    records = hlo.read(compiled_text(bf16, mesh, arg), 8)
    found = hlo.by_kind(records)
    assert found["all-reduce"]["dtypes"] == {"bf16": 256 * 2}
    assert found["all-reduce"]["traffic_bytes"] == 256 * 2 * 2 * 7 / 8
    assert hlo.corrections(records)["bf16_widened_bytes"] == 256 * 2
    assert hlo.collectives(compiled_text(f32, mesh, arg), 8)["all-reduce"]["dtypes"] == {"f32": 256 * 4}


@pytest.mark.fast
def test_an_all_reduce_sliced_to_the_local_shard_is_a_reduce_scatter():
    """A sum over the sharded axis whose result is sharded: the CPU program all-reduces the whole
    [1024] and slices this device's 128; a GPU's ReduceScatterCreator pass makes it a reduce-scatter
    of the slice, (N-1) x slice on the links."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    text = compiled_text(lambda a: jax.lax.with_sharding_constraint(a.sum(0), NamedSharding(mesh, P("x"))),
                         mesh, (jnp.zeros((8, 1024), jnp.float32), P("x")))
    raw = hlo.collectives(text, 8, correct=False)
    assert (raw["all-reduce"]["payload_bytes"], raw["reduce-scatter"]["count"]) == (1024 * 4, 0)
    records = hlo.read(text, 8)
    found = hlo.by_kind(records)
    assert (found["all-reduce"]["count"], found["reduce-scatter"]["payload_bytes"]) == (0, 128 * 4)
    assert found["reduce-scatter"]["traffic_bytes"] == 128 * 4 * 7
    assert hlo.corrections(records)["all_reduce_as_reduce_scatter"] == 1


@pytest.mark.fast
def test_all_reduces_added_together_count_once():
    """psum(a) + psum(b): a GPU's AllReduceReassociate pass reduces a + b once."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    fn = jax.shard_map(lambda a, b: jax.lax.psum(jnp.sin(a), "x") + jax.lax.psum(jnp.cos(b), "x"), mesh=mesh,
                       in_specs=(P("x"), P("x")), out_specs=P())
    arg = (jnp.zeros((8 * 256,), jnp.float32), P("x"))
    text = compiled_text(fn, mesh, arg, arg)
    assert hlo.collectives(text, 8, correct=False)["all-reduce"]["payload_bytes"] == 2 * 256 * 4
    records = hlo.read(text, 8)
    assert hlo.by_kind(records)["all-reduce"]["payload_bytes"] == 256 * 4
    assert hlo.corrections(records)["all_reduce_reassociated_bytes"] == 256 * 4


@pytest.mark.fast
@pytest.mark.parametrize("line,groups", [
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=[2,4]<=[8], use_global_device_ids=true", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("source_target_pairs={{0,1},{1,2},{2,0}}, metadata", [[0, 1], [1, 2], [2, 0]]),
    ("all-reduce(%x), to_apply=%add", [list(range(8))]),
])
def test_replica_groups_in_every_spelling(line, groups):
    assert replica_groups(line, 8) == groups


@pytest.mark.fast
def test_mesh_spelled_groups_match_the_program_axes():
    """The mesh spelling read from a real program: a psum over the minor axis of a 2x4 mesh groups
    devices that differ in that axis only."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    fn = jax.shard_map(lambda x: jax.lax.psum(x, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a"))
    records = hlo.read(compiled_text(fn, mesh, (jnp.zeros((2, 4 * 128)), P("a", "b"))), 8)
    ids = np.arange(8).reshape(2, 4)
    assert [sorted(map(sorted, r.groups)) for r in records if r.kind == "all-reduce"] == [ids.tolist()]


# ---- formula vs compiled train step, per kind ----
LAYOUTS = {  # untied head (a tied table may be gathered once for both uses: the formula's upper bound)
    "data": ("parallel.mesh=data=8",),
    "zero3": ("parallel.mesh=data=8", "parallel.zero=3"),
    "fsdp": ("parallel.mesh=fsdp=8",),
    "tensor": ("parallel.mesh=data=2,tensor=4",),
    "pipeline": ("parallel.mesh=data=2,pipeline=4",),
    "tensor+remat": ("parallel.mesh=data=2,tensor=4", "parallel.remat=full"),
    "fsdp+tensor": ("parallel.mesh=fsdp=2,tensor=4",),
}
CASES = [(name, "bf16") for name in LAYOUTS] + [("fsdp", "fp32")]


@pytest.mark.parametrize("layout,precision", CASES)
def test_formula_within_10_percent_of_the_compiled_step(layout, precision):
    program = TrainProgram.from_config(tiny_config(*LAYOUTS[layout], f"parallel.precision={precision}",
                                                   "model.tie_embeddings=false"))
    found = hlo.collectives(program.lower().compile().as_text(), 8, tick_plan=ticks.tick_plan(program))
    formula = traffic.expected_traffic(program)
    compared = 0
    for kind in KINDS:
        measured, expected = found[kind]["traffic_bytes"], formula[kind]["traffic_bytes"]
        if kind == "collective-permute" and not expected and "fsdp" in layout:
            continue  # ZeRO-1's resharding permutes with data beside fsdp: no formula yet (docs/planner.md)
        if expected == 0:  # scalars only: the loss, the norm, the guard
            assert measured < 1e3, (kind, measured)
            continue
        assert measured == pytest.approx(expected, rel=0.10), (kind, formula[kind]["terms"])
        compared += 1
    assert compared >= 1
