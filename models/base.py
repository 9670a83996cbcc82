"""The base every model family builds on: the model protocol (`LanguageModel`) and the shared
blocks. A family (models/llama.py, moe.py, qwen3.py, ...) is one module that changes parts of these
(a block's MLP or norms, its parameter axes, its config).

- `LanguageModel`: the protocol meshtrain trains through (init, embed, block, loss, auxiliary_loss,
  head, logical_axes, the counts, the cached decode), on pure parameter pytrees; `scan_blocks` runs
  the layers, stacked on a leading `layers` axis, with one scan.
- The blocks, in Flax NNX: RMSNorm, grouped-query attention with rotary embeddings
  (models/rope.py), SwiGLU, tied or untied head (`Block`, `Transformer`). With no changes they are
  the `llama` family's decoder.
- `PARAM_AXES`: the logical axes of the parameters (models/axes.py, with LoRA's adapters,
  models/lora.py), which sharding, INT8 channels and Hugging Face layouts follow.

Beside it: models/lora.py (adapters, LoRA dropout), rope.py, kv_cache.py (cached attention), hf_llama.py
(the LlamaForCausalLM form the families' Hugging Face forms start from), experts.py (routing, dispatch),
routed.py (the blocks of the routed-expert families) and layer_runs.py (layers a recipe leaves in bf16).
`Block` is three pieces: `project` (norm, q/k/v, rotary), the attention kernel, and `finish` (output
projection, MLP, residuals); training runs them as `__call__`, generation as `decode` (a KV cache).

The model names its activations and logical axes; how it runs is applied from outside: the
attention backend is a function it is given (meshtrain/ops/attention.py), the remat policy wraps its
`block` (meshtrain/ops/remat.py), and the sequence may be stored permuted (`sequence_order`, for
context parallelism), which the rotary embeddings and the kernel follow. With `packing`
(meshtrain/ops/packing.py) a window holds several documents: `documents(tokens)` gives their segment
ids (the kernel masks attention across them) and rotary positions restarting in each.

Names carry their shapes (nanodo style): B batch, L sequence, D width, H query heads, G kv heads,
R = H / G query heads per kv head, K head dim, F mlp width, V vocab, T KV-cache positions.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.core.metrics import flops_per_token
from meshtrain.models.axes import WEIGHT_AXES
from meshtrain.models.kv_cache import cached_attention, write_rows
from meshtrain.models.layer_runs import PER_LAYER_STATS, bf16_blocks, scan_runs
from meshtrain.models.lora import LORA, adapter_axes, init_adapter, layer_keys, lora_dropout
from meshtrain.models.rope import rope_attention_factor, rope_frequencies, rotary
from meshtrain.ops.attention import xla_attention
from meshtrain.ops.embedding import lookup
from meshtrain.ops.loss import cross_entropy
from meshtrain.ops.packing import visible
from meshtrain.ops.recipes import projection_einsum
from meshtrain.parallel.sharding import constrain

# Logical axes of every parameter, by its name or its module's (a norm's `scale` is `embed` unless its
# module is named here): the shared weights' (models/axes.py) and their LoRA adapters'. Stacked block
# parameters get a leading "layers" (`blocks`, which pipeline stages split) or "outer_layers" (another
# stack: whole on every stage).
PARAM_AXES = WEIGHT_AXES | adapter_axes({t: WEIGHT_AXES[w] for t, (w, *_) in LORA.items()})

# Activations that the save_matmuls / offload remat policies keep for the backward pass.
# `attn_ctx` (attention's output, before wo) too, so the recompute never reruns the L^2 attention.
MATMUL_OUTPUTS = ("q", "k", "v", "attn_ctx", "attn_out", "mlp_gate", "mlp_up", "mlp_out")
RESIDUAL = ("batch", "residual_seq", "embed")  # the residual stream (sequence-parallel: split on seq)


def _init(in_axes, out_axes):
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out_axes)


class RMSNorm(nnx.Module):
    """x / rms(x) x gain, in fp32 (Zhang & Sennrich 2019); the gain is the `scale` parameter."""
    initial = 1.0  # the scale's initial value

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.full((dim,), self.initial, jnp.float32))
        self.eps = eps

    def gain(self):
        return self.scale[...].astype(jnp.float32)

    def __call__(self, x_BxLxD):
        x = x_BxLxD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (y * self.gain()).astype(x_BxLxD.dtype)


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `__call__` returns the new x and
    the block's statistics (a dict of scalars; none for a dense MLP).

    Layers may differ in kind (`ModelSpec.window_kinds`: their sliding windows): `kind` is the
    layer's index there, traced under the layer scan, so the attention kernel, whose window is
    static, runs behind a `lax.switch` over the kinds; one kind (every family but gemma3) needs none."""

    norm = RMSNorm  # the norm class of the block's norms and the final one
    # the layer's LoRA dropout keys [B, 2] (`layer_keys`) and the sequence's true positions, set by
    # `LanguageModel.block` in training; None: no dropout (evaluation, generation, scoring)
    dropout_keys, dropout_positions = None, None
    activation = staticmethod(jax.nn.silu)  # the gated MLP's: SwiGLU
    einsum = staticmethod(jnp.einsum)  # the projections' and MLP's matmul (the model's `matmul` in training)

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = self.norm(D, cfg.norm_eps)
        self.wq = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, H, K)))
        self.wk = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, G, K)))
        self.wv = nnx.Param(_init(0, (1, 2))(rngs.params(), (D, G, K)))
        self.wo = nnx.Param(_init((0, 1), 2)(rngs.params(), (H, K, D)))
        self.mlp_norm = self.norm(D, cfg.norm_eps)
        self.init_mlp(cfg, rngs)
        self.init_lora(cfg, rngs)

    def init_lora(self, cfg, rngs: nnx.Rngs, targets=None):
        """`lora_<target>_a` [in..., r] and `_b` [r, out...] (`init_adapter`) for each LoRA target
        (`targets`: of those, the ones this block's own weights take; default all)."""
        for t in (cfg.lora.targets if targets is None else targets) if cfg.lora.rank else ():
            w = LORA[t][0]
            a, b = init_adapter(rngs.params(), getattr(self, w).shape, PARAM_AXES[w], cfg.lora.rank, w)
            setattr(self, f"lora_{t}_a", nnx.Param(a))
            setattr(self, f"lora_{t}_b", nnx.Param(b))

    def adapted(self, target: str, y, x):
        """y (= x W of the `target` projection) + (alpha / rank) x A B when it has an adapter."""
        lora = self.cfg.lora
        if not lora.rank or target not in lora.targets:
            return y
        _, into_a, out_b = LORA[target]
        x_a = self.einsum(into_a, self.adapter_input(target, x), getattr(self, f"lora_{target}_a")[...])
        return y + (lora.scale * self.einsum(out_b, x_a, getattr(self, f"lora_{target}_b")[...])).astype(y.dtype)

    def adapter_input(self, target: str, x):
        """x as the `target` adapter reads it: under LoRA dropout in training, dropped (`lora_dropout`)."""
        if self.dropout_keys is None or not self.cfg.lora.dropout:
            return x
        return lora_dropout(x, self.dropout_keys, target, self.cfg.lora.dropout, self.dropout_positions)

    def init_mlp(self, cfg, rngs: nnx.Rngs, width: int | None = None):
        D, F = cfg.d_model, width or cfg.mlp_dim
        self.w_gate = nnx.Param(_init(0, 1)(rngs.params(), (D, F)))
        self.w_up = nnx.Param(_init(0, 1)(rngs.params(), (D, F)))
        self.w_down = nnx.Param(_init(0, 1)(rngs.params(), (F, D)))

    def __call__(self, x_BxLxD, attend, positions_L=None, docs=None, kind=None):
        """`docs`: the window's packing.Documents (None: one stream, attended across); `kind`: the
        layer's (an int, or traced), which layers of several kinds must be given."""
        if kind is None:
            if len(self.cfg.window_kinds()) > 1:
                raise ValueError("this model's layers differ in kind: pass each its own, "
                                 "scan_blocks(..., kinds=model.layer_kinds)")
            kind = 0
        positions = positions_L if docs is None or docs.positions is None else docs.positions
        q, k, v = self.project(x_BxLxD, positions, kind)
        masks = {} if docs is None else {"segment_ids": docs.segments}
        windows = self.cfg.window_kinds()
        if windows == (0,):  # full causal attention in every layer: the kernel as it is
            return self.finish(x_BxLxD, attend(q, k, v, positions_L, **masks))
        kernels = [functools.partial(attend, positions_L=positions_L, window=w, **masks) for w in windows]
        ctx = kernels[kind](q, k, v) if isinstance(kind, int) else jax.lax.switch(kind, kernels, q, k, v)
        return self.finish(x_BxLxD, ctx)

    def rope_frequencies(self, kind=0):
        """The rotary inverse frequencies of a layer of `kind`: the spec's (`rope_frequencies`)."""
        return rope_frequencies(self.cfg)

    def project(self, x_BxLxD, positions=None, kind=0):
        """Queries [B, L, H, K], keys and values [B, L, G, K] of norm(x); q and k rotated to their
        `positions` ([L] or [B, L], see `rotary`) with the frequencies of the layer's `kind`."""
        h = constrain(self.attn_norm(x_BxLxD), ("batch", "seq", "embed"))  # sequence parallel: gathered here
        q = checkpoint_name(self.adapted("q", self.einsum("bld,dhk->blhk", h, self.wq[...]), h), "q")
        k = checkpoint_name(self.adapted("k", self.einsum("bld,dgk->blgk", h, self.wk[...]), h), "k")
        v = checkpoint_name(self.adapted("v", self.einsum("bld,dgk->blgk", h, self.wv[...]), h), "v")
        q, k = self.normalize_qk(q, k)
        inv_freq_K2, scale = self.rope_frequencies(kind), rope_attention_factor(self.cfg)
        q = constrain(rotary(q, inv_freq_K2, positions, scale), ("batch", "seq", "heads", "head_dim"))
        k = constrain(rotary(k, inv_freq_K2, positions, scale), ("batch", "seq", "kv_heads", "head_dim"))
        return q, k, v

    def normalize_qk(self, q_BxLxHxK, k_BxLxGxK):
        """Queries and keys before the rotary embeddings: as they are here (qwen3 normalizes them)."""
        return q_BxLxHxK, k_BxLxGxK

    def finish(self, x_BxLxD, ctx_BxLxHxK):
        """The block after attention: x + ctx wo, then x + mlp(norm(x)); the new x and the stats."""
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, "attn_ctx")
        attn = checkpoint_name(self.adapted("o", self.einsum("blhk,hkd->bld", ctx_BxLxHxK, self.wo[...]),
                                            ctx_BxLxHxK), "attn_out")
        x_BxLxD = constrain(x_BxLxD + attn, RESIDUAL)
        out, stats = self.mlp(self.mlp_norm(x_BxLxD))
        return constrain(x_BxLxD + out, RESIDUAL), stats

    def decode(self, x_BxLxD, cache_k_BxTxGxK, cache_v_BxTxGxK, start_B, window=None, kind=0):
        """The block on L new positions per row, start_B[b] .. start_B[b] + L - 1, with this layer's
        KV cache: their keys and values are written there, then each query attends to the cache
        positions <= its own (`cached_attention`). Returns the new x and the cache."""
        positions_BxL = start_B[:, None] + jnp.arange(x_BxLxD.shape[1])
        q, k, v = self.project(x_BxLxD, positions_BxL, kind)

        def write(cache_BxTxGxK, new_BxLxGxK):  # each row at its own start
            return constrain(write_rows(cache_BxTxGxK, new_BxLxGxK, start_B), ("batch", None, "kv_heads", "head_dim"))

        cache_k_BxTxGxK, cache_v_BxTxGxK = write(cache_k_BxTxGxK, k), write(cache_v_BxTxGxK, v)
        ctx_BxLxHxK = cached_attention(q, cache_k_BxTxGxK, cache_v_BxTxGxK, positions_BxL, window)
        x_BxLxD, _ = self.finish(x_BxLxD, ctx_BxLxHxK)
        return x_BxLxD, cache_k_BxTxGxK, cache_v_BxTxGxK

    def decode_window(self, x_BxLxD, ring_k_BxWxGxK, ring_v_BxWxGxK, start_B, sliding: int, window=None, kind=0,
                      ends_B=None):
        """`decode` for a layer of sliding window `sliding` with a ring buffer of W <= sliding
        positions (W < sliding only when no more positions are generated): slot t holds the
        latest position p < start with p = t mod W. Queries attend to the ring and to the L new
        keys (a prefill longer than W needs keys the ring will not keep), within min(sliding,
        `window`); then each slot takes the latest new position of its residue below `ends_B`
        (each row's end; None: all L are real), so a right-padded prompt's padding evicts nothing."""
        B, L = x_BxLxD.shape[:2]
        W = ring_k_BxWxGxK.shape[1]
        positions_BxL = start_B[:, None] + jnp.arange(L)
        q, k, v = self.project(x_BxLxD, positions_BxL, kind)
        slot_W = jnp.arange(W)
        held_BxW = start_B[:, None] - 1 - (start_B[:, None] - 1 - slot_W) % W  # < 0: empty
        keys_BxTxGxK = jnp.concatenate([ring_k_BxWxGxK, k.astype(ring_k_BxWxGxK.dtype)], axis=1)
        values_BxTxGxK = jnp.concatenate([ring_v_BxWxGxK, v.astype(ring_v_BxWxGxK.dtype)], axis=1)
        key_Bx1x1xT = jnp.concatenate([held_BxW, positions_BxL], axis=1)[:, None, None, :]
        query_Bx1xLx1 = positions_BxL[:, None, :, None]
        reach = sliding if window is None else jnp.minimum(sliding, window)
        mask_Bx1xLxT = (key_Bx1x1xT >= 0) & visible(query_Bx1xLx1, key_Bx1x1xT) & (key_Bx1x1xT > query_Bx1xLx1 - reach)
        ctx_BxLxHxK = jax.nn.dot_product_attention(q, keys_BxTxGxK, values_BxTxGxK, mask=mask_Bx1xLxT)
        end_B = start_B + L if ends_B is None else jnp.clip(ends_B, start_B, start_B + L)
        newest_BxW = end_B[:, None] - 1 - (end_B[:, None] - 1 - slot_W) % W  # the slot's latest new position
        taken_BxW = newest_BxW >= start_B[:, None]
        offset_BxW = jnp.clip(newest_BxW - start_B[:, None], 0, L - 1)

        def write(ring_BxWxGxK, new_BxLxGxK):
            picked = jnp.take_along_axis(new_BxLxGxK.astype(ring_BxWxGxK.dtype), offset_BxW[..., None, None], axis=1)
            ring_BxWxGxK = jnp.where(taken_BxW[..., None, None], picked, ring_BxWxGxK)
            return constrain(ring_BxWxGxK, ("batch", None, "kv_heads", "head_dim"))

        x_BxLxD, _ = self.finish(x_BxLxD, ctx_BxLxHxK)
        return x_BxLxD, write(ring_k_BxWxGxK, k), write(ring_v_BxWxGxK, v)

    def mlp(self, h_BxLxD):
        """A gated MLP, (act(h w_gate) * h w_up) w_down: SwiGLU (Shazeer 2020) with act = silu."""
        gate_BxLxF = self.adapted("gate", self.einsum("bld,df->blf", h_BxLxD, self.w_gate[...]), h_BxLxD)
        up_BxLxF = self.adapted("up", self.einsum("bld,df->blf", h_BxLxD, self.w_up[...]), h_BxLxD)
        gate_BxLxF, up_BxLxF = checkpoint_name(gate_BxLxF, "mlp_gate"), checkpoint_name(up_BxLxF, "mlp_up")
        h_BxLxF = constrain(self.activation(gate_BxLxF) * up_BxLxF, ("batch", "seq", "mlp"))
        out_BxLxD = self.adapted("down", self.einsum("blf,fd->bld", h_BxLxF, self.w_down[...]), h_BxLxF)
        return checkpoint_name(out_BxLxD, "mlp_out"), {}


def stacked_blocks(block_type, cfg, rngs: nnx.Rngs, count: int):
    """`count` blocks of `block_type`, their parameters stacked on a leading `layers` axis."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
        return block_type(cfg, rngs)

    return make_blocks(rngs)


class Transformer(nnx.Module):
    block_type = Block

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model)) * 0.02)
        self.blocks = stacked_blocks(self.block_type, cfg, rngs, cfg.stacked_layers())
        self.final_norm = self.block_type.norm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(_init(0, 1)(rngs.params(), (cfg.d_model, cfg.vocab_size)))


def layer_means(stats: dict, num_layers: int) -> dict:
    """`scan_blocks`' statistics as means over the `num_layers` layers, the per-layer ones as they are."""
    return {k: v if k in PER_LAYER_STATS else v / num_layers for k, v in stats.items()}


def per_layer(kinds=None, noise=None) -> dict:
    """The keyword arguments of `block` that differ by layer, stacked [layers, ...] (those given):
    `kind` (the layers' kinds, `LanguageModel.layer_kinds`, when they differ) and `noise` (their LoRA
    dropout keys, `layer_keys`, in training)."""
    given = {"kind": None if kinds is None else jnp.asarray(kinds, jnp.int32), "noise": noise}
    return {k: v for k, v in given.items() if v is not None}


def scan_blocks(layer, blocks, x_BxLxD, *docs, kinds=None, noise=None, bf16=None):
    """All stacked layers with one scan (compile time does not grow with depth): the output and the
    layers' statistics summed (PER_LAYER_STATS stacked). `layer(params_i, x[, docs]) -> (x, stats)`
    is `block`, perhaps under remat; `docs` (the window's documents, if any) go to every layer;
    `kinds` and `noise` (`per_layer`) go to each layer its own as `kind=` and `noise=`; `bf16` (per
    layer, `LanguageModel.bf16_blocks`): one scan per run of layers alike (models/layer_runs.py)."""
    if bf16 is not None:
        return scan_runs(scan_blocks, layer, blocks, x_BxLxD, *docs, kinds=kinds, noise=noise, kept=bf16)
    x_BxLxD, stats = jax.lax.scan(lambda x, pk: layer(pk[0], x, *docs, **pk[1]), x_BxLxD,
                                  (blocks, per_layer(kinds, noise)))
    return x_BxLxD, layer_sums(stats)


def layer_sums(stats: dict) -> dict:
    """Statistics stacked per layer [layers, ...] summed over the layers, PER_LAYER_STATS kept as they are."""
    return {k: v if k in PER_LAYER_STATS else jax.tree.map(lambda s: s.sum(axis=0), v) for k, v in stats.items()}


class LanguageModel:
    """The protocol meshtrain trains through, on pure parameter pytrees (nested dicts):
    `init(key)`, `embed(params, tokens)`, `block(params_i, x) -> (x, stats)`, `loss(params, x, targets)`
    (head and cross-entropy), `auxiliary_loss(stats)`, `head(params, x)` (logits), `apply`,
    `logical_axes(params)`, `saveable` (the activation names remat policies may keep);
    for generation, `init_cache` and `decode` (the cached forward, meshtrain/generate.py).
    `params["blocks"]` is stacked on a leading layers axis.

    `attention`: the kernel (meshtrain/ops/attention.py); `sequence_order`: the true position of each
    stored sequence position when the sequence is stored permuted (None: in order); `packing`:
    how a window splits into documents (meshtrain/ops/packing.py; None: it does not); `matmul`: the einsum
    of `block`'s projections and MLP (a recipe's, meshtrain/ops/recipes.py; the cached `decode` keeps jnp.einsum)."""

    module = Transformer
    saveable = MATMUL_OUTPUTS
    param_axes = PARAM_AXES
    post_norm = False  # the block normalizes its MLP's output (the planner's Megatron count under remat=full)
    stacks = ("blocks",)  # the parameters stacked on a leading layers axis (`logical_axes`)
    training_only = ()  # top-level parameters only the training objective uses (inference and export skip them)
    embed_stacks = ()  # stacks of the first layers, run by `embed` before `blocks` (on a pipeline: the first stage)

    def __init__(self, cfg, attention=xla_attention, sequence_order=None, packing=None, matmul=jnp.einsum,
                 expert_chunks: int = 1, bf16_layers=()):
        self.cfg = cfg.resolved()
        self.bf16_blocks = bf16_blocks(self.cfg, bf16_layers)  # parallel.bf16_layers: the blocks kept in bf16
        self.attention, self.sequence_order, self.packing = attention, sequence_order, packing
        self.matmul, self.expert_chunks = matmul, expert_chunks  # parallel.expert_chunks (models/experts.py)
        abstract = nnx.eval_shape(lambda: self.module(self.cfg, nnx.Rngs(0)))
        self._block_graphdef = nnx.graphdef(abstract.blocks)
        self._norm_graphdef = nnx.graphdef(abstract.final_norm)

    def init(self, key):
        return nnx.to_pure_dict(nnx.state(self.module(self.cfg, nnx.Rngs(key)), nnx.Param))

    def embed(self, params, tokens_BxL):
        """The embedding's rows [B, L, D] (meshtrain/ops/embedding.py: vocab-parallel, gradient reduce-scattered)."""
        return constrain(lookup(params["embedding"], tokens_BxL), RESIDUAL)

    def documents(self, tokens_BxL1):
        """The packing.Documents of a batch's inputs (tokens [B, L+1]), stored in the sequence
        order; None without `packing`. Pass them to `block` with each layer."""
        return None if self.packing is None else self.packing.documents(tokens_BxL1[:, :-1], self.sequence_order)

    @property
    def layer_kinds(self) -> np.ndarray | None:
        """Each layer's kind in model order, an index into the spec's `window_kinds`, when the layers
        differ (None: they do not). Pass it (in the blocks' storage order) to `scan_blocks`."""
        windows = self.cfg.layer_windows()
        kinds = self.cfg.window_kinds()
        return None if len(kinds) == 1 else np.array([kinds.index(w) for w in windows], np.int32)

    def block(self, params_i, x_BxLxD, docs=None, kind=None, noise=None):
        """`noise`: the layer's LoRA dropout keys [B, 2] (`layer_keys`), in training only."""
        block = nnx.merge(self._block_graphdef, params_i)
        block.einsum, block.expert_chunks = projection_einsum(self.matmul), self.expert_chunks
        if noise is not None:
            block.dropout_keys, block.dropout_positions = noise, self.sequence_order
        return block(x_BxLxD, self.attention, self.sequence_order, docs, kind)

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
        """Mean next-token cross-entropy of the head, never holding [B, L, V] logits (meshtrain/ops/loss.py)."""
        return cross_entropy(self.final_norm(params, x_BxLxD), self.unembedding(params), targets_BxL)

    def auxiliary_loss(self, stats):
        """What the blocks' statistics (summed over layers) add to the training loss: none here."""
        return jnp.zeros((), jnp.float32)

    def trunk(self, params, tokens_BxL, docs=None, layer=None, dropout_keys=None):
        """(the last hidden state [B, L, D] before the final norm, the blocks' statistics as means over
        `stacked_layers`): the embedding (with a family's `embed_stacks`), then every layer of `blocks`
        through `layer` (default `block`; the step passes it under its remat policy). `docs`: the
        tokens' packing.Documents; `dropout_keys`: the rows' LoRA dropout keys [B, 2] (`row_keys`, in
        training), `blocks` in model order."""
        noise = None if dropout_keys is None else layer_keys(dropout_keys, np.arange(self.stacked_layers))
        x, stats = scan_blocks(layer or self.block, params["blocks"], self.embed(params, tokens_BxL),
                               *([] if docs is None else [docs]), kinds=self.layer_kinds, noise=noise,
                               bf16=self.bf16_blocks)
        return x, layer_means(stats, self.stacked_layers)

    def apply(self, params, tokens_BxL, docs=None):
        """Logits of tokens [B, L] (in the sequence order); `docs`: their packing.Documents."""
        return self.head(params, self.trunk(params, tokens_BxL, docs)[0])

    def decoding_spec(self):
        """The model spec the cached forward runs with (the moe family's routes dropless)."""
        return self.cfg

    @functools.cached_property
    def _decode_graphdef(self):
        return nnx.graphdef(nnx.eval_shape(lambda: self.module(self.decoding_spec(), nnx.Rngs(0))).blocks)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """An empty KV cache: keys and values [layers, B, T, G, K] for T = max_len positions."""
        c = self.cfg
        zeros = jnp.zeros((c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim), dtype)
        return {"k": zeros, "v": zeros}

    def decode(self, params, tokens_BxL, cache, start_B, window: int | None = None, ends_B=None):
        """The cached forward: the final hidden states [B, L, D] (before `head`) of L new tokens per
        row at positions start_B[b] .. start_B[b] + L - 1, and the cache with their keys and values
        written. Prefill (a prompt) and one-token decoding are this one function; the layers run
        under one scan, as `scan_blocks`. `window`: attend to that many latest positions at most.
        `ends_B`: each row's end (a right-padded prompt's), which only windowed caches need
        (`Block.decode_window`)."""
        def layer(x_BxLxD, xs):
            params_i, k_BxTxGxK, v_BxTxGxK = xs
            block = nnx.merge(self._decode_graphdef, params_i)
            x_BxLxD, k_BxTxGxK, v_BxTxGxK = block.decode(x_BxLxD, k_BxTxGxK, v_BxTxGxK, start_B, window)
            return x_BxLxD, (k_BxTxGxK, v_BxTxGxK)

        x_BxLxD = self.embed(params, tokens_BxL)
        x_BxLxD, (k, v) = jax.lax.scan(layer, x_BxLxD, (params["blocks"], cache["k"], cache["v"]))
        return x_BxLxD, {"k": k, "v": v}

    def logical_axes(self, params):
        def axes(path, _):
            module = path[-2].key if len(path) > 1 else None
            names = self.param_axes.get(module) or self.param_axes[path[-1].key]
            if path[0].key not in self.stacks:
                return names
            return ("layers" if path[0].key == "blocks" else "outer_layers", *names)

        return jax.tree_util.tree_map_with_path(axes, params)

    def num_params(self, params, embedding: bool = True) -> int:
        n = sum(x.size for x in jax.tree.leaves(params))
        return n if embedding else n - params["embedding"].size

    def active_matmul_params(self, params) -> int:
        """Parameters one token multiplies by (the FLOPs model's N): the embedding table only when it
        doubles as the output head."""
        return self.num_params(params, embedding=self.cfg.tie_embeddings)

    def block_matmul_params(self, params) -> int:
        """Of those, the blocks': all but the head's V x D (the norms' scales, a negligible few, count as
        they do in N)."""
        return self.active_matmul_params(params) - self.cfg.vocab_size * self.cfg.d_model

    def fp8_matmul_params(self, params) -> int:
        """Of the blocks', those `block` multiplies through its `matmul` (fp8 recipes): all; the head is bf16."""
        return self.block_matmul_params(params)

    def fp8_weight(self, name: str, leaf) -> bool:
        """Whether the fp8 recipes quantize parameter `name` for `block`'s matmul (FSDP gathers it in fp8):
        every stacked matrix (projections, MLP, adapters); not a norm, the embedding or the head."""
        return leaf.ndim >= 3

    def slot_matmul_params(self, params, seq_len: int, expert_parallel: int = 1, in_fp8: bool = False,
                           rows_routed: bool = False) -> float:
        """Per token, the matmul parameters the step runs beyond N (the roofline's hardware FLOPs,
        not MFU's) with `expert_parallel` devices on the `expert` axis (`in_fp8`: those the block's
        fp8 matmul runs; `rows_routed`: the grouped matmuls run only the rows routed): none here;
        routed experts run every capacity slot, or dropless the whole expert-parallel receive buffer,
        filled or not, on the loop (models/routed.py)."""
        return 0.0

    @property
    def mtp_depth(self) -> int:
        """Multi-token prediction depths the objective adds (`mtp_shares`, `mtp_losses`): none here
        (models/deepseek_v3.py has them)."""
        return 0

    @property
    def stacked_layers(self) -> int:
        """The layers of the stack `blocks` (the layer scan, the pipeline's stages): the step reports
        their statistics as means over these (the spec's `stacked_layers`)."""
        return self.cfg.stacked_layers()

    @property
    def routed_layers(self) -> int:
        """The layers with routed experts (each exchanges its dispatch buffer): none here."""
        return 0

    def dispatch_bytes(self, rows: float, seq_len: int, act_bytes: int, expert_parallel: int = 1) -> dict | None:
        """One routed-expert layer's dispatch buffer per device, `rows` sequence rows held there and
        `expert_parallel` devices on the `expert` axis (the planner's memory and all-to-all traffic):
        None here, without routed experts (models/routed.py)."""
        return None

    def flops_per_token(self, params, seq_len: int) -> float:
        """Training FLOPs per token, 6N + 12 L (H K) S, a windowed layer's S its window when shorter
        (meshtrain/core/metrics.py)."""
        c = self.cfg
        return flops_per_token(self.active_matmul_params(params), c.num_layers, c.num_heads * c.head_dim, seq_len,
                               c.layer_windows())
