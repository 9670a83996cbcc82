"""Packed documents and sliding windows (meshtrain/packing.py): every attention backend against a
dense reference mask (fp32, 1e-5), the ring's exchanges under a window (counted, and in the compiled
HLO), and a packed batch trained as its documents one by one: the same per-token logits and
gradients on one device, under context parallelism and through a pipeline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain import context_parallel
from meshtrain.attention import blockwise_attention, executed_attention, xla_attention
from meshtrain.context_parallel import load_balanced_order, ring_attention
from meshtrain.packing import Packing, visible

B, L, H, G, K = 2, 64, 4, 2, 8
EOS = 0


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def reference(q, k, v, segments=None, window=0):
    """Attention with the dense [L, L] mask `visible` gives, in true order, the textbook way."""
    n = q.shape[1]
    pos = jnp.arange(n)
    segs = () if segments is None else (segments[:, None, None, :, None], segments[:, None, None, None, :])
    mask = visible(pos[:, None], pos[None, :], window, *segs)
    q5 = q.reshape(q.shape[0], n, G, H // G, K)
    s = jnp.einsum("blgrk,bmgk->bgrlm", q5, k) * K ** -0.5
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bgrlm,bmgk->blgrk", jax.nn.softmax(s, axis=-1), v).reshape(q.shape)


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, L, H, K))
    k, v = (jax.random.normal(key, (B, L, G, K)) for key in keys[1:3])
    cot = jax.random.normal(keys[3], (B, L, H, K))
    # documents of 1 to 20 tokens: EOS ends each (row 0 starts mid-document, row 1 with a 1-token one)
    tokens = jax.random.randint(keys[4], (B, L), 1, 50)
    tokens = tokens.at[0, jnp.array([5, 6, 25, 44])].set(EOS).at[1, jnp.array([0, 17, 37, 38, 63])].set(EOS)
    return q, k, v, cot, Packing(EOS).documents(tokens).segments


def values_and_grads(attend, q, k, v, cot):
    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * cot), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def assert_close(got, want):
    (got_out, got_grads), (want_out, want_grads) = got, want
    np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip((got_out, *got_grads), (want_out, *want_grads)))


MASKS = [(False, 5), (True, 0), (True, 13)]  # (segments, window)


def test_documents_segments_and_positions():
    tokens = jnp.array([[3, 4, EOS, 5, EOS, EOS, 6, 7]])
    docs = Packing(EOS).documents(tokens)
    assert docs.segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # a token after an EOS starts a document
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert Packing(EOS, restart_positions=False).documents(tokens).positions is None
    order = load_balanced_order(8, 2)
    stored = Packing(EOS).documents(tokens, order)
    assert stored.segments.tolist() == [docs.segments[0, order].tolist()]


@pytest.mark.parametrize("backend,segmented,window", [(b, *m) for b in ("xla", "blockwise") for m in MASKS]
                         + [("ring-one-device", True, 13)])
def test_local_kernels_match_the_dense_mask(backend, segmented, window):
    q, k, v, cot, segments = inputs()
    segments = segments if segmented else None
    kernel = {"xla": xla_attention,
              "blockwise": lambda *a, **kw: blockwise_attention(*a, block=8, **kw),
              "ring-one-device": lambda q, k, v, **kw: ring_attention(q, k, v, np.arange(L), **kw)}[backend]
    got = jax.jit(lambda *a: values_and_grads(lambda q, k, v: kernel(q, k, v, segment_ids=segments,
                                                                     window=window), *a))(q, k, v, cot)
    want = values_and_grads(lambda q, k, v: reference(q, k, v, segments, window), q, k, v, cot)
    print(f"{backend} segments={segmented} window={window}: max |diff| {assert_close(got, want):.2e}")


@pytest.mark.parametrize("cp,ring_block,segmented,window", [(8, 512, True, 13), (8, 512, False, 5), (8, 512, True, 0),
                                                            (4, 4, True, 5), (4, 4, True, 1), (4, 4, False, 40)])
def test_ring_matches_the_dense_mask(cp, ring_block, segmented, window, monkeypatch):
    """The ring on a `context` axis of cp (chunks of L / 2cp positions, sub-blocks of ring_block),
    in storage order, against the reference in true order; windows that need 1 or 3 chunks back,
    only the own block (1) or the whole ring (40)."""
    monkeypatch.setattr(context_parallel, "RING_BLOCK", ring_block)
    q, k, v, cot, segments = inputs()
    segments = segments if segmented else None
    positions = load_balanced_order(L, cp)
    inverse = np.argsort(positions)
    mesh = mesh_of((cp,), ("context",))

    def attend(q, k, v):
        stored = [x[:, positions] for x in (q, k, v)]
        segs = None if segments is None else segments[:, positions]
        return ring_attention(*stored, positions, segment_ids=segs, window=window)[:, inverse]

    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: values_and_grads(attend, *a))(q, k, v, cot)
    want = values_and_grads(lambda q, k, v: reference(q, k, v, segments, window), q, k, v, cot)
    print(f"ring cp={cp} segments={segmented} window={window}: max |diff| {assert_close(got, want):.2e}")


@pytest.mark.parametrize("cp,window,exchanges", [(8, 0, 7), (8, 5, 2), (8, 9, 4), (8, 13, 6), (8, 17, 7),
                                                 (8, 1, 0), (4, 5, 2), (4, 9, 2), (4, 10, 3), (2, 5, 1)])
def test_a_short_window_skips_ring_exchanges(cp, window, exchanges):
    """L = 64: chunks of 64 / 2cp positions; a window reaching D chunks back needs 2D < cp - 1
    exchanges (D each way round the ring), else the whole ring."""
    assert context_parallel.ring_exchanges(L, cp, window) == exchanges


@pytest.mark.parametrize("cp,window", [(8, 0), (8, 5), (8, 13), (4, 9), (1, 7)])
def test_computed_fraction_counts_what_the_window_leaves(cp, window, monkeypatch):
    """Ring steps x chunk pairs x needed sub-blocks, in true positions: every visible (query, key)
    once, and the share `computed_fraction` (and so the roofline's executed_attention) reports."""
    monkeypatch.setattr(context_parallel, "RING_BLOCK", 2)
    positions = load_balanced_order(L, cp).reshape(cp, 1 if cp == 1 else 2, -1)
    Lc = positions.shape[-1]
    S = context_parallel.sub_block(Lc)
    steps = [0] + [t for _, ts in context_parallel.ring_legs(cp, Lc, window) for t in ts]
    computed, visited = 0, np.zeros((L, L), int)
    for me in range(cp):
        for t in steps:
            src = (me - t) % cp
            for qc, kc, causal in context_parallel.step_pairs(me, t, cp):
                for i, j, _ in context_parallel.sub_block_pairs(Lc // S, causal):
                    q = positions[me, qc, i * S:(i + 1) * S][:, None]
                    k = positions[src, kc, j * S:(j + 1) * S][None, :]
                    if window and q.min() - k.max() >= window:
                        continue  # wholly outside the window: skipped
                    shown = np.broadcast_to(visible(q, k, window), (S, S))
                    np.add.at(visited, (np.broadcast_to(q, (S, S))[shown], np.broadcast_to(k, (S, S))[shown]), 1)
                    computed += S * S
    pos = np.arange(L)
    assert (visited == visible(pos[:, None], pos[None, :], window)).all()
    assert computed / L**2 == pytest.approx(context_parallel.computed_fraction(L, cp, window))
    assert executed_attention("ring", L, cp, window)[1] == pytest.approx(context_parallel.computed_fraction(L, cp, window)) \
        or cp == 1
    if window:
        assert context_parallel.computed_fraction(L, cp, window) < context_parallel.computed_fraction(L, cp)


def test_blockwise_share_under_a_window(monkeypatch):
    import meshtrain.attention as attention_lib

    monkeypatch.setattr(attention_lib, "ATTENTION_BLOCK", 8)  # 8 blocks of 8
    assert executed_attention("blockwise", L)[1] == pytest.approx(9 / 16)
    # window 9: block i needs key blocks i and i - 1 (distance 1..15 reaches), 8 + 7 of the 64
    assert executed_attention("blockwise", L, window=9)[1] == pytest.approx(15 / 64)
