"""Llama-style decoder-only transformer in Flax NNX: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU, tied or untied head; layers stacked on a leading `layers` axis and run with scan.

Names carry their shapes (nanodo style): B batch, L sequence, D width, H query heads, G kv heads,
R = H / G query heads per kv head, K head dim, F mlp width, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.loss import cross_entropy
from meshtrain.sharding import constrain

# Logical axes of every parameter, by its name (stacked block parameters get a leading "layers").
PARAM_AXES = {
    "embedding": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": ("embed",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
# Activations that the save_matmuls / offload remat policies keep for the backward pass.
# `attn_ctx` (attention's output, before wo) too, so the recompute never reruns the L^2 attention.
MATMUL_OUTPUTS = ("q", "k", "v", "attn_ctx", "attn_out", "mlp_gate", "mlp_up", "mlp_out")


def _init(in_axes, out_axes):
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out_axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x_BxLxD):
        x = x_BxLxD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x_BxLxD.dtype)


def rotary(x_BxLxNxK, theta: float):
    """Rotate channel pairs (i, i + K/2) by position * theta^(-2i/K) (Su et al., RoFormer)."""
    L, K = x_BxLxNxK.shape[1], x_BxLxNxK.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    angle_LxK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angle_LxK2)[None, :, None, :], jnp.sin(angle_LxK2)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxNxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxK.dtype)


ATTENTION_BLOCK = 512  # positions per query/key block of the blockwise kernel, at most
MIN_ATTENTION_BLOCK = 128  # smaller blocks run too many serial steps: refused (meshtrain/program.py)


def attention_block(seq_len: int) -> int:
    """The blockwise kernel's block: the largest divisor of seq_len up to ATTENTION_BLOCK."""
    return max(b for b in range(1, min(ATTENTION_BLOCK, seq_len) + 1) if seq_len % b == 0)


def attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation: str):
    """Causal grouped-query attention; softmax in fp32. `xla` forms the [B, H, L, L] scores,
    `blockwise` never does, `cudnn` is cuDNN's fused kernel (GPU, bf16/fp16)."""
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True, implementation="cudnn")
    L = q_BxLxHxK.shape[1]
    if implementation == "blockwise":
        return blockwise_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, attention_block(L))
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    scores = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK, preferred_element_type=jnp.float32)
    scores = scores * K ** -0.5
    causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
    scores = jnp.where(causal_LxL, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxLxGxK.dtype)
    out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BxLxGxK)
    return out.reshape(B, L, H, K)


def blockwise_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, block: int):
    """The same attention over blocks of `block` queries x `block` keys with an online softmax
    (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): per query block, running max m,
    normaliser l and output acc are rescaled by exp(m_old - m_new) as each key block arrives, so
    only [B, G, R, block, block] scores exist at a time. Key blocks above the diagonal are skipped.
    The backward rematerialises each query block, then each key block's scores, so residuals stay
    O(L x K), never O(L^2); the price is computing the scores three times instead of FlashAttention's
    two (GPUs use `cudnn`)."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    R, n = H // G, L // block
    q_NxBxCxGxRxK = q_BxLxHxK.reshape(B, n, block, G, R, K).swapaxes(0, 1)
    k_NxBxCxGxK = k_BxLxGxK.reshape(B, n, block, G, K).swapaxes(0, 1)
    v_NxBxCxGxK = v_BxLxGxK.reshape(B, n, block, G, K).swapaxes(0, 1)
    pos_C = jnp.arange(block)
    lowest = jnp.finfo(jnp.float32).min

    @jax.checkpoint
    def query_block(i, q_BxCxGxRxK):
        def key_block(carry, xs):
            j, k_BxCxGxK, v_BxCxGxK = xs

            @jax.checkpoint  # residuals: the carries (O(block x K)), not this block's scores
            def update(carry):
                m_BxGxRxC, l_BxGxRxC, acc_BxGxRxCxK = carry
                s = jnp.einsum("bqgrk,bmgk->bgrqm", q_BxCxGxRxK, k_BxCxGxK, preferred_element_type=jnp.float32)
                causal_CxC = (i * block + pos_C)[:, None] >= (j * block + pos_C)[None, :]
                s = jnp.where(causal_CxC, s * K ** -0.5, lowest)
                m_new = jnp.maximum(m_BxGxRxC, s.max(axis=-1))
                p = jnp.exp(s - m_new[..., None])
                rescale = jnp.exp(m_BxGxRxC - m_new)
                pv = jnp.einsum("bgrqm,bmgk->bgrqk", p.astype(v_BxCxGxK.dtype), v_BxCxGxK,
                                preferred_element_type=jnp.float32)
                return m_new, l_BxGxRxC * rescale + p.sum(axis=-1), acc_BxGxRxCxK * rescale[..., None] + pv

            return jax.lax.cond(j <= i, update, lambda c: c, carry), None

        init = (jnp.full((B, G, R, block), lowest), jnp.zeros((B, G, R, block)), jnp.zeros((B, G, R, block, K)))
        (_, l, acc), _ = jax.lax.scan(key_block, init, (jnp.arange(n), k_NxBxCxGxK, v_NxBxCxGxK))
        out_BxGxRxCxK = acc / l[..., None]
        return out_BxGxRxCxK.transpose(0, 3, 1, 2, 4).reshape(B, block, H, K)

    out_NxBxCxHxK = jax.lax.map(lambda xs: query_block(*xs), (jnp.arange(n), q_NxBxCxGxRxK))
    return out_NxBxCxHxK.swapaxes(0, 1).reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + swiglu(norm(x))."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, G, K, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(D, cfg.norm_eps)
        self.wq = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, H, K)))
        self.wk = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, G, K)))
        self.wv = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, G, K)))
        self.wo = nnx.Param(_init((0, 1), 2)(rngs.params(), (H, K, D)))
        self.mlp_norm = RMSNorm(D, cfg.norm_eps)
        self.w_gate = nnx.Param(_init(0, 1)(rngs.params(), (D, F)))
        self.w_up = nnx.Param(_init(0, 1)(rngs.params(), (D, F)))
        self.w_down = nnx.Param(_init(0, 1)(rngs.params(), (F, D)))

    def __call__(self, x_BxLxD):
        cfg = self.cfg
        h = self.attn_norm(x_BxLxD)
        q = checkpoint_name(jnp.einsum("bld,dhk->blhk", h, self.wq[...]), "q")
        k = checkpoint_name(jnp.einsum("bld,dgk->blgk", h, self.wk[...]), "k")
        v = checkpoint_name(jnp.einsum("bld,dgk->blgk", h, self.wv[...]), "v")
        q = constrain(rotary(q, cfg.rope_theta), ("batch", "seq", "heads", "head_dim"))
        k = constrain(rotary(k, cfg.rope_theta), ("batch", "seq", "kv_heads", "head_dim"))
        ctx_BxLxHxK = checkpoint_name(attention(q, k, v, cfg.attention), "attn_ctx")
        attn = checkpoint_name(jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, self.wo[...]), "attn_out")
        x_BxLxD = constrain(x_BxLxD + attn, ("batch", "seq", "embed"))

        h = self.mlp_norm(x_BxLxD)
        gate_BxLxF = checkpoint_name(jnp.einsum("bld,df->blf", h, self.w_gate[...]), "mlp_gate")
        up_BxLxF = checkpoint_name(jnp.einsum("bld,df->blf", h, self.w_up[...]), "mlp_up")
        h_BxLxF = constrain(jax.nn.silu(gate_BxLxF) * up_BxLxF, ("batch", "seq", "mlp"))
        out = checkpoint_name(jnp.einsum("blf,fd->bld", h_BxLxF, self.w_down[...]), "mlp_out")
        return constrain(x_BxLxD + out, ("batch", "seq", "embed"))


class Transformer(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model)) * 0.02)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(_init(0, 1)(rngs.params(), (cfg.d_model, cfg.vocab_size)))


def remat_policy(name: str):
    """None = no remat; else the jax.checkpoint policy for the scanned block."""
    cp = jax.checkpoint_policies
    return {
        "none": None,
        "full": cp.nothing_saveable,
        "save_matmuls": cp.save_only_these_names(*MATMUL_OUTPUTS),
        "offload": cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(MATMUL_OUTPUTS),
            offload_src="device", offload_dst="pinned_host"),
    }[name]


class LanguageModel:
    """The protocol meshtrain trains through, on pure parameter pytrees (nested dicts):
    `init(key)`, `embed(params, tokens)`, `block(params_i, x)`, `loss(params, x, targets)` (head and
    cross-entropy), `head(params, x)` (logits), `apply`, `logical_axes(params)`. `params["blocks"]` is stacked on a leading layers axis."""

    def __init__(self, cfg):
        self.cfg = cfg.resolved()
        abstract = nnx.eval_shape(lambda: Transformer(self.cfg, nnx.Rngs(0)))
        self._graphdef = nnx.graphdef(abstract)
        self._block_graphdef = nnx.graphdef(abstract.blocks)
        self._norm_graphdef = nnx.graphdef(abstract.final_norm)

    def init(self, key):
        return nnx.to_pure_dict(nnx.state(Transformer(self.cfg, nnx.Rngs(key)), nnx.Param))

    def embed(self, params, tokens_BxL):
        # Gather the table over its `embed` shards first; the lookup then stays vocab-parallel
        # (each tensor shard looks up its own rows, then one all-reduce), as in Megatron.
        table_VxD = constrain(params["embedding"], ("vocab", None))
        x = jnp.take(table_VxD, tokens_BxL, axis=0)
        return constrain(x, ("batch", "seq", "embed"))

    def block(self, params_i, x_BxLxD):
        return nnx.merge(self._block_graphdef, params_i)(x_BxLxD)

    def final_norm(self, params, x_BxLxD):
        return nnx.merge(self._norm_graphdef, params["final_norm"])(x_BxLxD)

    def unembedding(self, params):
        """The output head's matrix [D, V] (the embedding table, transposed, when tied)."""
        return params["embedding"].T if self.cfg.tie_embeddings else params["lm_head"]

    def head(self, params, x_BxLxD):
        """Logits [B, L, V] in fp32 (for evaluation and decoding; training calls `loss`)."""
        logits = jnp.einsum("bld,dv->blv", self.final_norm(params, x_BxLxD), self.unembedding(params),
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))

    def loss(self, params, x_BxLxD, targets_BxL):
        """Mean next-token cross-entropy of the head, never holding [B, L, V] logits (meshtrain/loss.py)."""
        return cross_entropy(self.final_norm(params, x_BxLxD), self.unembedding(params), targets_BxL)

    def run_blocks(self, blocks, x_BxLxD):
        """All stacked layers with one scan (compile time does not grow with depth)."""
        body = lambda x, p: (self.block(p, x), None)
        policy = remat_policy(self.cfg.remat)
        if policy is not None:
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        return jax.lax.scan(body, x_BxLxD, blocks)[0]

    def apply(self, params, tokens_BxL):
        x = self.embed(params, tokens_BxL)
        return self.head(params, self.run_blocks(params["blocks"], x))

    def logical_axes(self, params):
        def axes(path, _):
            names = PARAM_AXES[path[-1].key]
            return ("layers", *names) if path[0].key == "blocks" else names

        return jax.tree_util.tree_map_with_path(axes, params)

    def num_params(self, params, embedding: bool = True) -> int:
        n = sum(x.size for x in jax.tree.leaves(params))
        return n if embedding else n - params["embedding"].size
