"""Context parallelism: causal attention with the sequence sharded over a mesh axis.

Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers"): each
of the `cp` devices on the `context` axis keeps its L/cp queries and passes its K/V block around
the ring with `lax.ppermute`; after cp steps every query has seen every key, folded in with an
online softmax (running max m, normaliser l, accumulator acc; fp32), so no device ever holds the
whole sequence's K/V or an [L, L] score matrix.

Contract. Arrays are in STORAGE order: `positions_L[i]` is the true position of stored token i,
and the sequence dimension is cut into cp contiguous slots, one per device. Causality is decided
on true positions (query sees key iff pos(query) >= pos(key)), so any layout is correct; the one
to use is `load_balanced_order` (the zigzag/load-balanced sharding of Megatron-CP and Llama 3):
cut the sequence into 2cp chunks and give slot i chunks i and 2cp-1-i, so every device does the
same causal work. Tokens, targets (and rotary positions) must be permuted the same way before
the model; the loss is a mean over tokens, so it needs no un-permuting.

Backward: a custom VJP that goes round the ring again (FlashAttention's blockwise backward per
held block: scores recomputed, p = exp(s - logsumexp)); dQ stays local, each block's dK/dV sums
travel with it and return home. Residuals per device are its own q, k, v, output and logsumexp,
O(L/cp): plain autodiff through the ring's scan would keep every step's K/V block and fp32
accumulator, O(L) per device, and give back the memory context parallelism is for.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.sharding import mesh_axis

_LOWEST = float(jnp.finfo(jnp.float32).min)  # masked score: exp(lowest - m) == 0 once m is real
RING_BLOCK = 512  # positions per sub-block: a ring step forms [S, S] scores, never [L/cp, L/cp]


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


def ring_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, axis: str = "context"):
    """Causal grouped-query attention (H = G*R; softmax in fp32, scale K**-0.5; output [B, L, H, K]
    in q's dtype) on arrays in storage order, `positions_L` (static ints) giving each stored
    token's true position. Call it under `jax.set_mesh`, inside `jax.jit` (and possibly inside a
    `jax.shard_map` over other axes). With `axis` in the mesh (size > 1), the sequence dimension is
    sharded over it and K/V go round the ring; without it, the same attention is computed locally.
    If `axis` is already manual (the caller's own shard_map), the arrays are the local shards and
    `positions_L` still covers the whole sequence."""
    positions_L = np.asarray(positions_L)
    mesh = jax.sharding.get_abstract_mesh()
    cp, manual = mesh_axis(axis)
    L = positions_L.shape[0]
    if positions_L.ndim != 1 or not np.array_equal(np.sort(positions_L), np.arange(L)):
        raise ValueError("positions_L must be a permutation of arange(seq_len)")
    local_len = q_BxLxHxK.shape[1]
    if local_len * (cp if manual else 1) != L or k_BxLxGxK.shape[1] != local_len:
        raise ValueError(f"positions_L has {L} positions for q {q_BxLxHxK.shape}, k "
                         f"{k_BxLxGxK.shape} (axis '{axis}' of {cp}, manual={manual})")
    H, G = q_BxLxHxK.shape[2], k_BxLxGxK.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads do not group over {G} kv heads")
    if cp == 1:
        return _ring_shard(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L[None], axis=None)
    if L % cp:
        raise ValueError(f"seq_len {L} does not split over {cp} devices of axis '{axis}'")
    # Inside pipeline stages every action runs under a per-stage conditional, and a collective-permute
    # there waits for the devices of the other stages too (XLA's CPU runtime): they gather instead.
    per_shard = functools.partial(_ring_shard, positions_PxC=positions_L.reshape(cp, L // cp),
                                  axis=axis, gather="pipeline" in mesh.manual_axes)
    if manual:  # already inside a shard_map over `axis`: the arrays are this device's slot
        return per_shard(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    seq = P(None, axis)  # batch and head dims: left to the compiler (other axes stay automatic)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq,
                         axis_names={axis}, check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def _ring_shard(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, positions_PxC, axis, gather: bool = False):
    """One device's part: its C = L/cp queries against each of the cp K/V blocks in turn, with a
    hand-written backward (a second trip round the ring) so that the residuals are this device's
    q, k, v, output and logsumexp, O(L/cp), not cp steps' worth of blocks and softmax state.
    `axis` None: one device holding everything (cp = 1, no communication). `gather`: the blocks
    come from one all-gather of K/V over the axis instead of the ring (Llama 3's all-gather
    context parallelism: K/V of the whole sequence on every device for the step), and the
    backward's dK/dV are reduce-scattered home."""
    B, C, H, K = q_BxCxHxK.shape
    G = k_BxCxGxK.shape[2]
    R, cp, scale = H // G, positions_PxC.shape[0], K ** -0.5
    # visible_PxP[i, j]: some query of slot i may see some key of slot j (else skip that block)
    visible_PxP = positions_PxC.max(axis=1)[:, None] >= positions_PxC.min(axis=1)[None, :]
    ring = [(i, (i + 1) % cp) for i in range(cp)]

    def send(x):
        """To the next device on the ring (a no-op on one device)."""
        return jax.lax.ppermute(x, axis, ring) if cp > 1 else x

    def slots(t):
        """(this device's slot, the slot of the block it holds at step t, i.e. me - t mod cp)."""
        me = jax.lax.axis_index(axis) if cp > 1 else 0
        return me, (me - t) % cp

    def around_ring(step, carry, kv):
        """carry = step(carry, t, *kv) for t = 0..cp-1, the K/V block passed on between steps (its
        send does not depend on the step, so the two overlap); no send after the last step."""
        if cp > 1 and gather:  # every block at once; step t takes slot me - t's
            blocks = [jax.lax.all_gather(x, axis) for x in kv]
            held = lambda t: [jax.lax.dynamic_index_in_dim(b, slots(t)[1], keepdims=False) for b in blocks]
            return jax.lax.scan(lambda carry, t: (step(carry, t, *held(t)), None), carry, jnp.arange(cp))[0]
        if cp > 1:
            def body(carry_kv, t):
                carry, kv = carry_kv
                return (step(carry, t, *kv), send(kv)), None

            (carry, kv), _ = jax.lax.scan(body, (carry, kv), jnp.arange(cp - 1))
        return step(carry, cp - 1, *kv)

    S = max(b for b in range(1, min(RING_BLOCK, C) + 1) if C % b == 0)  # sub-block of positions
    n = C // S

    def sub_blocks(x_BxCx_):
        """[B, C, ...] -> [n, B, S, ...]."""
        return x_BxCx_.reshape(x_BxCx_.shape[0], n, S, *x_BxCx_.shape[2:]).swapaxes(0, 1)

    def positions(t):
        """True positions [n, S] of our queries and of the block held at step t."""
        me, src = slots(t)
        table_PxC = jnp.asarray(positions_PxC, dtype=jnp.int32)  # made in the trace that uses it
        return table_PxC[me].reshape(n, S), table_PxC[src].reshape(n, S)

    def masked_scores(q_BxSxGxRxK, k_BxSxGxK, pq_S, pk_S):
        """Scaled scores of S queries against S keys, lowest where causality hides them."""
        causal_SxS = pq_S[:, None] >= pk_S[None, :]
        s_BxGxRxSxS = jnp.einsum("bqgrk,bmgk->bgrqm", q_BxSxGxRxK, k_BxSxGxK,
                                 preferred_element_type=jnp.float32)
        return jnp.where(causal_SxS, s_BxGxRxSxS * scale, _LOWEST), causal_SxS

    def unless_masked(update, carry, t, *kv):
        """update(carry, t, *kv), or carry unchanged where the held block is entirely masked."""
        if visible_PxP.all():  # e.g. load_balanced_order: no block is ever entirely masked
            return update(carry, t, *kv)
        me, src = slots(t)
        return jax.lax.cond(jnp.asarray(visible_PxP)[me, src], update, lambda c, *_: c,
                            carry, t, *kv)

    def forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK):
        """Online softmax round the ring: (output in q's dtype, each query's logsumexp)."""
        q_BxCxGxRxK = q_BxCxHxK.reshape(B, C, G, R, K)

        def update(stats, t, k_BxCxGxK, v_BxCxGxK):
            """Fold the held block into every query's running (m, l, acc), S x S scores at a time."""
            pq_NxS, pk_NxS = positions(t)
            keys = (sub_blocks(k_BxCxGxK), sub_blocks(v_BxCxGxK), pk_NxS)

            def query_block(xs):
                q_BxSxGxRxK, pq_S, *stats_i = xs

                def key_block(stats_i, ys):
                    m_BxGxRxS, l_BxGxRxS, acc_BxGxRxSxK = stats_i
                    k_BxSxGxK, v_BxSxGxK, pk_S = ys
                    s_BxGxRxSxS, _ = masked_scores(q_BxSxGxRxK, k_BxSxGxK, pq_S, pk_S)
                    m_new = jnp.maximum(m_BxGxRxS, s_BxGxRxSxS.max(axis=-1))
                    p_BxGxRxSxS = jnp.exp(s_BxGxRxSxS - m_new[..., None])
                    rescale = jnp.exp(m_BxGxRxS - m_new)
                    pv_BxGxRxSxK = jnp.einsum("bgrqm,bmgk->bgrqk", p_BxGxRxSxS.astype(v_BxSxGxK.dtype),
                                              v_BxSxGxK, preferred_element_type=jnp.float32)
                    return (m_new, l_BxGxRxS * rescale + p_BxGxRxSxS.sum(axis=-1),
                            acc_BxGxRxSxK * rescale[..., None] + pv_BxGxRxSxK), None

                return jax.lax.scan(key_block, tuple(stats_i), keys)[0]

            to_blocks = lambda x: jnp.moveaxis(x.reshape(B, G, R, n, S, *x.shape[4:]), 3, 0)
            from_blocks = lambda x: jnp.moveaxis(x, 0, 3).reshape(B, G, R, C, *x.shape[5:])
            q_NxBxSxGxRxK = sub_blocks(q_BxCxGxRxK)
            new = jax.lax.map(query_block, (q_NxBxSxGxRxK, pq_NxS, *map(to_blocks, stats)))
            return tuple(map(from_blocks, new))

        # Step 0 holds our own block, where every query sees at least itself: m is real before
        # any fully masked row arrives, whose scores then add exp(lowest - m) = 0.
        stats = (jnp.full((B, G, R, C), _LOWEST), jnp.zeros((B, G, R, C)),
                 jnp.zeros((B, G, R, C, K)))
        step = functools.partial(unless_masked, update)
        m_BxGxRxC, l_BxGxRxC, acc_BxGxRxCxK = around_ring(step, stats, (k_BxCxGxK, v_BxCxGxK))
        out_BxGxRxCxK = acc_BxGxRxCxK / l_BxGxRxC[..., None]
        out_BxCxHxK = out_BxGxRxCxK.transpose(0, 3, 1, 2, 4).reshape(B, C, H, K)
        return out_BxCxHxK.astype(q_BxCxHxK.dtype), m_BxGxRxC + jnp.log(l_BxGxRxC)

    def backward(residuals, dout_BxCxHxK):
        """The ring again, as in FlashAttention's backward per block (p = exp(s - lse)): dQ stays
        local; each block's dK/dV sums follow it round the ring one step behind (the sums for the
        block held at t-1 travel while step t computes), and a last send brings them home."""
        q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, out_BxCxHxK, lse_BxGxRxC = residuals
        q_BxCxGxRxK = q_BxCxHxK.reshape(B, C, G, R, K)
        do_BxCxGxRxK = dout_BxCxHxK.reshape(B, C, G, R, K)
        delta_BxCxGxR = jnp.einsum("bqgrk,bqgrk->bqgr", do_BxCxGxRxK,
                                   out_BxCxHxK.reshape(B, C, G, R, K),
                                   preferred_element_type=jnp.float32)
        delta_BxGxRxC = delta_BxCxGxR.transpose(0, 2, 3, 1)

        def update(grads, t, k_BxCxGxK, v_BxCxGxK):
            """Add the held block's part: dQ for our queries, dK/dV for its keys, S x S at a time."""
            dq_BxCxGxRxK, dk_BxCxGxK, dv_BxCxGxK = grads
            pq_NxS, pk_NxS = positions(t)
            keys = (sub_blocks(k_BxCxGxK), sub_blocks(v_BxCxGxK), pk_NxS)
            lse_NxBxGxRxS = jnp.moveaxis(lse_BxGxRxC.reshape(B, G, R, n, S), 3, 0)
            delta_NxBxGxRxS = jnp.moveaxis(delta_BxGxRxC.reshape(B, G, R, n, S), 3, 0)

            def query_block(dkv_NxBxSxGxK, xs):
                q_BxSxGxRxK, do_BxSxGxRxK, lse_BxGxRxS, delta_BxGxRxS, pq_S = xs

                def key_block(dq_BxSxGxRxK, ys):
                    k_BxSxGxK, v_BxSxGxK, pk_S = ys
                    s_BxGxRxSxS, causal_SxS = masked_scores(q_BxSxGxRxK, k_BxSxGxK, pq_S, pk_S)
                    p_BxGxRxSxS = jnp.where(causal_SxS, jnp.exp(s_BxGxRxSxS - lse_BxGxRxS[..., None]), 0.0)
                    dv = jnp.einsum("bgrqm,bqgrk->bmgk", p_BxGxRxSxS.astype(do_BxSxGxRxK.dtype),
                                    do_BxSxGxRxK, preferred_element_type=jnp.float32)
                    dp_BxGxRxSxS = jnp.einsum("bqgrk,bmgk->bgrqm", do_BxSxGxRxK, v_BxSxGxK,
                                              preferred_element_type=jnp.float32)
                    ds = (p_BxGxRxSxS * (dp_BxGxRxSxS - delta_BxGxRxS[..., None]) * scale).astype(q_BxCxHxK.dtype)
                    dq_BxSxGxRxK += jnp.einsum("bgrqm,bmgk->bqgrk", ds, k_BxSxGxK,
                                               preferred_element_type=jnp.float32)
                    dk = jnp.einsum("bgrqm,bqgrk->bmgk", ds, q_BxSxGxRxK, preferred_element_type=jnp.float32)
                    return dq_BxSxGxRxK, (dk, dv)

                dq_BxSxGxRxK, dkv = jax.lax.scan(key_block, jnp.zeros((B, S, G, R, K)), keys)
                return jax.tree.map(jnp.add, dkv_NxBxSxGxK, dkv), dq_BxSxGxRxK

            zeros_NxBxSxGxK = jnp.zeros((n, B, S, G, K))
            (dk_NxBxSxGxK, dv_NxBxSxGxK), dq_NxBxSxGxRxK = jax.lax.scan(
                query_block, (zeros_NxBxSxGxK, zeros_NxBxSxGxK),
                (sub_blocks(q_BxCxGxRxK), sub_blocks(do_BxCxGxRxK), lse_NxBxGxRxS, delta_NxBxGxRxS, pq_NxS))
            whole = lambda x: x.swapaxes(0, 1).reshape(B, C, *x.shape[3:])
            return (dq_BxCxGxRxK + whole(dq_NxBxSxGxRxK), dk_BxCxGxK + whole(dk_NxBxSxGxK),
                    dv_BxCxGxK + whole(dv_NxBxSxGxK))

        zeros_BxCxGxK = jnp.zeros((B, C, G, K))
        if cp > 1 and gather:
            def gathered_step(carry, t, k_BxCxGxK, v_BxCxGxK):
                dq_BxCxGxRxK, dk_PxBxCxGxK, dv_PxBxCxGxK = carry
                dq_BxCxGxRxK, dk, dv = unless_masked(
                    update, (dq_BxCxGxRxK, zeros_BxCxGxK, zeros_BxCxGxK), t, k_BxCxGxK, v_BxCxGxK)
                add = lambda total, d: jax.lax.dynamic_update_index_in_dim(
                    total, jax.lax.dynamic_index_in_dim(total, slots(t)[1]) + d[None], slots(t)[1], 0)
                return dq_BxCxGxRxK, add(dk_PxBxCxGxK, dk), add(dv_PxBxCxGxK, dv)

            zeros_PxBxCxGxK = jnp.zeros((cp, B, C, G, K))
            dq_BxCxGxRxK, dk_PxBxCxGxK, dv_PxBxCxGxK = around_ring(
                gathered_step, (jnp.zeros((B, C, G, R, K)), zeros_PxBxCxGxK, zeros_PxBxCxGxK),
                (k_BxCxGxK, v_BxCxGxK))
            home = lambda d: jax.lax.psum_scatter(d, axis, scatter_dimension=0)  # each block's sum, home
            return (dq_BxCxGxRxK.reshape(B, C, H, K).astype(q_BxCxHxK.dtype),
                    home(dk_PxBxCxGxK).astype(k_BxCxGxK.dtype), home(dv_PxBxCxGxK).astype(v_BxCxGxK.dtype))

        def step(carry, t, k_BxCxGxK, v_BxCxGxK):
            dq_BxCxGxRxK, dkv_prev = carry  # dkv_prev: the full sums so far of the block at t-1
            dk_in, dv_in = send(dkv_prev)  # so far for the block we hold now (zeros at step 0)
            dq_BxCxGxRxK, dk_BxCxGxK, dv_BxCxGxK = unless_masked(
                update, (dq_BxCxGxRxK, zeros_BxCxGxK, zeros_BxCxGxK), t, k_BxCxGxK, v_BxCxGxK)
            return dq_BxCxGxRxK, (dk_in + dk_BxCxGxK, dv_in + dv_BxCxGxK)

        carry = (jnp.zeros((B, C, G, R, K)), (zeros_BxCxGxK, zeros_BxCxGxK))
        dq_BxCxGxRxK, dkv = around_ring(step, carry, (k_BxCxGxK, v_BxCxGxK))
        dk_BxCxGxK, dv_BxCxGxK = send(dkv)  # the last block held is slot me + 1's: home
        return (dq_BxCxGxRxK.reshape(B, C, H, K).astype(q_BxCxHxK.dtype),
                dk_BxCxGxK.astype(k_BxCxGxK.dtype), dv_BxCxGxK.astype(v_BxCxGxK.dtype))

    @jax.custom_vjp
    def attend(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK):
        return forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK)[0]

    def attend_forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK):
        out_BxCxHxK, lse_BxGxRxC = forward(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK)
        return out_BxCxHxK, (q_BxCxHxK, k_BxCxGxK, v_BxCxGxK, out_BxCxHxK, lse_BxGxRxC)

    attend.defvjp(attend_forward, backward)
    return attend(q_BxCxHxK, k_BxCxGxK, v_BxCxGxK)
