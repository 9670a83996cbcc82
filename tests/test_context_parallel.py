"""Ring attention (meshtrain.ops.context_parallel) against a plain causal attention in true order."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.config.loader import UserError
from meshtrain.ops import ring_schedule
from meshtrain.ops.attention import executed_attention
from meshtrain.ops.context_parallel import ring_attention
from meshtrain.ops.ring_schedule import load_balanced_order
from meshtrain.planner import hlo
from meshtrain.testing import value_and_grads

B, L, H, G, K = 2, 16, 4, 2, 8


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def reference(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
    """Causal GQA in true order, the textbook way."""
    b, n, h, d = q_BxLxHxK.shape
    g = k_BxLxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, n, g, h // g, d)
    s = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK) * d ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    out = jnp.einsum("bgrlm,bmgk->blgrk", jax.nn.softmax(s, axis=-1), v_BxLxGxK)
    return out.reshape(b, n, h, d)


def inputs(seed=0, batch=B):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, L, H, K))
    k = jax.random.normal(keys[1], (batch, L, G, K))
    v = jax.random.normal(keys[2], (batch, L, G, K))
    cot = jax.random.normal(keys[3], (batch, L, H, K))
    return q, k, v, cot


def ring_in_true_order(positions, constrain=None):
    """ring_attention wrapped to take and return true order: permute in, un-permute out."""
    inverse = np.argsort(positions)

    def attend(q, k, v):
        q, k, v = (x[:, positions] for x in (q, k, v))  # storage order
        if constrain is not None:
            q, k, v = constrain(q, k, v)
        return ring_attention(q, k, v, positions)[:, inverse]
    return attend


def check(mesh, positions, constrain=None, batch=B):
    q, k, v, cot = inputs(batch=batch)
    want_out, want_grads = value_and_grads(reference, q, k, v, cot)
    with jax.set_mesh(mesh):
        got_out, got_grads = jax.jit(
            lambda *a: value_and_grads(ring_in_true_order(positions, constrain), *a))(q, k, v, cot)
    np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
    for name, got, want in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.fast
def test_load_balanced_order():
    assert np.array_equal(load_balanced_order(12, 1), np.arange(12))
    for seq_len, parts in [(16, 2), (32, 4), (24, 3)]:
        positions = load_balanced_order(seq_len, parts)
        assert sorted(positions) == list(range(seq_len))
        chunks = np.arange(seq_len).reshape(2 * parts, -1)
        for i, slot in enumerate(positions.reshape(parts, -1)):
            assert np.array_equal(slot, np.concatenate([chunks[i], chunks[2 * parts - 1 - i]]))
    with pytest.raises(UserError, match=r"train\.seq_len=20 .*multiple of 8"):
        load_balanced_order(20, 4)


@pytest.mark.parametrize("shape,names,parts", [
    ((2,), ("context",), 2),
    ((4, 2), ("data", "context"), 2),
    ((4,), ("context",), 4),
])
def test_ring_matches_reference(shape, names, parts):
    check(mesh_of(shape, names), load_balanced_order(L, parts))


@pytest.mark.parametrize("parts", [1, 2])
def test_ring_in_sub_blocks_matches_reference(parts, monkeypatch):
    """Each ring step in S x S sub-blocks (S = 4 here), as at long sequences; one device too."""

    monkeypatch.setattr(ring_schedule, "RING_BLOCK", 4)
    mesh = mesh_of((4, 2), ("data", "context")) if parts == 2 else mesh_of((1,), ("context",))
    check(mesh, load_balanced_order(L, parts))


@pytest.mark.fast
def test_ring_refuses_another_layout():
    """The causal skipping assumes the load-balanced layout: a contiguous one is refused."""
    with pytest.raises(ValueError, match="load-balanced layout"):
        check(mesh_of((4,), ("context",)), np.arange(L))


@pytest.mark.fast
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_schedule_visits_each_visible_score_once(cp, monkeypatch):
    """Ring steps x chunk pairs x sub-blocks, in true positions: every (query, key) with key <= query
    exactly once, nothing hidden (the diagonal sub-blocks' lower triangle only), so the work is the
    share `computed_fraction` says: half the [L, L] scores plus the diagonal sub-blocks."""
    monkeypatch.setattr(ring_schedule, "RING_BLOCK", 8)
    seq = 48 * cp
    positions = load_balanced_order(seq, cp).reshape(cp, 1 if cp == 1 else 2, -1)  # [device, chunk, Lc]
    Lc = positions.shape[-1]
    S = ring_schedule.sub_block(Lc)
    computed, visited = 0, np.zeros((seq, seq), int)
    for me in range(cp):
        for t in range(cp):
            src = (me - t) % cp
            for qc, kc, causal in ring_schedule.step_pairs(me, t, cp):
                for i, j, diagonal in ring_schedule.sub_block_pairs(Lc // S, causal):
                    q = positions[me, qc, i * S:(i + 1) * S][:, None]
                    k = positions[src, kc, j * S:(j + 1) * S][None, :]
                    shown = np.tril(np.ones((S, S), bool)) if diagonal else np.ones((S, S), bool)
                    assert (q >= k)[shown].all() and not (q >= k)[~shown].any()
                    np.add.at(visited, (np.broadcast_to(q, (S, S))[shown], np.broadcast_to(k, (S, S))[shown]), 1)
                    computed += S * S
    assert (visited == np.tril(np.ones((seq, seq), int))).all()
    assert computed / seq**2 == pytest.approx(ring_schedule.computed_fraction(seq, cp))
    n = Lc // S
    assert ring_schedule.computed_fraction(seq, cp) == pytest.approx(0.5 + 1 / (4 * n * cp if cp > 1 else 2 * n))


def test_ring_with_batch_and_heads_sharded():
    mesh = mesh_of((2, 2, 2), ("fsdp", "tensor", "context"))

    def constrain(q, k, v):
        spec = NamedSharding(mesh, P("fsdp", "context", "tensor"))
        return tuple(jax.lax.with_sharding_constraint(x, spec) for x in (q, k, v))
    check(mesh, load_balanced_order(L, 2), constrain)


@pytest.mark.parametrize("manual", ["data", "context"])
def test_ring_inside_callers_shard_map(manual):
    """The caller made 'data' manual (the ring nests its own shard_map over 'context'), or made
    'context' itself manual (the arrays are the local slots: the ring runs in place)."""
    mesh = mesh_of((2, 2), ("data", "context"))
    positions = load_balanced_order(L, 2)
    inverse = np.argsort(positions)
    q, k, v, cot = inputs(batch=4)
    spec = P("data") if manual == "data" else P(None, "context")

    def attend(q, k, v):
        inner = jax.shard_map(lambda *a: ring_attention(*a, positions), in_specs=spec,
                              out_specs=spec, axis_names={manual}, check_vma=False)
        return inner(*(x[:, positions] for x in (q, k, v)))[:, inverse]

    want_out, want_grads = value_and_grads(reference, q, k, v, cot)
    with jax.set_mesh(mesh):
        got_out, got_grads = jax.jit(lambda *a: value_and_grads(attend, *a))(q, k, v, cot)
    np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_no_context_axis_falls_back_to_local():
    check(mesh_of((1,), ("data",)), load_balanced_order(L, 2))
    q, k, v, _ = inputs()
    out = jax.jit(lambda q, k, v: ring_attention(q, k, v, np.arange(L)))(q, k, v)  # no mesh at all
    np.testing.assert_allclose(out, reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_hlo_passes_blocks_round_the_ring():
    mesh = mesh_of((4,), ("context",))
    positions = load_balanced_order(L, 4)
    q, k, v, cot = inputs()
    shard = NamedSharding(mesh, P(None, "context"))
    q, k, v, cot = (jax.device_put(x, shard) for x in (q, k, v, cot))

    def loss(q, k, v):
        return jnp.sum(ring_attention(q, k, v, positions) * cot)
    def forward(q, k, v):
        return ring_attention(q, k, v, positions)
    with jax.set_mesh(mesh):
        for f in (forward, jax.grad(loss, argnums=(0, 1, 2))):
            hlo = jax.jit(f).lower(q, k, v).compile().as_text()
            assert "collective-permute" in hlo
            assert "all-gather" not in hlo and "all-to-all" not in hlo  # K/V never gathered


def executed_dot_flops(text: str) -> float:
    """FLOPs of the dots a compiled program runs per call, loop bodies counted by their trip counts:
    2 x output elements x contracted size."""
    module = hlo.Module(text)
    total = 0.0
    for comp, times in module.execution_counts().items():
        for ins in module.comps[comp].values():
            if ins.op != "dot":
                continue
            lhs_shape = module.comps[comp][ins.operands[0]].shape
            lhs = [int(d) for d in re.search(r"\[([\d,]*)\]", lhs_shape).group(1).split(",")]
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line).group(1).split(",")
            total += times * 2 * hlo.typed_array_elements(ins.shape)[0][1] * np.prod([lhs[int(i)] for i in contracted])
    return total


def test_compiled_ring_runs_the_matmuls_the_roofline_counts(monkeypatch):
    """Forward and backward of the ring on context=2, read from the compiled program with loop trip
    counts: 2 + 5 score-sized matmuls (the backward recomputes the scores) over the computed share of
    the [L, L] scores, as meshtrain.ops.attention.executed_attention tells the roofline (the backward's
    delta = rowsum(dO x O) compiles to a reduction, not a dot)."""
    monkeypatch.setattr(ring_schedule, "RING_BLOCK", 8)
    seq, cp, heads, k = 64, 2, 4, 8
    mesh = mesh_of((cp,), ("context",))
    positions = load_balanced_order(seq, cp)
    shard = NamedSharding(mesh, P(None, "context"))
    args = [jax.ShapeDtypeStruct((B, seq, n, k), jnp.float32, sharding=shard) for n in (heads, G, G)]

    def loss(q, kk, v):
        return jnp.sum(ring_attention(q, kk, v, positions))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    (forward, backward), share = executed_attention("ring", seq, cp)
    per_matmul = 2 * B * heads * k * seq * seq / cp  # one score-sized matmul over the whole [L, L], per device
    assert executed_dot_flops(text) == pytest.approx(per_matmul * share * (forward + backward), rel=1e-9)
    assert (forward, backward) == (2, 5) and share == pytest.approx(0.5 + 1 / (4 * 2 * cp))
