"""Multi-head latent attention (MLA, DeepSeek-V2 section 2.1; DeepSeek-V3, Kimi K2), per token of
h = norm(x):
- queries: h wq [H, Kn + Kr], or through a low rank (`q_lora_rank` > 0): norm_q(h wq_a) wq_b;
- keys and values from one compressed latent: h wkv_a = [c (kv_lora_rank), k_rope (Kr)];
  norm_kv(c) wkv_b = [k_nope (H x Kn), v (H x Kv)]; k = [k_nope, k_rope], k_rope shared by the heads;
- rotary embeddings on the last Kr channels of q and k only (the decoupled rope; `rope_interleave`:
  transformers' layout, whose rope channels are pairs (2i, 2i + 1) that are brought to (i, i + Kr/2)
  first, as its `apply_rotary_pos_emb_interleave` does), the spec's `softmax_gain` (yarn's
  m(rope_mscale_all_dim)^2) on the softmax scale (Kn + Kr)^-1/2 (applied to q);
- v has Kv channels, q and k Kn + Kr: v is zero-padded to Kn + Kr for the kernel and the padding cut
  from its output (as transformers' flash-attention path does), so every attention backend runs MLA
  (the PV matmul does (Kn + Kr) / Kv of the FLOPs it needs; the family's `flops_per_token` counts the
  needed ones).
The latent norms' epsilon is transformers' 1e-6, not rms_norm_eps. Generation caches per layer and
token the latent only, kv_lora_rank + qk_rope_head_dim values, and decodes with wkv_b absorbed into
the query and output sides (`MLABlock.decode`). The deepseek_v3 family builds on it.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.models.base import Block, _init
from meshtrain.models.kv_cache import cached_attention, write_rows
from meshtrain.models.rope import rope_attention_factor, rope_frequencies, rotary
from meshtrain.parallel.sharding import constrain

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep


class MLABlock(Block):
    """Multi-head latent attention (see the module doc) in place of the block's q/k/v projections."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, Rq, Rkv = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        K, Kn, Kr, Kv = cfg.head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.cfg = cfg
        self.attn_norm = self.norm(D, cfg.norm_eps)
        if Rq:
            self.wq_a = nnx.Param(_init(0, 1)(rngs.params(), (D, Rq)))
            self.q_norm = self.norm(Rq, LATENT_NORM_EPS)
            self.wq_b = nnx.Param(_init(0, (1, 2))(rngs.params(), (Rq, H, K)))
        else:
            self.wq = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, H, K)))
        self.wkv_a = nnx.Param(_init(0, 1)(rngs.params(), (D, Rkv + Kr)))
        self.kv_norm = self.norm(Rkv, LATENT_NORM_EPS)
        self.wkv_b = nnx.Param(_init(0, (1, 2))(rngs.params(), (Rkv, H, Kn + Kv)))
        self.wo = nnx.Param(_init((0, 1), 2)(rngs.params(), (H, Kv, D)))
        self.mlp_norm = self.norm(D, cfg.norm_eps)
        self.init_mlp(cfg, rngs)

    def queries_and_latent(self, x_BxLxD, positions=None):
        """norm(x)'s queries [B, L, H, Kn + Kr] (the last Kr rotated, x the softmax gain) and its latent
        [B, L, Rkv + Kr]: norm_kv(c) and the rotated rope key shared by the heads, what the cache holds."""
        c = self.cfg
        Rkv, Kn = c.kv_lora_rank, c.qk_nope_head_dim
        h = self.attn_norm(x_BxLxD)
        if c.q_lora_rank:
            q_BxLxR = self.q_norm(self.einsum("bld,dr->blr", h, self.wq_a[...]))
            q = self.einsum("blr,rhk->blhk", q_BxLxR, self.wq_b[...])
        else:
            q = self.einsum("bld,dhk->blhk", h, self.wq[...])
        kv_BxLxA = self.einsum("bld,da->bla", h, self.wkv_a[...])
        q_rope, k_rope_BxLx1xKr = q[..., Kn:], kv_BxLxA[..., None, Rkv:]
        if c.rope_interleave:  # pairs (2i, 2i + 1) -> (i, i + Kr/2)
            q_rope, k_rope_BxLx1xKr = (jnp.concatenate([t[..., 0::2], t[..., 1::2]], axis=-1)
                                       for t in (q_rope, k_rope_BxLx1xKr))
        inv_freq_K2, scale = rope_frequencies(c, c.qk_rope_head_dim), rope_attention_factor(c)
        q_rope, k_rope_BxLx1xKr = (rotary(t, inv_freq_K2, positions, scale) for t in (q_rope, k_rope_BxLx1xKr))
        q = jnp.concatenate([q[..., :Kn], q_rope], axis=-1)
        gain = c.softmax_gain()
        q = q * jnp.asarray(gain, q.dtype) if gain != 1 else q
        latent_BxLxA = jnp.concatenate([self.kv_norm(kv_BxLxA[..., :Rkv]), k_rope_BxLx1xKr[:, :, 0]], axis=-1)
        return q, latent_BxLxA

    def project(self, x_BxLxD, positions=None, kind=0):
        """q and k [B, L, H, Kn + Kr], v [B, L, H, Kn + Kr] (Kv channels, zero-padded): the latent
        expanded by wkv_b into each head's no-rope key and value."""
        c = self.cfg
        Rkv, Kn, Kr = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
        q, latent_BxLxA = self.queries_and_latent(x_BxLxD, positions)
        kv = self.einsum("blr,rhk->blhk", latent_BxLxA[..., :Rkv], self.wkv_b[...])
        k_rope = jnp.broadcast_to(latent_BxLxA[:, :, None, Rkv:], (*kv.shape[:3], Kr))
        k = jnp.concatenate([kv[..., :Kn], k_rope.astype(kv.dtype)], axis=-1)
        v = jnp.pad(kv[..., Kn:], ((0, 0),) * 3 + ((0, Kn + Kr - c.v_head_dim),))
        names = ("batch", "seq", "heads", "head_dim")
        return tuple(constrain(checkpoint_name(t, n), names) for t, n in ((q, "q"), (k, "k"), (v, "v")))

    def decode(self, x_BxLxD, cache_BxTxA, start_B, window=None, kind=0):
        """The block on L new positions per row, start_B[b] .. + L - 1, with this layer's latent cache
        [B, T, Rkv + Kr]: their latents are written, then attention runs in the latent space, wkv_b
        absorbed (DeepSeek-V2 section 2.1.2): q_nope . (W_uk c) = (q_nope W_uk^T) . c, so each head's
        query [q_nope W_uk^T, q_rope] attends the cache as one key/value head shared by all (multi-query,
        scale (Kn + Kr)^-1/2 as training's), and its context's first Rkv channels x W_uv are its
        values' mix [B, L, H, Kv]. Never expanding T positions into H heads' keys and values, a step
        reads the cache once. Returns the new x and the cache."""
        c = self.cfg
        Rkv, Kn, Kr = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
        positions_BxL = start_B[:, None] + jnp.arange(x_BxLxD.shape[1])
        q, latent_BxLxA = self.queries_and_latent(x_BxLxD, positions_BxL)
        cache_BxTxA = constrain(write_rows(cache_BxTxA, latent_BxLxA, start_B), ("batch", None, None))
        w_uk_RxHxKn, w_uv_RxHxKv = self.wkv_b[..., :Kn], self.wkv_b[..., Kn:]
        q_latent_BxLxHxR = self.einsum("blhk,rhk->blhr", q[..., :Kn], w_uk_RxHxKn)
        q_BxLxHxA = jnp.concatenate([q_latent_BxLxHxR, q[..., Kn:]], axis=-1).astype(cache_BxTxA.dtype)
        kv_BxTx1xA = cache_BxTxA[:, :, None]
        ctx_BxLxHxA = cached_attention(q_BxLxHxA, kv_BxTx1xA, kv_BxTx1xA, positions_BxL, window, (Kn + Kr) ** -0.5)
        ctx_BxLxHxKv = self.einsum("blhr,rhk->blhk", ctx_BxLxHxA[..., :Rkv].astype(w_uv_RxHxKv.dtype), w_uv_RxHxKv)
        x_BxLxD, _ = self.finish(x_BxLxD, ctx_BxLxHxKv)
        return x_BxLxD, cache_BxTxA

    def finish(self, x_BxLxD, ctx_BxLxHxK):
        """The block after attention, on the context's first Kv channels (the rest is v's padding)."""
        return super().finish(x_BxLxD, ctx_BxLxHxK[..., :self.cfg.v_head_dim])


MLA_AXES = {"wq_a": ("embed", "q_lora"), "q_norm": ("q_lora",), "wq_b": ("q_lora", "heads", "head_dim"),
            "wkv_a": ("embed", "kv_lora"), "kv_norm": ("kv_lora",), "wkv_b": ("kv_lora", "heads", "head_dim")}
