"""Next-token cross-entropy of the output head without materialising [B, L, V] logits.

The head's matmul and the loss run over chunks of C sequence positions: a chunk's fp32 logits
[B, C, V] are made, reduced to logsumexp minus the target logit, and dropped. Under
differentiation (`custom_vjp`) the same pass also forms d loss / d logits = softmax - onehot
= exp(logits - logsumexp) - onehot, then dx = dlogits w^T per chunk and dw = sum over chunks of
x^T dlogits, accumulated in fp32 by each batch and sequence shard apart (one reduction after the chunks, not
one per chunk: the head's gradient reduce-scattered 8 times a microbatch at 8k tokens otherwise,
llama3-8b's pod reduce-scatter 1.81x the formula); the backward scales them by the loss's cotangent. So the head
costs the plain loss's three matmuls, and its largest temporaries are one chunk's and the head.
The head is gathered over the axes `embed` shards it on (fsdp, context) once, before the chunks: left
to XLA, its GPU compiler gathers it again in every chunk, forward and backward (gemma3-4b's pod
all-gather 14x the formula, issue 39 section 3), as it does not hoist a gather out of a loop.
C is chosen so a chunk's logits take about LOSS_CHUNK_BYTES per device, and a chunk holds at least
LOSS_CHUNK_TOKENS tokens per device where the sequence allows: the fp32 dw [D, V] is read and written
once per chunk (8·D·V bytes) for 2·D·V·T FLOPs over the chunk's T tokens, so T of at least 4 x an
H100's 295 FLOP/byte (989 TFLOP/s over 3.35 TB/s), about 1,200, keeps that GEMM compute-bound (512-token
chunks made it memory-bound: 20 ms a step more on llama_1b's pod, 0.17 s on gemma3_4b's, GPU program).

The target logit is picked with a one-hot product, not a gather, so a vocabulary split over
`tensor` stays split (XLA's gather partitioning fails inside pipeline stages). A target < 0 is not
trained (a loss mask, meshtrain/data/tokens.py `with_mask`): its loss and its d loss / d logits
are 0 (its one-hot row is already 0), and it still counts in the B x L the mean divides by.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from meshtrain.parallel.sharding import constrain, shard_count, summed_over_shards

LOSS_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk, per device
LOSS_CHUNK_TOKENS = 2048  # tokens of one chunk per device at least (the head's dw GEMM compute-bound)


def chunk_positions(batch_per_device: int, seq_len: int, vocab_per_device: int,
                    budget: int = LOSS_CHUNK_BYTES, least_tokens: int = LOSS_CHUNK_TOKENS) -> int:
    """The largest divisor C of seq_len with batch x C x vocab fp32 logits within `budget`, or where
    that holds fewer than `least_tokens` tokens, the smallest divisor holding that many (or seq_len)."""
    divisors = [c for c in range(1, seq_len + 1) if seq_len % c == 0]
    fit = max(1, budget // (4 * vocab_per_device * batch_per_device))
    least = -(-least_tokens // batch_per_device)
    return max(max(c for c in divisors if c <= fit), min((c for c in divisors if c >= least), default=seq_len))


def cross_entropy(x_BxLxD, w_DxV, targets_BxL, budget: int = LOSS_CHUNK_BYTES,
                  least_tokens: int = LOSS_CHUNK_TOKENS):
    """Mean over tokens of -log softmax(x w)[target]; logits in fp32."""
    B, L, _ = x_BxLxD.shape
    return _loss_sum(x_BxLxD, w_DxV, targets_BxL, loss_chunk(x_BxLxD, w_DxV, budget, least_tokens)) / (B * L)


def loss_chunk(x_BxLxD, w_DxV, budget: int = LOSS_CHUNK_BYTES, least_tokens: int = LOSS_CHUNK_TOKENS) -> int:
    """`chunk_positions` for these activations and this head, per device."""
    B, L, _ = x_BxLxD.shape
    V = w_DxV.shape[1]
    return chunk_positions(max(1, B // shard_count("batch")), L, max(1, V // shard_count("vocab")), budget,
                           least_tokens)


def _chunks(a, C: int):
    """[B, L, ...] -> [L/C, B, C, ...]: chunk n holds positions n, n + L/C, ... (the loss is a sum
    over tokens, their order free), so a sequence split over `context` stays split within each
    chunk, as the batch dimension stays whole; contiguous chunks would put `context` on the chunk
    index and make XLA move every chunk's rows between devices."""
    B, L = a.shape[:2]
    return jnp.moveaxis(a.reshape(B, C, L // C, *a.shape[2:]), 2, 0)


def _logits(x_BxCxD, w_DxV):
    logits = jnp.einsum("bcd,dv->bcv", x_BxCxD, w_DxV, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))


def _gathered(w_DxV):
    """The head whole over `embed`'s axes (still split over `vocab`): one gather per loss, not per chunk."""
    return constrain(w_DxV, (None, "vocab"))


def _one_hot(targets_BxC, vocab: int):
    return jax.nn.one_hot(targets_BxC, vocab, dtype=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _loss_sum(x_BxLxD, w_DxV, targets_BxL, C: int):
    """Sum of per-token losses (no gradient work: evaluation runs this)."""
    V, w_DxV = w_DxV.shape[1], _gathered(w_DxV)

    def chunk(total, xs):
        x_BxCxD, t_BxC = xs
        logits = _logits(x_BxCxD, w_DxV)
        losses_BxC = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * _one_hot(t_BxC, V), -1)
        return total + jnp.sum(jnp.where(t_BxC >= 0, losses_BxC, 0.0)), None

    return jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (_chunks(x_BxLxD, C), _chunks(targets_BxL, C)))[0]


def _loss_sum_fwd(x_BxLxD, w_DxV, targets_BxL, C: int):
    """The loss and, while each chunk's logits exist, its gradients for a cotangent of 1; the
    backward only scales them (as Liger's fused linear cross-entropy does), so no logits are remade."""
    B, V, w_DxV = x_BxLxD.shape[0], w_DxV.shape[1], _gathered(w_DxV)
    # batch and sequence shards: each sums its own dw, reduced once after the chunks
    G, S = math.gcd(B, shard_count("batch")), math.gcd(C, shard_count("seq"))

    def chunk(carry, xs):
        total, dw_GxSxDxV = carry
        x_BxCxD, t_BxC = xs
        logits = _logits(x_BxCxD, w_DxV)
        lse_BxC = jax.nn.logsumexp(logits, axis=-1)
        one_hot, trained_BxC = _one_hot(t_BxC, V), t_BxC >= 0
        total = total + jnp.sum(jnp.where(trained_BxC, lse_BxC - jnp.sum(logits * one_hot, axis=-1), 0.0))
        softmax = jnp.where(trained_BxC[..., None], jnp.exp(logits - lse_BxC[..., None]), 0.0)
        dlogits = (softmax - one_hot).astype(x_BxCxD.dtype)
        dx_BxCxD = jnp.einsum("bcv,dv->bcd", dlogits, w_DxV, preferred_element_type=jnp.float32)
        group = lambda a: a.reshape(G, B // G, S, C // S, a.shape[-1])
        dw_GxSxDxV = dw_GxSxDxV + jnp.einsum("gbscd,gbscv->gsdv", group(x_BxCxD), group(dlogits),
                                             preferred_element_type=jnp.float32)
        dx_BxCxD = constrain(dx_BxCxD, ("batch", "seq", None))  # stacked as the chunks come, kept split
        return (total, constrain(dw_GxSxDxV, ("batch", "seq", "embed", "vocab"))), dx_BxCxD

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((G, S, *w_DxV.shape), jnp.float32))
    (total, dw_GxSxDxV), dx_NxBxCxD = jax.lax.scan(chunk, zeros, (_chunks(x_BxLxD, C), _chunks(targets_BxL, C)))
    dw_DxV = summed_over_shards(dw_GxSxDxV, ("embed", "vocab"))
    dx_BxLxD = jnp.moveaxis(dx_NxBxCxD, 0, 2).reshape(x_BxLxD.shape).astype(x_BxLxD.dtype)  # `_chunks` undone
    return total, (dx_BxLxD, dw_DxV.astype(w_DxV.dtype))


def _loss_sum_bwd(C: int, residuals, g):
    dx_BxLxD, dw_DxV = residuals
    return (g * dx_BxLxD).astype(dx_BxLxD.dtype), (g * dw_DxV).astype(dw_DxV.dtype), None


_loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd)


def sequence_log_probs(x_BxLxD, w_DxV, targets_BxL, budget: int = LOSS_CHUNK_BYTES,
                       least_tokens: int = LOSS_CHUNK_TOKENS):
    """[B]: each row's sum of log softmax(x w)[target] over its trained targets (>= 0), fp32; DPO's
    sequence log-probability (meshtrain/objectives/dpo.py): `position_log_probs` summed, so each
    chunk is rematerialised: the backward remakes one chunk's logits at a time, so no [B, L, V]
    logits are held, at one more head matmul than the custom VJP of `_loss_sum` (whose gradients are
    scaled by one scalar cotangent, not one per position)."""
    return jnp.sum(position_log_probs(x_BxLxD, w_DxV, targets_BxL, budget=budget, least_tokens=least_tokens), -1)


def token_log_probs(logits_BxV, token_B, temperature=1.0):
    """log softmax(logits / temperature)[token] over the last axis, fp32: the sampler's log-probability
    of a drawn token (meshtrain/engine/decode.py) and the trainer's recomputation of it (`position_log_probs`)
    are this one expression, so on one layout they differ only where the two forwards' logits do."""
    scaled = logits_BxV.astype(jnp.float32) / temperature
    # a select and a sum over the vocabulary, not a gather: a vocab-split head reduces a scalar a row
    picked = jnp.sum(jnp.where(jnp.arange(scaled.shape[-1]) == token_B[..., None], scaled, 0.0), axis=-1)
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def position_log_probs(x_BxLxD, w_DxV, targets_BxL, temperature=1.0, vocab: int | None = None,
                       entropy: bool = False, budget: int = LOSS_CHUNK_BYTES, least_tokens: int = LOSS_CHUNK_TOKENS):
    """[B, L]: `token_log_probs` of each target under the head's logits / temperature (ids >= `vocab`
    masked as the sampler masks them), 0 where the target is untrained (< 0); with `entropy`, also
    each position's entropy of that distribution [B, L] (no gradient: a metric). Chunked as
    `cross_entropy`, each chunk rematerialised (`jax.checkpoint`), so no [B, L, V] logits are held."""
    B, L, _ = x_BxLxD.shape
    C = loss_chunk(x_BxLxD, w_DxV, budget, least_tokens)
    w_DxV = _gathered(w_DxV)

    @jax.checkpoint
    def chunk(_, xs):
        x_BxCxD, t_BxC = xs
        logits = _vocab_logits(x_BxCxD, w_DxV, vocab)
        logp_BxC = jnp.where(t_BxC >= 0, token_log_probs(logits, t_BxC, temperature), 0.0)
        if not entropy:
            return None, logp_BxC
        logq = jax.nn.log_softmax(jax.lax.stop_gradient(logits) / temperature, axis=-1)
        return None, (logp_BxC, -jnp.sum(jnp.where(logq > -jnp.inf, jnp.exp(logq) * logq, 0.0), axis=-1))

    _, out = jax.lax.scan(chunk, None, (_chunks(x_BxLxD, C), _chunks(targets_BxL, C)))
    return jax.tree.map(lambda o_NxBxC: jnp.moveaxis(o_NxBxC, 0, 2).reshape(B, L), out)  # `_chunks` undone


def position_chunk_logits(x_BxLxD, w_DxV, positions_B, vocab=None, budget: int = LOSS_CHUNK_BYTES,
                          least_tokens: int = LOSS_CHUNK_TOKENS):
    """([B, C, V] fp32 logits, [B] columns): for each row of x [B, L, D], the head's logits on the chunk
    of C positions `position_log_probs` computes its position in (one [B, C, D] x [D, V] GEMM of the
    same shape; ids >= `vocab` masked, `vocab` may be traced), and the position's column in it.
    rl.sampler=exact (meshtrain/engine/decode.py) draws from these and takes `token_log_probs` over
    the whole [B, C, V], as the trainer does: the same arithmetic, bit for bit on one layout."""
    B, L, _ = x_BxLxD.shape
    C = loss_chunk(x_BxLxD, w_DxV, budget, least_tokens)
    stride = L // C  # `_chunks`: position p is chunk p % stride's (p // stride)-th
    x_BxCxD = _chunks(x_BxLxD, C)[positions_B % stride, jnp.arange(B)]
    return _vocab_logits(x_BxCxD, _gathered(w_DxV), vocab), positions_B // stride


def _vocab_logits(x_BxCxD, w_DxV, vocab=None):
    """`_logits`, ids >= `vocab` at -inf (the tokenizer's size, where the model's vocabulary is padded)."""
    logits = _logits(x_BxCxD, w_DxV)
    V = w_DxV.shape[1]
    if vocab is None or (isinstance(vocab, int) and vocab >= V):
        return logits
    return jnp.where(jnp.arange(V) < vocab, logits, -jnp.inf)
