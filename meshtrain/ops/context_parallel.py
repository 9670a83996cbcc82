"""Context parallelism: causal attention with the sequence sharded over a mesh axis.

Layout (the load-balanced or "zigzag" order of Megatron-CP and Llama 3, `load_balanced_order`): the
sequence is cut into 2cp chunks of Lc = L/(2cp) positions and device i of the cp on the axis holds
chunks i and 2cp-1-i, its early chunk `e` and its late chunk `l`, in that order. Tokens, targets and
rotary positions are permuted the same way before the model; the loss is a mean over tokens, so it
needs no un-permuting.

Ring attention (Liu, Zaharia & Abbeel 2023): each device keeps its queries and passes its K/V block
round the ring with `lax.ppermute`; at step t it holds the block of device src = me - t (mod cp),
folded in with an online softmax (running max m, normaliser l, accumulator acc; fp32), so no
device holds the whole sequence's K/V or an [L, L] score matrix.

Causal skipping. Device i's early chunk precedes device j's early chunk iff i < j, and every late
chunk follows every early one, so of the four chunk pairs (my queries x the held keys) a step
needs only two, the same amount of work on every device:
- t = 0, my own block: (e, e) and (l, l) causal, (l, e) whole; (e, l) is hidden;
- t > 0, src < me: (e, e_src) and (l, e_src) whole; src's late chunk follows both of mine;
- t > 0, src > me: (l, l_src) and (l, e_src) whole; my early chunk precedes both of src's.
That is (c, c) and (l, e_src) with c = [src > me] (`step_pairs`). A ring thus computes
1/2 + 1/(4 n cp) of the [L, L] scores (n = Lc/S sub-blocks per chunk), half of attending every
block, as blockwise attention does on one device (`computed_fraction`). The K/V exchange stays
cp - 1 blocks per layer: a block passes through devices that need all of it.
A sliding window shorter than the ring needs only the steps whose nearest chunk pair it reaches,
one leg of them each way round the ring (`ring_legs`, `ring_sends`).

A chunk pair runs in S x S sub-blocks (S <= RING_BLOCK), listed ahead of time (`sub_block_pairs`):
a whole pair visits all n^2, a causal one the n(n+1)/2 on or below the diagonal, where the one mask
is the same lower triangle each time. No mask is computed from positions inside the loops: a
position-dependent [S, S] mask there depends on nothing the gradient flows through, so JAX's
partial evaluation hoists it out of the loops and stacks it per sub-block pair and ring step, an
O(L^2) buffer per device (2 GB per layer for Llama 3 8B at 32k tokens on context=4).
Document masks (segment ids) and windows (meshtrain/ops/packing.py) add a mask per sub-block
(`PairMask`), computed inside the loops: the custom VJP below is never partially evaluated, so
nothing is hoisted; a sub-block wholly outside the window is skipped.

Backward: a custom VJP that goes round the ring again (FlashAttention's blockwise backward: scores
recomputed, p = exp(s - logsumexp)); dQ stays local, each block's dK/dV sums travel with it and
return home. Residuals per device are its own q, k, v, output and logsumexp, O(L/cp): plain
autodiff through the ring's scan would keep every step's K/V block and fp32 accumulator, O(L).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.ops.packing import block_reaches, visible
from meshtrain.ops.ring_schedule import (
    chunk_start,
    load_balanced_order,
    own_pairs,
    ring_legs,
    sub_block,
    sub_block_pairs,
)
from meshtrain.parallel.sharding import mesh_axis

_LOWEST = float(jnp.finfo(jnp.float32).min)  # masked score: exp(lowest - m) == 0 once m is real


# ---- one chunk pair, S x S sub-blocks at a time ----
class PairMask(NamedTuple):
    """What masks a chunk pair beyond causality: the true positions of its first query and key
    (q0, k0, traced), the `window` (0: none) and the segment ids of its queries and keys ([B, Lc],
    or None). A sub-block wholly outside the window is skipped."""
    q0: jax.Array
    k0: jax.Array
    window: int
    q_seg: jax.Array | None
    k_seg: jax.Array | None

    def sub_block(self, i, j, S: int):
        """(the [.., S, S] mask of sub-block (i, j), whether it is needed at all)."""
        pos = jnp.arange(S)
        q_pos, k_pos = (self.q0 + i * S + pos)[:, None], (self.k0 + j * S + pos)[None, :]
        segs = ()
        if self.q_seg is not None:
            segs = (_rows(self.q_seg, i, S, 1)[:, None, None, :, None],
                    _rows(self.k_seg, j, S, 1)[:, None, None, None, :])
        return (visible(q_pos, k_pos, self.window, *segs),
                jnp.asarray(block_reaches(self.q0 + i * S, self.k0 + j * S + S - 1, self.window)))


def _scores(q_BxSxGxRxK, k_BxSxGxK, diagonal, lower_SxS, mask=None):
    """Scaled fp32 scores [B, G, R, S, S]; on a diagonal sub-block, lowest above the diagonal; lowest
    where `mask` (a PairMask's) is False."""
    s = jnp.einsum("bqgrk,bmgk->bgrqm", q_BxSxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32)
    s = s * q_BxSxGxRxK.shape[-1] ** -0.5
    s = jnp.where(lower_SxS, s, jnp.where(diagonal, _LOWEST, s))
    return s if mask is None else jnp.where(mask, s, _LOWEST)


def _rows(x, i, S: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, i * S, S, axis=axis)


def _put_rows(x, update, i, S: int, axis: int):
    return jax.lax.dynamic_update_slice_in_dim(x, update, i * S, axis=axis)


def _scan_items(item, init, pairs, masks: PairMask | None, S: int):
    """Scan `item(carry, (i, j, diagonal), mask)` over the sub-block `pairs`; with `masks`, each with
    its sub-block's mask, and skipped where the window leaves it empty."""
    if masks is None:
        return jax.lax.scan(lambda c, pair: (item(c, pair, None), None), init, jnp.asarray(pairs))[0]

    def masked(carry, pair):
        mask, needed = masks.sub_block(pair[0], pair[1], S)
        return jax.lax.cond(needed, lambda c: item(c, pair, mask), lambda c: c, carry), None

    return jax.lax.scan(masked, init, jnp.asarray(pairs))[0]


def fold_pair(stats, q_BxLcxGxRxK, k_BxLcxGxK, v_BxLcxGxK, pairs, S: int, masks: PairMask | None = None):
    """Fold the keys of one chunk into its queries' running softmax `stats` (m, l [B, G, R, Lc],
    acc [B, G, R, Lc, K]), visiting the sub-block `pairs` (`sub_block_pairs`). Every row of a
    visited sub-block sees at least one key (a diagonal one sees itself), so m is real after it;
    with `masks` a row may see none yet (p is 0 there, and m is rescaled away later)."""
    lower_SxS = np.tril(np.ones((S, S), bool))

    def item(stats, pair, mask):
        i, j, diagonal = pair
        m, l, acc = (_rows(x, i, S, 3) for x in stats)
        v_BxSxGxK = _rows(v_BxLcxGxK, j, S, 1)
        s = _scores(_rows(q_BxLcxGxRxK, i, S, 1), _rows(k_BxLcxGxK, j, S, 1), diagonal, lower_SxS, mask)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p_BxGxRxSxS = jnp.exp(s - m_new[..., None])
        if mask is not None:
            p_BxGxRxSxS = jnp.where(mask, p_BxGxRxSxS, 0.0)
        rescale = jnp.exp(m - m_new)
        pv_BxGxRxSxK = jnp.einsum("bgrqm,bmgk->bgrqk", p_BxGxRxSxS.astype(v_BxSxGxK.dtype), v_BxSxGxK,
                                  preferred_element_type=jnp.float32)
        new = (m_new, l * rescale + p_BxGxRxSxS.sum(axis=-1), acc * rescale[..., None] + pv_BxGxRxSxK)
        return tuple(_put_rows(x, n, i, S, 3) for x, n in zip(stats, new))

    return _scan_items(item, stats, pairs, masks, S)


def pair_grads(q_BxLcxGxRxK, k_BxLcxGxK, v_BxLcxGxK, do_BxLcxGxRxK, lse_BxGxRxLc, delta_BxGxRxLc, pairs,
               S: int, masks: PairMask | None = None):
    """One chunk pair's part of the backward (p = exp(s - logsumexp), ds = p (dp - delta)):
    (dq [B, Lc, G, R, K], dk, dv [B, Lc, G, K]) in fp32."""
    lower_SxS = np.tril(np.ones((S, S), bool))
    B, Lc, G, R, K = q_BxLcxGxRxK.shape

    def item(grads, pair, mask):
        i, j, diagonal = pair
        dq, dk, dv = grads
        q_BxSxGxRxK, do_BxSxGxRxK = _rows(q_BxLcxGxRxK, i, S, 1), _rows(do_BxLcxGxRxK, i, S, 1)
        k_BxSxGxK, v_BxSxGxK = _rows(k_BxLcxGxK, j, S, 1), _rows(v_BxLcxGxK, j, S, 1)
        s = _scores(q_BxSxGxRxK, k_BxSxGxK, diagonal, lower_SxS, mask)
        p_BxGxRxSxS = jnp.exp(s - _rows(lse_BxGxRxLc, i, S, 3)[..., None])  # 0 where masked
        dv_j = jnp.einsum("bgrqm,bqgrk->bmgk", p_BxGxRxSxS.astype(do_BxSxGxRxK.dtype), do_BxSxGxRxK,
                          preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqgrk,bmgk->bgrqm", do_BxSxGxRxK, v_BxSxGxK, preferred_element_type=jnp.float32)
        ds = (p_BxGxRxSxS * (dp - _rows(delta_BxGxRxLc, i, S, 3)[..., None]) * K ** -0.5).astype(q_BxSxGxRxK.dtype)
        dq_i = jnp.einsum("bgrqm,bmgk->bqgrk", ds, k_BxSxGxK, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bgrqm,bqgrk->bmgk", ds, q_BxSxGxRxK, preferred_element_type=jnp.float32)
        add = lambda total, part, at: _put_rows(total, _rows(total, at, S, 1) + part, at, S, 1)
        return add(dq, dq_i, i), add(dk, dk_j, j), add(dv, dv_j, j)

    zeros = (jnp.zeros((B, Lc, G, R, K)), jnp.zeros((B, Lc, G, K)), jnp.zeros((B, Lc, G, K)))
    return _scan_items(item, zeros, pairs, masks, S)


# ---- the ring ----
def ring_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, axis: str = "context", segment_ids=None,
                   window: int = 0):
    """Causal grouped-query attention (H = G*R; softmax in fp32, scale K**-0.5; output [B, L, H, K]
    in q's dtype) on arrays in the load-balanced storage order: `positions_L` (static ints) must be
    `load_balanced_order(L, cp)`, cp the size of `axis`. Call it under `jax.set_mesh`, inside
    `jax.jit` (and possibly inside a `jax.shard_map` over other axes). With `axis` in the mesh (size
    > 1), the sequence dimension is sharded over it and K/V go round the ring; without it, the same
    attention is computed locally. If `axis` is already manual (the caller's own shard_map), the
    arrays are the local slots and `positions_L` still covers the whole sequence. `segment_ids`
    [B, L] (storage order, the whole sequence even where `axis` is manual: every device reads the
    held block's from it, nothing more travels) and `window` mask as meshtrain/ops/packing.py says."""
    positions_L = np.asarray(positions_L)
    mesh = jax.sharding.get_abstract_mesh()
    cp, manual = mesh_axis(axis)
    L = positions_L.shape[0]
    local_len = q_BxLxHxK.shape[1]
    if local_len * (cp if manual else 1) != L or k_BxLxGxK.shape[1] != local_len:
        raise ValueError(f"positions_L has {L} positions for q {q_BxLxHxK.shape}, k "
                         f"{k_BxLxGxK.shape} (axis '{axis}' of {cp}, manual={manual})")
    if segment_ids is not None and segment_ids.shape[1] != L:
        raise ValueError(f"segment_ids {segment_ids.shape} must cover the whole sequence of {L}")
    H, G = q_BxLxHxK.shape[2], k_BxLxGxK.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads do not group over {G} kv heads")
    if cp == 1:  # one device: attend in true order, then store the output as the inputs were
        if positions_L.ndim != 1 or not np.array_equal(np.sort(positions_L), np.arange(L)):
            raise ValueError("positions_L must be a permutation of arange(seq_len)")
        ring = Ring(cp=1, axis=None, window=window)
        if np.array_equal(positions_L, np.arange(L)):
            return ring.attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids)
        true_order = np.argsort(positions_L)
        q, k, v = (x[:, true_order] for x in (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK))
        segments = None if segment_ids is None else segment_ids[:, true_order]
        return ring.attend(q, k, v, segments)[:, positions_L]
    if positions_L.ndim != 1 or not np.array_equal(positions_L, load_balanced_order(L, cp)):
        raise ValueError(f"ring attention runs on the load-balanced layout: positions_L must be "
                         f"load_balanced_order({L}, {cp})")
    # Inside pipeline stages every action runs under a per-stage conditional, and a collective-permute
    # there waits for the devices of the other stages too (XLA's CPU runtime): they gather instead.
    ring = Ring(cp=cp, axis=axis, window=window, gather="pipeline" in mesh.manual_axes)
    if manual:  # already inside a shard_map over `axis`: the arrays are this device's slot
        return ring.attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids)
    seq = P(None, axis)  # batch and head dims: left to the compiler (other axes stay automatic)
    whole = () if segment_ids is None else (P(),)
    return jax.shard_map(ring.attend, mesh=mesh, in_specs=(seq, seq, seq, *whole), out_specs=seq,
                         axis_names={axis}, check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK,
                                                             *([] if segment_ids is None else [segment_ids]))


def _at(x, c):
    return jax.lax.dynamic_index_in_dim(x, c, keepdims=False)


def _add_at(x, c, part):
    return jax.lax.dynamic_update_index_in_dim(x, _at(x, c) + part, c, 0)


class Ring(NamedTuple):
    """One device's part of the ring: its C = L/cp queries (chunks e, l) against its own block and
    then the blocks `ring_legs` visits, `step_pairs` deciding which chunk pairs, with a hand-written
    backward (a second trip round the ring). `axis` None: one device holding everything (no
    communication). `gather`: the blocks come from one all-gather of K/V over the axis instead of
    the ring (Llama 3's all-gather context parallelism), and the backward's dK/dV are
    reduce-scattered home. `group`: devices per ring member (hybrid context parallelism,
    meshtrain/ops/ulysses.py): device d of the axis is member d // group, and K/V pass between the
    devices of the same place d % group in their groups."""
    cp: int
    axis: str | None
    window: int = 0
    gather: bool = False
    group: int = 1

    def member_groups(self):
        """The axis's devices by place in their group, each list one ring (None: the whole axis)."""
        g = self.group
        return None if g == 1 else [[m * g + j for m in range(self.cp)] for j in range(g)]

    def attend(self, q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, segment_ids_BxL=None):
        """The ring's attention of this device's slot, with its custom VJP."""
        layout = _Layout.of(self, q_BxCxHxK.shape, k_BxCxGxK.shape[2])

        @jax.custom_vjp
        def attend(q, k, v, segments):
            return _ring_forward(layout, q, k, v, segments)[0]

        def attend_forward(q, k, v, segments):
            out, lse = _ring_forward(layout, q, k, v, segments)
            return out, (q, k, v, segments, out, lse)

        def attend_backward(residuals, dout):
            dq, dk, dv = _ring_backward(layout, residuals, dout)
            segments = residuals[3]
            return dq, dk, dv, None if segments is None else np.zeros(segments.shape, jax.dtypes.float0)

        attend.defvjp(attend_forward, attend_backward)
        return attend(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, segment_ids_BxL)


class _Layout(NamedTuple):
    """A Ring on one slot's shapes: B, C positions, G kv heads x R, K; chunks (1 or 2) of Lc
    positions in S-position sub-blocks."""
    ring: Ring
    B: int
    C: int
    G: int
    R: int
    K: int
    chunks: int
    Lc: int
    S: int

    @staticmethod
    def of(ring: Ring, q_shape, G: int) -> _Layout:
        B, C, H, K = q_shape
        chunks = 1 if ring.cp == 1 else 2
        Lc = C // chunks
        return _Layout(ring, B, C, G, H // G, K, chunks, Lc, sub_block(Lc))

    @property
    def masked(self) -> bool:
        return bool(self.ring.window)

    def me(self):
        return jax.lax.axis_index(self.ring.axis) // self.ring.group if self.ring.cp > 1 else 0

    def source(self, t):
        return (self.me() - t) % self.ring.cp

    def other_pairs(self, t):
        """`step_pairs` at t > 0, traced: (c, c) and (l, e) with c = [src > me], both whole."""
        c = (self.source(t) > self.me()).astype(jnp.int32)
        return [(c, c, False), (1, 0, False)]

    def sub_pairs(self, causal: bool):
        return sub_block_pairs(self.Lc // self.S, causal)

    def split(self, x_BxCx_, per_head: bool = False):
        """[B, C, ...] -> [chunks, B, Lc, ...] (q and dout also split into G x R heads)."""
        x = x_BxCx_.reshape(self.B, self.chunks, self.Lc, *x_BxCx_.shape[2:]).swapaxes(0, 1)
        return x.reshape(self.chunks, self.B, self.Lc, self.G, self.R, self.K) if per_head else x

    def pair_mask(self, segments_BxL, qc, src, kc) -> PairMask | None:
        """The PairMask of my chunk qc against chunk kc of device src's block (None: causal only)."""
        if segments_BxL is None and not self.masked:
            return None
        cp, me = self.ring.cp, self.me()
        seg = lambda device, c: None if segments_BxL is None else jax.lax.dynamic_slice_in_dim(
            segments_BxL, device * self.C + c * self.Lc, self.Lc, axis=1)
        return PairMask(chunk_start(me, qc, cp, self.Lc), chunk_start(src, kc, cp, self.Lc), self.ring.window,
                        seg(me, qc), seg(src, kc))

    def send(self, x, hop: int):
        """To the device `hop` places on along the ring."""
        cp, g = self.ring.cp, self.ring.group
        return jax.lax.ppermute(x, self.ring.axis, [(i, ((i // g + hop) % cp) * g + i % g) for i in range(cp * g)])

    def legs(self):
        return ring_legs(self.ring.cp, self.Lc, self.ring.window)

    def around_ring(self, first, rest, carry, kv):
        """carry = first(carry, my own kv), then rest(carry, t, held kv) for each leg's steps t, the
        block of device me - t: passed on by `send` between steps (the send does not depend on the
        step's work, so the two overlap), or from one all-gather (`gather`)."""
        carry = first(carry, kv)
        if self.ring.gather and self.ring.cp > 1:
            blocks = [jax.lax.all_gather(x, self.ring.axis, axis_index_groups=self.ring.member_groups()) for x in kv]
            held = lambda t: [_at(b, self.source(t)) for b in blocks]
            steps = jnp.asarray([t for _, ts in self.legs() for t in ts])
            return jax.lax.scan(lambda c, t: (rest(c, t, held(t)), None), carry, steps)[0]
        for hop, steps in self.legs():
            held = self.send(kv, hop)
            if len(steps) > 1:
                def step(ch, t, hop=hop):
                    return (rest(ch[0], t, ch[1]), self.send(ch[1], hop)), None
                (carry, held), _ = jax.lax.scan(step, (carry, held), jnp.asarray(steps[:-1]))
            carry = rest(carry, steps[-1], held)
        return carry


def _ring_forward(layout: _Layout, q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, segments_BxL):
    """Online softmax round the ring: (output in q's dtype, each query's logsumexp [chunks, B, G, R, Lc])."""
    B, G, R, K, chunks, Lc, S = (getattr(layout, f) for f in "B G R K chunks Lc S".split())
    q = layout.split(q_BxCxHxK, per_head=True)

    def fold_pairs(stats, pairs, src, k, v):
        for qc, kc, causal in pairs:
            part = fold_pair(tuple(_at(x, qc) for x in stats), _at(q, qc), _at(k, kc), _at(v, kc),
                             layout.sub_pairs(causal), S, layout.pair_mask(segments_BxL, qc, src, kc))
            stats = tuple(jax.lax.dynamic_update_index_in_dim(x, p, qc, 0) for x, p in zip(stats, part))
        return stats

    first = lambda stats, kv: fold_pairs(stats, own_pairs(layout.ring.cp), layout.me(), *kv)
    rest = lambda stats, t, kv: fold_pairs(stats, layout.other_pairs(t), layout.source(t), *kv)
    stats = (jnp.full((chunks, B, G, R, Lc), _LOWEST), jnp.zeros((chunks, B, G, R, Lc)),
             jnp.zeros((chunks, B, G, R, Lc, K)))
    m, l, acc = layout.around_ring(first, rest, stats, (layout.split(k_BxCxGxK), layout.split(v_BxCxGxK)))
    out_NxBxGxRxLcxK = acc / l[..., None]
    out_BxCxHxK = out_NxBxGxRxLcxK.transpose(1, 0, 4, 2, 3, 5).reshape(B, layout.C, G * R, K)
    return out_BxCxHxK.astype(q_BxCxHxK.dtype), m + jnp.log(l)


def _ring_backward(layout: _Layout, residuals, dout_BxCxHxK):
    """The ring again: dQ stays local; each block's dK/dV sums follow it round the ring (what the
    previous holder summed arrives as the block does) and a last send per leg brings them home; a
    second leg starts from zero sums (the first leg carried the own block's)."""
    q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, segments_BxL, out_BxCxHxK, lse_NxBxGxRxLc = residuals
    B, G, R, K, chunks, Lc, S = (getattr(layout, f) for f in "B G R K chunks Lc S".split())
    cp, axis = layout.ring.cp, layout.ring.axis
    q, do = layout.split(q_BxCxHxK, per_head=True), layout.split(dout_BxCxHxK, per_head=True)
    delta_NxBxLcxGxR = jnp.einsum("nbqgrk,nbqgrk->nbqgr", do, layout.split(out_BxCxHxK, per_head=True),
                                  preferred_element_type=jnp.float32)
    delta_NxBxGxRxLc = delta_NxBxLcxGxR.transpose(0, 1, 3, 4, 2)

    def block_grads(dq, dkv, pairs, src, kv):
        """Add each pair's dq to chunk qc of ours, its dk/dv to chunk kc of the held block's."""
        k, v = kv
        for qc, kc, causal in pairs:
            dq_c, dk_c, dv_c = pair_grads(_at(q, qc), _at(k, kc), _at(v, kc), _at(do, qc), _at(lse_NxBxGxRxLc, qc),
                                          _at(delta_NxBxGxRxLc, qc), layout.sub_pairs(causal), S,
                                          layout.pair_mask(segments_BxL, qc, src, kc))
            dq, dkv = _add_at(dq, qc, dq_c), (_add_at(dkv[0], kc, dk_c), _add_at(dkv[1], kc, dv_c))
        return dq, dkv

    zeros_kv = (jnp.zeros((chunks, B, Lc, G, K)), jnp.zeros((chunks, B, Lc, G, K)))
    kv = (layout.split(k_BxCxGxK), layout.split(v_BxCxGxK))
    dq0 = jnp.zeros((chunks, B, Lc, G, R, K))
    own = lambda carry, kv, into: into(carry, layout.me(), own_pairs(cp), kv)
    other = lambda carry, t, kv, into: into(carry, layout.source(t), layout.other_pairs(t), kv)
    if cp > 1 and layout.ring.gather:  # dK/dV per source slot, summed home by one reduce-scatter
        def into_slots(carry, src, pairs, kv):
            dq, dkv = block_grads(carry[0], zeros_kv, pairs, src, kv)
            return dq, tuple(_add_at(s, src, d) for s, d in zip(carry[1], dkv))

        slots = tuple(jnp.zeros((cp,) + z.shape) for z in zeros_kv)
        dq, slots = layout.around_ring(lambda c, kv: own(c, kv, into_slots),
                                       lambda c, t, kv: other(c, t, kv, into_slots), (dq0, slots), kv)
        dk, dv = (jax.lax.psum_scatter(s, axis, scatter_dimension=0, axis_index_groups=layout.ring.member_groups())
                  for s in slots)
    else:
        dq, dkv = block_grads(dq0, zeros_kv, own_pairs(cp), layout.me(), kv)
        dk, dv = zeros_kv if layout.legs() else dkv  # the own block's sums travel with the first leg
        for n, (hop, steps) in enumerate(layout.legs()):
            dq, dkv = _backward_leg(layout, block_grads, dq, dkv if n == 0 else None, kv, hop, steps)
            home = layout.send(dkv, -steps[-1])  # the last block held was device me - t's: home
            dk, dv = dk + home[0], dv + home[1]

    unsplit = lambda x, like: x.swapaxes(0, 1).reshape(like.shape).astype(like.dtype)
    return unsplit(dq, q_BxCxHxK), unsplit(dk, k_BxCxGxK), unsplit(dv, v_BxCxGxK)


def _backward_leg(layout: _Layout, block_grads, dq, dkv, kv, hop: int, steps: list[int]):
    """One leg of the backward ring: the blocks of `steps` arrive `hop` devices on at a time, and
    with each the dK/dV summed for it so far (`dkv` travels with the first; None: zeros, nothing to
    send); the next block's send overlaps the step's work. (dq, the last held block's dK/dV sums)."""
    held = layout.send(kv, hop)
    dkv = tuple(jnp.zeros(x.shape, jnp.float32) for x in kv) if dkv is None else layout.send(dkv, hop)
    pairs = lambda t: (layout.other_pairs(t), layout.source(t))
    if len(steps) > 1:
        def step(carry, t):
            dq, dkv, held = carry
            coming = layout.send(held, hop)
            dq, dkv = block_grads(dq, dkv, *pairs(t), held)
            return (dq, layout.send(dkv, hop), coming), None

        (dq, dkv, held), _ = jax.lax.scan(step, (dq, dkv, held), jnp.asarray(steps[:-1]))
    return block_grads(dq, dkv, *pairs(steps[-1]), held)
