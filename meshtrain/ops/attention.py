"""Attention backends, chosen by the plan (`parallel.attention`), never by the model: the model
calls the kernel it is given with q [B, L, H, K], k and v [B, L, G, K] (grouped-query: H = G x R)
and `positions_L`, the true position of each stored sequence position (None: in order; context
parallelism stores the sequence permuted, meshtrain/ops/context_parallel.py). Every backend is causal,
takes the softmax in fp32 and returns [B, L, H, K] in q's dtype. Two optional masks, in every
backend (meshtrain/ops/packing.py `visible`): `segment_ids` [B, L] (stored like q; packed documents,
a query sees only its own document's keys) and `window` (static int, 0 = full causal: query i
sees keys i - window < j <= i, Mistral / Gemma sliding-window attention).

- `xla`: forms the [B, H, L, L] scores.
- `blockwise`: online softmax over blocks of positions; never forms them (any device).
- `cudnn`: cuDNN's fused kernel (NVIDIA GPUs, bf16).
- `ring`: context parallelism over the mesh's `context` axis: each device keeps its queries and
  passes keys and values around the ring (meshtrain/ops/context_parallel.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.core.errors import first_line
from meshtrain.ops.context_parallel import ring_attention
from meshtrain.ops.packing import block_reaches, visible
from meshtrain.ops.ring_schedule import computed_fraction
from meshtrain.parallel.sharding import rule_axes

ATTENTION_BLOCK = 512  # positions per query/key block of the blockwise kernel, at most
MIN_ATTENTION_BLOCK = 128  # smaller blocks run too many serial steps: refused (meshtrain/config/validate.py)


def attention_block(seq_len: int) -> int:
    """The blockwise kernel's block: the largest divisor of seq_len up to ATTENTION_BLOCK."""
    return max(b for b in range(1, min(ATTENTION_BLOCK, seq_len) + 1) if seq_len % b == 0)


def xla_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L=None, segment_ids=None, window: int = 0):
    """Forms the [B, G, R, L, L] scores: XLA fuses what it can."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    scores = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK, preferred_element_type=jnp.float32)
    scores = scores * K ** -0.5
    pos_L = jnp.arange(L) if positions_L is None else jnp.asarray(positions_L)
    seg = (None, None) if segment_ids is None else (segment_ids[:, None, None, :, None],
                                                    segment_ids[:, None, None, None, :])
    mask = visible(pos_L[:, None], pos_L[None, :], window, *seg)  # [L, L] or [B, 1, 1, L, L]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxLxGxK.dtype)
    out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BxLxGxK)
    return out.reshape(B, L, H, K)


def cudnn_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L=None, segment_ids=None, window: int = 0):
    """cuDNN's fused flash attention (NVIDIA GPUs, bf16/fp16) through `jax.nn.dot_product_attention`
    (JAX 0.10 and 0.11 alike): the window as `local_window_size=(window - 1, 0)` (cuDNN's causal
    sliding window of window - 1 keys left of the query plus itself); segment ids as its boolean
    `mask` [B, 1, L, L], which JAX turns into an additive bias: the public API has no packed
    (segment/offset) layout, so a document mask costs an [L, L] bias per row here. On a mesh it runs
    manual over every axis not yet manual (`each_device`): XLA's GPU compiler refuses its custom
    partitioning inside a partly manual region (the pipeline's stages, the data-parallel executor's
    shards), and JAX's partitioner refuses q, k and v sharded apart (sequence parallelism's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if set(mesh.axis_names) - set(mesh.manual_axes):
        return each_device(fused_attention, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids, window)
    return fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids, window)


def each_device(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids, window: int):
    """`kernel` on each device's rows (the batch's compiler-managed axes) and heads (those splitting
    both query and kv heads), the sequence whole, in a shard_map over every axis not yet manual."""
    mesh = jax.sharding.get_abstract_mesh()
    rest = set(mesh.axis_names) - set(mesh.manual_axes)
    split = lambda name: tuple(a for a in rule_axes(name) if a in rest and mesh.shape[a] > 1)
    batch, heads = split("batch"), tuple(a for a in split("heads") if a in split("kv_heads"))
    spec = P(batch or None, None, heads or None)
    segments = () if segment_ids is None else (segment_ids,)
    attend = lambda q, k, v, *seg: kernel(q, k, v, seg[0] if seg else None, window)
    return jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3 + (P(batch or None),) * len(segments),
                         out_specs=spec, axis_names=rest, check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK,
                                                                          *segments)


def fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids=None, window: int = 0):
    """`jax.nn.dot_product_attention` on cuDNN, as `cudnn_attention` calls it."""
    mask = None if segment_ids is None else segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask=mask, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation="cudnn")


def blockwise_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L=None, segment_ids=None, window: int = 0,
                        block: int | None = None):
    """The same attention over blocks of `block` queries x `block` keys with an online softmax
    (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): per query block, running max m,
    normaliser l and output acc are rescaled by exp(m_old - m_new) as each key block arrives, so
    only [B, G, R, block, block] scores exist at a time. Key blocks above the diagonal, and those
    wholly outside the `window`, are skipped (no row of a block sees a key yet: p is 0 there).
    The backward rematerialises each query block, then each key block's scores, so residuals stay
    O(L x K), never O(L^2); the price is computing the scores three times instead of FlashAttention's
    two (GPUs use `cudnn`)."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    block = block or attention_block(L)
    R, n = H // G, L // block
    q_NxBxCxGxRxK = q_BxLxHxK.reshape(B, n, block, G, R, K).swapaxes(0, 1)
    k_NxBxCxGxK = k_BxLxGxK.reshape(B, n, block, G, K).swapaxes(0, 1)
    v_NxBxCxGxK = v_BxLxGxK.reshape(B, n, block, G, K).swapaxes(0, 1)
    pos_C = jnp.arange(block)
    seg_NxBxC = None if segment_ids is None else segment_ids.reshape(B, n, block).swapaxes(0, 1)
    lowest = jnp.finfo(jnp.float32).min

    @jax.checkpoint
    def query_block(i, q_BxCxGxRxK, *seg_q):
        def key_block(carry, xs):
            j, k_BxCxGxK, v_BxCxGxK, *seg_k = xs

            @jax.checkpoint  # residuals: the carries (O(block x K)), not this block's scores
            def update(carry):
                m_BxGxRxC, l_BxGxRxC, acc_BxGxRxCxK = carry
                s = jnp.einsum("bqgrk,bmgk->bgrqm", q_BxCxGxRxK, k_BxCxGxK, preferred_element_type=jnp.float32)
                segs = (seg_q[0][:, None, None, :, None], seg_k[0][:, None, None, None, :]) if seg_q else ()
                mask = visible((i * block + pos_C)[:, None], (j * block + pos_C)[None, :], window, *segs)
                s = jnp.where(mask, s * K ** -0.5, lowest)
                m_new = jnp.maximum(m_BxGxRxC, s.max(axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                rescale = jnp.exp(m_BxGxRxC - m_new)
                pv = jnp.einsum("bgrqm,bmgk->bgrqk", p.astype(v_BxCxGxK.dtype), v_BxCxGxK,
                                preferred_element_type=jnp.float32)
                return m_new, l_BxGxRxC * rescale + p.sum(axis=-1), acc_BxGxRxCxK * rescale[..., None] + pv

            needed = (j <= i) & block_reaches(i * block, j * block + block - 1, window)
            return jax.lax.cond(needed, update, lambda c: c, carry), None

        init = (jnp.full((B, G, R, block), lowest), jnp.zeros((B, G, R, block)), jnp.zeros((B, G, R, block, K)))
        seg_k = () if seg_NxBxC is None else (seg_NxBxC,)
        (_, l, acc), _ = jax.lax.scan(key_block, init, (jnp.arange(n), k_NxBxCxGxK, v_NxBxCxGxK, *seg_k))
        out_BxGxRxCxK = acc / l[..., None]
        return out_BxGxRxCxK.transpose(0, 3, 1, 2, 4).reshape(B, block, H, K)

    seg_q = () if seg_NxBxC is None else (seg_NxBxC,)
    out_NxBxCxHxK = jax.lax.map(lambda xs: query_block(*xs), (jnp.arange(n), q_NxBxCxGxRxK, *seg_q))
    return out_NxBxCxHxK.swapaxes(0, 1).reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


def context_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L=None, segment_ids=None, window: int = 0):
    """Ring attention over the `context` axis; the sequence in order (no context axis): blockwise."""
    if positions_L is None:
        return blockwise_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids=segment_ids, window=window)
    return ring_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, segment_ids=segment_ids, window=window)


@functools.lru_cache(maxsize=64)  # asked for every layout a planner's search checks: the answer is the model's
def cudnn_refusal(heads: int, kv_heads: int, head_dim: int, seq_len: int, dtype, windows=(0,),
                  documents: bool = False) -> str | None:
    """Why cuDNN's fused attention cannot train on these shapes, in JAX's own words (the checks of
    `jax.nn.dot_product_attention`, traced for the gradient as a train step runs it, with each of
    the model's `windows` and a document mask where `documents`), or None when it can. Nothing runs:
    the trace is abstract."""
    q = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, seq_len, kv_heads, head_dim), dtype)
    segments = jax.ShapeDtypeStruct((1, seq_len), jnp.int32) if documents else None
    for window in sorted(set(windows)):
        def loss(q, k, v, segment_ids, window=window):
            return cudnn_attention(q, k, v, segment_ids=segment_ids, window=window).astype(jnp.float32).sum()

        try:
            jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, segments)
        except (NotImplementedError, RuntimeError, ValueError) as e:
            return first_line(e)
    return None


BACKENDS = {"xla": xla_attention, "blockwise": blockwise_attention, "cudnn": cudnn_attention,
            "ring": context_attention}

# Score-sized matmuls (QK^T, PV or one of their four gradients: 2 x H x K FLOPs per query and key)
# a backend runs per query-key pair it computes, (forward, backward): the textbook 2 + 4, which the
# model FLOPs count (12·L·H·K·S per token, meshtrain/core/metrics.py); a flash-style backward (ring's
# custom VJP, cuDNN's) recomputes the scores first (+1); the blockwise kernel's two nested
# checkpoints rerun a query block's forward and then each key block's (+2 +2).
ATTENTION_MATMULS = {"xla": (2, 4), "blockwise": (2, 8), "cudnn": (2, 5), "ring": (2, 5)}
CUDNN_TILE = 128  # positions per causal tile assumed for cuDNN's kernel (not compiled on CPU)


def causal_share(n: int, block: int = 1, window: int = 0) -> float:
    """Blocks of `block` positions computed on an n x n grid: those on and below the diagonal,
    (n + 1) / (2n), less those wholly outside a `window` (packing.block_reaches)."""
    if not window:
        return (n + 1) / (2 * n)
    i, j = np.tril_indices(n)
    return int(np.count_nonzero(block_reaches(i * block, j * block + block - 1, window))) / (n * n)


def executed_attention(backend: str, seq_len: int, context: int = 1,
                       window: int = 0) -> tuple[tuple[int, int], float]:
    """((forward, backward) score-sized matmuls, the share of the [L, L] scores computed) of a
    backend: xla all of them; blockwise the blocks on and below the diagonal (within `window`);
    ring (context > 1) ring_schedule.computed_fraction, and blockwise without a context axis;
    cudnn's causal kernel about half (CUDNN_TILE-position tiles). Document masks skip nothing
    that is counted here (which blocks they empty depends on the data)."""
    if backend == "ring" and context == 1:
        backend = "blockwise"
    if backend == "xla":
        share = 1.0
    elif backend == "blockwise":
        block = attention_block(seq_len)
        share = causal_share(seq_len // block, block, window)
    elif backend == "ring":
        share = computed_fraction(seq_len, context, window)
    else:
        tiles = max(1, seq_len // CUDNN_TILE)
        share = causal_share(tiles, seq_len // tiles, window)
    return ATTENTION_MATMULS[backend], share
