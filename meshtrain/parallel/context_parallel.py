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

A chunk pair runs in S x S sub-blocks (S <= RING_BLOCK), listed ahead of time (`sub_block_pairs`):
a whole pair visits all n^2, a causal one the n(n+1)/2 on or below the diagonal, where the one mask
is the same lower triangle each time. No mask is computed from positions inside the loops: a
position-dependent [S, S] mask there depends on nothing the gradient flows through, so JAX's
partial evaluation hoists it out of the loops and stacks it per sub-block pair and ring step, an
O(L^2) buffer per device (2 GB per layer for Llama 3 8B at 32k tokens on context=4).

Backward: a custom VJP that goes round the ring again (FlashAttention's blockwise backward: scores
recomputed, p = exp(s - logsumexp)); dQ stays local, each block's dK/dV sums travel with it and
return home. Residuals per device are its own q, k, v, output and logsumexp, O(L/cp): plain
autodiff through the ring's scan would keep every step's K/V block and fp32 accumulator, O(L).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.core.errors import UserError
from meshtrain.parallel.sharding import mesh_axis

_LOWEST = float(jnp.finfo(jnp.float32).min)  # masked score: exp(lowest - m) == 0 once m is real
RING_BLOCK = 512  # positions per sub-block: a step forms [S, S] scores, never [Lc, Lc]


def load_balanced_order(seq_len: int, parts: int) -> np.ndarray:
    """positions[storage index] = true position: the sequence cut into 2*parts equal chunks, slot i
    of `parts` equal slots holding chunks i and 2*parts-1-i (an early and a late chunk, so causal
    attention costs every slot the same). parts=1: the identity."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if parts == 1:
        return np.arange(seq_len)
    if seq_len % (2 * parts):
        raise UserError(f"train.seq_len={seq_len} must split into 2 x {parts} equal chunks for "
                        f"load-balanced context parallelism; set train.seq_len to a multiple of "
                        f"{2 * parts} (or use a smaller context axis)")
    chunks_NxS = np.arange(seq_len).reshape(2 * parts, -1)
    slots = [np.concatenate([chunks_NxS[i], chunks_NxS[-1 - i]]) for i in range(parts)]
    return np.concatenate(slots)


# ---- the schedule, as data ----
def own_pairs(cp: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) pairs of a device's own block: (e, e) and (l, l) causal and
    (l, e) whole; with one device, the single chunk causal."""
    return [(0, 0, True)] if cp == 1 else [(0, 0, True), (1, 0, False), (1, 1, True)]


def step_pairs(me: int, t: int, cp: int) -> list[tuple[int, int, bool]]:
    """The visible (query chunk, key chunk, causal) pairs of device `me` at ring step t, whose held
    block is device me - t's: at t > 0, (c, c) and (l, e) with c = [src > me], both whole."""
    if t % cp == 0:
        return own_pairs(cp)
    c = int((me - t) % cp > me)
    return [(c, c, False), (1, 0, False)]


def sub_block_pairs(n: int, causal: bool) -> np.ndarray:
    """[items, 3] rows (query sub-block i, key sub-block j, diagonal) of a chunk pair cut into n
    sub-blocks: all n^2 for a whole pair; for a causal one the n(n+1)/2 with j <= i, the diagonal
    ones (i == j) masked by the lower triangle."""
    rows = [(i, j, int(causal and i == j)) for i in range(n) for j in range(n) if j <= i or not causal]
    return np.array(rows, dtype=np.int32)


def sub_block(chunk_len: int) -> int:
    """S: the largest divisor of the chunk length up to RING_BLOCK."""
    return max(b for b in range(1, min(RING_BLOCK, chunk_len) + 1) if chunk_len % b == 0)


def computed_fraction(seq_len: int, cp: int) -> float:
    """The share of the [L, L] score matrix the ring computes, summed over its cp devices:
    (2 n^2 cp + n) / (4 n^2 cp) = 1/2 + 1/(4 n cp) with n sub-blocks per chunk (the causal pairs'
    diagonal sub-blocks are computed whole); cp = 1 is one chunk: (n + 1) / (2n)."""
    chunks = 1 if cp == 1 else 2
    n = seq_len // (chunks * cp) // sub_block(seq_len // (chunks * cp))
    per_pair = {True: n * (n + 1) // 2, False: n * n}
    per_device = sum(per_pair[causal] for *_, causal in own_pairs(cp)) + (cp - 1) * 2 * per_pair[False]
    return cp * per_device / (chunks * cp * n) ** 2


# ---- one chunk pair, S x S sub-blocks at a time ----
def _scores(q_BxSxGxRxK, k_BxSxGxK, diagonal, lower_SxS):
    """Scaled fp32 scores [B, G, R, S, S]; on a diagonal sub-block, lowest above the diagonal."""
    s = jnp.einsum("bqgrk,bmgk->bgrqm", q_BxSxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32)
    s = s * q_BxSxGxRxK.shape[-1] ** -0.5
    return jnp.where(lower_SxS, s, jnp.where(diagonal, _LOWEST, s))


def _rows(x, i, S: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, i * S, S, axis=axis)


def _put_rows(x, update, i, S: int, axis: int):
    return jax.lax.dynamic_update_slice_in_dim(x, update, i * S, axis=axis)


def fold_pair(stats, q_BxLcxGxRxK, k_BxLcxGxK, v_BxLcxGxK, pairs, S: int):
    """Fold the keys of one chunk into its queries' running softmax `stats` (m, l [B, G, R, Lc],
    acc [B, G, R, Lc, K]), visiting the sub-block `pairs` (`sub_block_pairs`). Every row of a
    visited sub-block sees at least one key (a diagonal one sees itself), so m is real after it."""
    lower_SxS = np.tril(np.ones((S, S), bool))

    def item(stats, pair):
        i, j, diagonal = pair
        m, l, acc = (_rows(x, i, S, 3) for x in stats)
        v_BxSxGxK = _rows(v_BxLcxGxK, j, S, 1)
        s = _scores(_rows(q_BxLcxGxRxK, i, S, 1), _rows(k_BxLcxGxK, j, S, 1), diagonal, lower_SxS)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p_BxGxRxSxS = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv_BxGxRxSxK = jnp.einsum("bgrqm,bmgk->bgrqk", p_BxGxRxSxS.astype(v_BxSxGxK.dtype), v_BxSxGxK,
                                  preferred_element_type=jnp.float32)
        new = (m_new, l * rescale + p_BxGxRxSxS.sum(axis=-1), acc * rescale[..., None] + pv_BxGxRxSxK)
        return tuple(_put_rows(x, n, i, S, 3) for x, n in zip(stats, new)), None

    return jax.lax.scan(item, stats, jnp.asarray(pairs))[0]


def pair_grads(q_BxLcxGxRxK, k_BxLcxGxK, v_BxLcxGxK, do_BxLcxGxRxK, lse_BxGxRxLc, delta_BxGxRxLc, pairs,
               S: int):
    """One chunk pair's part of the backward (p = exp(s - logsumexp), ds = p (dp - delta)):
    (dq [B, Lc, G, R, K], dk, dv [B, Lc, G, K]) in fp32."""
    lower_SxS = np.tril(np.ones((S, S), bool))
    B, Lc, G, R, K = q_BxLcxGxRxK.shape

    def item(grads, pair):
        i, j, diagonal = pair
        dq, dk, dv = grads
        q_BxSxGxRxK, do_BxSxGxRxK = _rows(q_BxLcxGxRxK, i, S, 1), _rows(do_BxLcxGxRxK, i, S, 1)
        k_BxSxGxK, v_BxSxGxK = _rows(k_BxLcxGxK, j, S, 1), _rows(v_BxLcxGxK, j, S, 1)
        s = _scores(q_BxSxGxRxK, k_BxSxGxK, diagonal, lower_SxS)
        p_BxGxRxSxS = jnp.exp(s - _rows(lse_BxGxRxLc, i, S, 3)[..., None])  # 0 where masked
        dv_j = jnp.einsum("bgrqm,bqgrk->bmgk", p_BxGxRxSxS.astype(do_BxSxGxRxK.dtype), do_BxSxGxRxK,
                          preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqgrk,bmgk->bgrqm", do_BxSxGxRxK, v_BxSxGxK, preferred_element_type=jnp.float32)
        ds = (p_BxGxRxSxS * (dp - _rows(delta_BxGxRxLc, i, S, 3)[..., None]) * K ** -0.5).astype(q_BxSxGxRxK.dtype)
        dq_i = jnp.einsum("bgrqm,bmgk->bqgrk", ds, k_BxSxGxK, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bgrqm,bqgrk->bmgk", ds, q_BxSxGxRxK, preferred_element_type=jnp.float32)
        add = lambda total, part, at: _put_rows(total, _rows(total, at, S, 1) + part, at, S, 1)
        return (add(dq, dq_i, i), add(dk, dk_j, j), add(dv, dv_j, j)), None

    zeros = (jnp.zeros((B, Lc, G, R, K)), jnp.zeros((B, Lc, G, K)), jnp.zeros((B, Lc, G, K)))
    return jax.lax.scan(item, zeros, jnp.asarray(pairs))[0]


# ---- the ring ----
def ring_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, axis: str = "context"):
    """Causal grouped-query attention (H = G*R; softmax in fp32, scale K**-0.5; output [B, L, H, K]
    in q's dtype) on arrays in the load-balanced storage order: `positions_L` (static ints) must be
    `load_balanced_order(L, cp)`, cp the size of `axis`. Call it under `jax.set_mesh`, inside
    `jax.jit` (and possibly inside a `jax.shard_map` over other axes). With `axis` in the mesh (size
    > 1), the sequence dimension is sharded over it and K/V go round the ring; without it, the same
    attention is computed locally. If `axis` is already manual (the caller's own shard_map), the
    arrays are the local slots and `positions_L` still covers the whole sequence."""
    positions_L = np.asarray(positions_L)
    mesh = jax.sharding.get_abstract_mesh()
    cp, manual = mesh_axis(axis)
    L = positions_L.shape[0]
    local_len = q_BxLxHxK.shape[1]
    if local_len * (cp if manual else 1) != L or k_BxLxGxK.shape[1] != local_len:
        raise ValueError(f"positions_L has {L} positions for q {q_BxLxHxK.shape}, k "
                         f"{k_BxLxGxK.shape} (axis '{axis}' of {cp}, manual={manual})")
    H, G = q_BxLxHxK.shape[2], k_BxLxGxK.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads do not group over {G} kv heads")
    if cp == 1:  # one device: attend in true order, then store the output as the inputs were
        if positions_L.ndim != 1 or not np.array_equal(np.sort(positions_L), np.arange(L)):
            raise ValueError("positions_L must be a permutation of arange(seq_len)")
        if np.array_equal(positions_L, np.arange(L)):
            return _ring_shard(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, cp=1, axis=None)
        true_order = np.argsort(positions_L)
        q, k, v = (x[:, true_order] for x in (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK))
        return _ring_shard(q, k, v, cp=1, axis=None)[:, positions_L]
    if positions_L.ndim != 1 or not np.array_equal(positions_L, load_balanced_order(L, cp)):
        raise ValueError(f"ring attention runs on the load-balanced layout: positions_L must be "
                         f"load_balanced_order({L}, {cp})")
    # Inside pipeline stages every action runs under a per-stage conditional, and a collective-permute
    # there waits for the devices of the other stages too (XLA's CPU runtime): they gather instead.
    gather = "pipeline" in mesh.manual_axes
    per_shard = lambda q, k, v: _ring_shard(q, k, v, cp=cp, axis=axis, gather=gather)
    if manual:  # already inside a shard_map over `axis`: the arrays are this device's slot
        return per_shard(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    seq = P(None, axis)  # batch and head dims: left to the compiler (other axes stay automatic)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq,
                         axis_names={axis}, check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def _ring_shard(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, cp: int, axis, gather: bool = False):
    """One device's part: its C = L/cp queries (chunks e, l) against its own block and then each
    other device's, `step_pairs` deciding which chunk pairs, with a hand-written backward (a second
    trip round the ring). `axis` None: one device holding everything (no communication). `gather`:
    the blocks come from one all-gather of K/V over the axis instead of the ring (Llama 3's
    all-gather context parallelism), and the backward's dK/dV are reduce-scattered home."""
    B, C, H, K = q_BxCxHxK.shape
    G = k_BxCxGxK.shape[2]
    R, chunks = H // G, 1 if cp == 1 else 2
    Lc = C // chunks
    S = sub_block(Lc)
    whole, causal = sub_block_pairs(Lc // S, False), sub_block_pairs(Lc // S, True)
    pairs_of = {False: whole, True: causal}

    def me():
        return jax.lax.axis_index(axis) if cp > 1 else 0

    def source(t):
        return (me() - t) % cp

    def other_pairs(t):
        """`step_pairs` at t > 0, traced: (c, c) and (l, e) with c = [src > me], both whole."""
        c = (source(t) > me()).astype(jnp.int32)
        return [(c, c, False), (1, 0, False)]

    def split(x_BxCx_, per_head: bool = False):
        """[B, C, ...] -> [chunks, B, Lc, ...] (q and dout also split into G x R heads)."""
        x = x_BxCx_.reshape(B, chunks, Lc, *x_BxCx_.shape[2:]).swapaxes(0, 1)
        return x.reshape(chunks, B, Lc, G, R, K) if per_head else x

    def at(x, c):
        return jax.lax.dynamic_index_in_dim(x, c, keepdims=False)

    def add_at(x, c, part):
        return jax.lax.dynamic_update_index_in_dim(x, at(x, c) + part, c, 0)

    def around_ring(first, rest, carry, kv):
        """carry = first(carry, my own kv), then rest(carry, t, held kv) for t = 1..cp-1, the block of
        device me - t: passed on by `send` between steps (the send does not depend on the step's
        work, so the two overlap), or from one all-gather (`gather`)."""
        carry = first(carry, kv)
        if cp == 1:
            return carry
        if gather:
            blocks = [jax.lax.all_gather(x, axis) for x in kv]
            held = lambda t: [at(b, source(t)) for b in blocks]
            return jax.lax.scan(lambda c, t: (rest(c, t, held(t)), None), carry, jnp.arange(1, cp))[0]
        held = send(kv)
        if cp > 2:
            (carry, held), _ = jax.lax.scan(lambda ch, t: ((rest(ch[0], t, ch[1]), send(ch[1])), None),
                                            (carry, held), jnp.arange(1, cp - 1))
        return rest(carry, cp - 1, held)

    def send(x):
        """To the next device on the ring."""
        return jax.lax.ppermute(x, axis, [(i, (i + 1) % cp) for i in range(cp)])

    def forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK):
        """Online softmax round the ring: (output in q's dtype, each query's logsumexp)."""
        q = split(q_BxCxHxK, per_head=True)

        def fold(stats, qc, kc, k, v, is_causal):
            part = fold_pair(tuple(at(x, qc) for x in stats), at(q, qc), at(k, kc), at(v, kc),
                             pairs_of[is_causal], S)
            return tuple(jax.lax.dynamic_update_index_in_dim(x, p, qc, 0) for x, p in zip(stats, part))

        def first(stats, kv):
            for qc, kc, is_causal in own_pairs(cp):
                stats = fold(stats, qc, kc, *kv, is_causal)
            return stats

        def rest(stats, t, kv):
            for qc, kc, is_causal in other_pairs(t):
                stats = fold(stats, qc, kc, *kv, is_causal)
            return stats

        stats = (jnp.full((chunks, B, G, R, Lc), _LOWEST), jnp.zeros((chunks, B, G, R, Lc)),
                 jnp.zeros((chunks, B, G, R, Lc, K)))
        m, l, acc = around_ring(first, rest, stats, (split(k_BxCxGxK), split(v_BxCxGxK)))
        out_NxBxGxRxLcxK = acc / l[..., None]
        out_BxCxHxK = out_NxBxGxRxLcxK.transpose(1, 0, 4, 2, 3, 5).reshape(B, C, H, K)
        return out_BxCxHxK.astype(q_BxCxHxK.dtype), m + jnp.log(l)

    def backward(residuals, dout_BxCxHxK):
        """The ring again: dQ stays local; each block's dK/dV sums follow it round the ring (what
        the previous holder summed arrives as the block does) and a last send brings them home."""
        q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, out_BxCxHxK, lse_NxBxGxRxLc = residuals
        q, do = split(q_BxCxHxK, per_head=True), split(dout_BxCxHxK, per_head=True)
        delta_NxBxLcxGxR = jnp.einsum("nbqgrk,nbqgrk->nbqgr", do, split(out_BxCxHxK, per_head=True),
                                      preferred_element_type=jnp.float32)
        delta_NxBxGxRxLc = delta_NxBxLcxGxR.transpose(0, 1, 3, 4, 2)

        def grads(dq, dkv, qc, kc, k, v, is_causal):
            """Add the pair's dq to chunk qc of ours, its dk/dv to chunk kc of the held block's."""
            dq_c, dk_c, dv_c = pair_grads(at(q, qc), at(k, kc), at(v, kc), at(do, qc), at(lse_NxBxGxRxLc, qc),
                                          at(delta_NxBxGxRxLc, qc), pairs_of[is_causal], S)
            return add_at(dq, qc, dq_c), (add_at(dkv[0], kc, dk_c), add_at(dkv[1], kc, dv_c))

        zeros_kv = (jnp.zeros((chunks, B, Lc, G, K)), jnp.zeros((chunks, B, Lc, G, K)))

        def block_grads(dq, dkv, pairs, kv):
            for qc, kc, is_causal in pairs:
                dq, dkv = grads(dq, dkv, qc, kc, *kv, is_causal)
            return dq, dkv

        kv = (split(k_BxCxGxK), split(v_BxCxGxK))
        dq0 = jnp.zeros((chunks, B, Lc, G, R, K))
        if cp > 1 and gather:  # dK/dV per source slot, summed home by one reduce-scatter
            slots = tuple(jnp.zeros((cp,) + z.shape) for z in zeros_kv)

            def into_slots(carry, src, pairs, kv):
                dq, dkv = block_grads(carry[0], zeros_kv, pairs, kv)
                return dq, tuple(add_at(s, src, d) for s, d in zip(carry[1], dkv))

            dq, slots = around_ring(lambda c, kv: into_slots(c, me(), own_pairs(cp), kv),
                                    lambda c, t, kv: into_slots(c, source(t), other_pairs(t), kv), (dq0, slots), kv)
            dk, dv = (jax.lax.psum_scatter(s, axis, scatter_dimension=0) for s in slots)
        else:
            def first(carry, kv):
                return block_grads(*carry, own_pairs(cp), kv)

            def rest(carry, t, kv):  # the sums so far for the block we now hold arrive with it
                return block_grads(carry[0], send(carry[1]), other_pairs(t), kv)

            dq, dkv = around_ring(first, rest, (dq0, zeros_kv), kv)
            dk, dv = send(dkv) if cp > 1 else dkv  # the last block held is device me + 1's: home

        unsplit = lambda x, like: x.swapaxes(0, 1).reshape(like.shape).astype(like.dtype)
        return unsplit(dq, q_BxCxHxK), unsplit(dk, k_BxCxGxK), unsplit(dv, v_BxCxGxK)

    @jax.custom_vjp
    def attend(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK):
        return forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK)[0]

    def attend_forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK):
        out_BxCxHxK, lse = forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK)
        return out_BxCxHxK, (q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, out_BxCxHxK, lse)

    attend.defvjp(attend_forward, backward)
    return attend(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK)
