"""The base every model family builds on: the model protocol (`LanguageModel`), the shared blocks
and the Llama-style Hugging Face translation. A family (models/llama.py, moe.py, qwen3.py, ...) is
one module that changes parts of these (a block's MLP or norms, its parameter axes, its config).

- `LanguageModel`: the protocol meshtrain trains through (init, embed, block, loss, auxiliary_loss,
  head, logical_axes, the counts, the cached decode), on pure parameter pytrees; `scan_blocks` runs
  the layers, stacked on a leading `layers` axis, with one scan.
- The blocks, in Flax NNX: RMSNorm, rotary embeddings (`rope_frequencies`, `rotary`), grouped-query
  attention, SwiGLU, tied or untied head (`Block`, `Transformer`). With no changes they are the
  `llama` family's decoder.
- `PARAM_AXES` and `contracted_axes`: the logical axes of the parameters, which sharding, INT8
  channels and Hugging Face layouts follow.
- `LLAMA_TENSORS`, `read_llama_config`, `write_llama_config` and the rope entries: the
  LlamaForCausalLM config.json and tensor names the other families' Hugging Face forms start from.

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
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.core.errors import UserError
from meshtrain.core.metrics import flops_per_token
from meshtrain.models.spec import LORA_TARGETS, HFConfig, ModelSpec
from meshtrain.ops.attention import xla_attention
from meshtrain.ops.embedding import lookup
from meshtrain.ops.loss import cross_entropy
from meshtrain.ops.packing import visible
from meshtrain.parallel.sharding import LAYER_AXES, constrain

# Logical axes of every parameter, by its name or its module's (a norm's `scale` is `embed` unless its
# module is named here); stacked block parameters get a leading "layers" (`blocks`, which pipeline
# stages split) or "outer_layers" (another stack: whole on every stage).
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
STACKED_AXES = (*LAYER_AXES, "experts")  # leading axes that stack independent weights

# LoRA (models/spec.py LoraSpec): each target's base weight and the einsums of x A and (x A) B.
LORA = {"q": ("wq", "bld,dr->blr", "blr,rhk->blhk"), "k": ("wk", "bld,dr->blr", "blr,rgk->blgk"),
        "v": ("wv", "bld,dr->blr", "blr,rgk->blgk"), "o": ("wo", "blhk,hkr->blr", "blr,rd->bld"),
        "gate": ("w_gate", "bld,dr->blr", "blr,rf->blf"), "up": ("w_up", "bld,dr->blr", "blr,rf->blf"),
        "down": ("w_down", "blf,fr->blr", "blr,rd->bld")}


def contracted_axes(names: tuple) -> tuple[int, ...]:
    """Indices of the axes a weight's matmul contracts, from its logical axes: the first one that is
    not a stacking axis (layers, experts) or vocab, and head_dim after heads (wo [H, K, D] contracts
    H and K); () for a vector (a norm scale). INT8 channels and Hugging Face layouts follow it."""
    if sum(n not in STACKED_AXES for n in names) < 2:
        return ()
    first = next(i for i, n in enumerate(names) if n not in (*STACKED_AXES, "vocab"))
    heads = names[first] in ("heads", "kv_heads") and names[first + 1:first + 2] == ("head_dim",)
    return (first, first + 1) if heads else (first,)


def lora_parts(base: tuple) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The indices of a weight's axes (logical `base`) as an adapter factors it: the stacking ones
    before those it contracts (experts: one adapter each), the contracted ones (x A) and the rest
    ((x A) B gives them)."""
    into = contracted_axes(base)
    stacked = tuple(i for i in range(into[0]) if base[i] in STACKED_AXES)
    return stacked, into, tuple(i for i in range(len(base)) if i not in stacked + into)


def lora_axes(base: tuple) -> tuple[tuple, tuple]:
    """The logical axes of an adapter's A and B on a weight of axes `base`: both keep its stacking
    axes (a routed expert's adapter is that expert's), A takes its input (contracted) axes, B its
    output axes; the rank ("lora_rank") is sharded as `embed` is where the factor has no `embed` axis
    (meshtrain/parallel/sharding.py DEFAULT_RULES)."""
    stacked, into, out = (tuple(base[i] for i in part) for part in lora_parts(base))
    return (*stacked, *into, "lora_rank"), (*stacked, "lora_rank", *out)


def init_adapter(key, shape: tuple, base: tuple, rank: int):
    """An adapter's (A, B) in fp32 on a weight of `shape` and logical axes `base`: A as PEFT's
    default (kaiming_uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))), B zero, so the
    adapted model starts as its base."""
    stacked, into, out = ([shape[i] for i in part] for part in lora_parts(base))
    bound = 1.0 / np.sqrt(np.prod(into))
    a = jax.random.uniform(key, (*stacked, *into, rank), jnp.float32, -bound, bound)
    return a, jnp.zeros((*stacked, rank, *out), jnp.float32)


PARAM_AXES |= {f"lora_{t}_{part}": axes for t, (w, *_) in LORA.items()
               for part, axes in zip("ab", lora_axes(PARAM_AXES[w]))}


def adapters_off(params):
    """The same parameters with every LoRA B at zero: the model's output is then exactly the base's
    (x A 0 adds 0), on every layout and executor; DPO's reference model with LoRA."""
    zero_b = lambda path, x: jnp.zeros_like(x) if (path[-1].key.startswith("lora_") and
                                                    path[-1].key.endswith("_b")) else x
    return jax.tree_util.tree_map_with_path(zero_b, params)


def adapted_weight(adapter: str) -> str:
    """The base weight of the adapter `lora_<name>` (its `_a` and `_b`): a LORA target's, or a routed
    expert projection's, `lora_expert_gate` on `expert_gate` (models/moe.py)."""
    name = adapter.removeprefix("lora_")
    return name if name.startswith("expert_") else LORA[name][0]


def merge_adapters(params, lora) -> dict:
    """The base parameters with each adapter folded in, W + (alpha / rank) A B (the merged weights
    PEFT's merge_and_unload gives), and no adapters: the same function as the adapted model. A
    [stack, in, r] and B [stack, r, out] on W [stack, in, out] (stack: layers, and experts for a
    routed expert's), each group of axes flattened: s stacking axes make A.ndim + B.ndim = W.ndim + s + 2."""
    blocks = {k: v for k, v in params["blocks"].items() if not k.startswith("lora_")}
    for adapter in sorted({k[:-2] for k in params["blocks"] if k.startswith("lora_")}) if lora.rank else ():
        name, a, b = adapted_weight(adapter), params["blocks"][f"{adapter}_a"], params["blocks"][f"{adapter}_b"]
        w = blocks[name]
        s = a.ndim + b.ndim - w.ndim - 2
        S, R = math.prod(w.shape[:s]), a.shape[-1]
        a_SxIxR, b_SxRxO = a.reshape(S, -1, R), b.reshape(S, R, -1)
        delta = jnp.einsum("sir,sro->sio", a_SxIxR.astype(jnp.float32), b_SxRxO.astype(jnp.float32))
        blocks[name] = (w.astype(jnp.float32) + lora.scale * delta.reshape(w.shape)).astype(w.dtype)
    return {**params, "blocks": blocks}


# LoRA dropout (LoraSpec.dropout), PEFT's: y = x W + scale dropout(x) A B, inverted (the kept
# values / (1 - p)), in training only. A mask is a function of the step, the row of the step's batch,
# the layer of the stack, the target and the token's true position alone: `row_keys` draws each row's
# key from (seed, step), `layer_keys` folds in each layer's index in model order, `lora_dropout` the
# target and the position. So every layout, microbatch split and pipeline schedule, and a resumed
# run, draws the same mask for the same token (tests/test_lora.py).
DROPOUT_STREAM = 0x4C6F5241  # folded into the seed first: apart from the initialization's keys


def row_keys(seed: int, step, rows: int):
    """[rows, 2] uint32: the raw keys of the step's batch rows, fold_in(fold_in(seed's, step), row)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DROPOUT_STREAM), step)
    return jax.vmap(fold_key, (None, 0))(jax.random.key_data(key), jnp.arange(rows))


def fold_key(raw_key, data):
    """A raw key [2] (uint32, as it travels with its row) folded with `data`, raw."""
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(raw_key), data))


def layer_keys(rows_Bx2, layers_N):
    """[N, B, 2]: each row's key (`row_keys`) folded with each layer's index in model order."""
    return jax.vmap(jax.vmap(fold_key, (0, None)), (None, 0))(rows_Bx2, jnp.asarray(layers_N, jnp.int32))


def lora_dropout(x_BxLx_, keys_Bx2, target: str, rate: float, positions_L=None):
    """x with each element zeroed with probability `rate` and the kept ones divided by 1 - rate; the
    mask of row b and position l drawn from keys[b] (the layer's, `layer_keys`) folded with the
    target and positions[l], the token's true position (default 0..L-1; context parallelism stores
    the sequence permuted)."""
    positions_L = jnp.arange(x_BxLx_.shape[1]) if positions_L is None else jnp.asarray(positions_L)
    shape = x_BxLx_.shape[2:]

    def row(key_2):
        target_key = fold_key(key_2, LORA_TARGETS.index(target))
        keep = lambda p: jax.random.bernoulli(jax.random.wrap_key_data(fold_key(target_key, p)), 1.0 - rate, shape)
        return jax.vmap(keep)(positions_L)

    keep_BxLx_ = jax.vmap(row)(keys_Bx2)
    return jnp.where(keep_BxLx_, x_BxLx_ / (1.0 - rate), 0).astype(x_BxLx_.dtype)


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


def rope_frequencies(cfg, dim: int | None = None):
    """The rotary inverse frequencies [K/2] of `dim` rotated channels (default: head_dim): theta^(-2i/K)
    (Su et al., RoFormer); with rope_scaling=llama3, Llama 3.1's long-context rescaling: wavelengths
    2 pi / f longer than original_max_len / low_freq_factor are divided by `rope_factor`, shorter than
    original_max_len / high_freq_factor kept, and those between interpolated with
    s = (original_max_len / wavelength - low) / (high - low): f' = (1 - s) f / factor + s f; with
    rope_scaling=linear (position interpolation, Chen et al. 2023), every f / `rope_factor`; with
    rope_scaling=yarn (YaRN, Peng et al. 2023, as transformers computes it), channel i's r = i - lo over
    hi - lo clipped to [0, 1] gives f' = r f / factor + (1 - r) f, where lo (floored) and hi (ceiled)
    are the channels d(b) = K ln(original_max_len / (2 pi b)) / (2 ln theta) of b = beta_fast, beta_slow."""
    K = dim or cfg.head_dim
    inv_freq = cfg.rope_theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    if cfg.rope_scaling == "none":
        return inv_freq
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "yarn":
        turns = lambda b: K * math.log(cfg.rope_original_max_len / (b * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        lo, hi = max(math.floor(turns(cfg.rope_beta_fast)), 0), min(math.ceil(turns(cfg.rope_beta_slow)), K - 1)
        ramp = jnp.clip((jnp.arange(K // 2, dtype=jnp.float32) - lo) / ((hi - lo) if hi != lo else 0.001), 0, 1)
        return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)
    low, high, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    wavelength = 2 * jnp.pi / inv_freq
    smooth = (cfg.rope_original_max_len / wavelength - low) / (high - low)
    scaled = jnp.where(wavelength > cfg.rope_original_max_len / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= cfg.rope_original_max_len / high) & (wavelength <= cfg.rope_original_max_len / low)
    return jnp.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature m = 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg) -> float:
    """What rope scaling multiplies cos and sin by (so rotated q . k by its square): 1 but under yarn,
    m(rope_mscale) / m(rope_mscale_all_dim) when both are given, else m(1) (`yarn_mscale`)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def rotary(x_BxLxNxK, inv_freq_K2, positions=None, scale: float = 1.0):
    """Rotate channel pairs (i, i + K/2) by position x inv_freq[i] (`rope_frequencies`), times `scale`
    (`rope_attention_factor`). `positions`: each stored position's place in the sequence, [L] or per
    row [B, L] (None: 0..L-1)."""
    L = x_BxLxNxK.shape[1]
    positions = jnp.arange(L) if positions is None else jnp.asarray(positions)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq_K2  # [L, K/2] or [B, L, K/2]
    cos, sin = scale * jnp.cos(angle)[..., None, :], scale * jnp.sin(angle)[..., None, :]
    x1, x2 = jnp.split(x_BxLxNxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxK.dtype)


def cached_attention(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, positions_BxL, window: int | None = None,
                     scale: float | None = None):
    """Attention of L queries per row over a KV cache of T positions: each query sees the cache
    positions <= its own (`positions_BxL`), so what lies beyond a row's end is never read; with
    `window`, only the last `window` of them (sliding-window attention, Beltagy et al. 2020).
    fp32 scores and softmax, grouped-query, as `meshtrain.ops.attention.xla_attention`; scores x
    `scale` (default K^-1/2)."""
    pos_Bx1xLx1, cache_T = positions_BxL[:, None, :, None], jnp.arange(k_BxTxGxK.shape[1])
    mask_Bx1xLxT = cache_T <= pos_Bx1xLx1
    if window is not None:
        mask_Bx1xLxT &= cache_T > pos_Bx1xLx1 - window
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, mask=mask_Bx1xLxT, scale=scale)


def write_rows(cache_BxTx_, new_BxLx_, start_B):
    """The cache with each row's L new entries written at its own start position."""
    put = lambda c_Tx_, n_Lx_, s: jax.lax.dynamic_update_slice_in_dim(c_Tx_, n_Lx_, s, 0)
    return jax.vmap(put)(cache_BxTx_, new_BxLx_.astype(cache_BxTx_.dtype), start_B)


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
            a, b = init_adapter(rngs.params(), getattr(self, w).shape, PARAM_AXES[w], cfg.lora.rank)
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
        h = self.attn_norm(x_BxLxD)
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


# Block statistics kept per layer ([layers, ...], storage order) rather than summed over layers:
# each expert's share of a routed layer's assignments, which the router bias update reads.
PER_LAYER_STATS = ("expert_load",)


def layer_means(stats: dict, num_layers: int) -> dict:
    """`scan_blocks`' statistics as means over the `num_layers` layers, the per-layer ones as they are."""
    return {k: v if k in PER_LAYER_STATS else v / num_layers for k, v in stats.items()}


def per_layer(kinds=None, noise=None) -> dict:
    """The keyword arguments of `block` that differ by layer, stacked [layers, ...] (those given):
    `kind` (the layers' kinds, `LanguageModel.layer_kinds`, when they differ) and `noise` (their LoRA
    dropout keys, `layer_keys`, in training)."""
    given = {"kind": None if kinds is None else jnp.asarray(kinds, jnp.int32), "noise": noise}
    return {k: v for k, v in given.items() if v is not None}


def scan_blocks(layer, blocks, x_BxLxD, *docs, kinds=None, noise=None):
    """All stacked layers with one scan (compile time does not grow with depth): the output and the
    layers' statistics summed (PER_LAYER_STATS stacked). `layer(params_i, x[, docs]) -> (x, stats)`
    is `block`, perhaps under remat; `docs` (the window's documents, if any) go to every layer;
    `kinds` and `noise` (`per_layer`) go to each layer its own as `kind=` and `noise=`."""
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
    how a window splits into documents (meshtrain/ops/packing.py; None: it does not); `matmul`:
    the einsum of `block`'s projections and MLP (meshtrain/ops/fp8.py's under fp8; the cached
    `decode` keeps jnp.einsum)."""

    module = Transformer
    saveable = MATMUL_OUTPUTS
    param_axes = PARAM_AXES
    post_norm = False  # the block normalizes its MLP's output (the planner's Megatron count under remat=full)
    stacks = ("blocks",)  # the parameters stacked on a leading layers axis (`logical_axes`)
    training_only = ()  # top-level parameters only the training objective uses (inference and export skip them)
    embed_stacks = ()  # stacks of the first layers, run by `embed` before `blocks` (on a pipeline: the first stage)

    def __init__(self, cfg, attention=xla_attention, sequence_order=None, packing=None, matmul=jnp.einsum):
        self.cfg = cfg.resolved()
        self.attention, self.sequence_order, self.packing = attention, sequence_order, packing
        self.matmul = matmul
        abstract = nnx.eval_shape(lambda: self.module(self.cfg, nnx.Rngs(0)))
        self._block_graphdef = nnx.graphdef(abstract.blocks)
        self._norm_graphdef = nnx.graphdef(abstract.final_norm)

    def init(self, key):
        return nnx.to_pure_dict(nnx.state(self.module(self.cfg, nnx.Rngs(key)), nnx.Param))

    def embed(self, params, tokens_BxL):
        """The embedding's rows [B, L, D] (meshtrain/ops/embedding.py: vocab-parallel, its gradient
        reduce-scattered onto the table's shards)."""
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
        block.einsum = self.matmul
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
                               *([] if docs is None else [docs]), kinds=self.layer_kinds, noise=noise)
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
        """Of the blocks', those of the matmuls `block` runs through its `matmul` (fp8 under
        precision=fp8): all of them here; the head runs bf16."""
        return self.block_matmul_params(params)

    def slot_matmul_params(self, params, seq_len: int, expert_parallel: int = 1, in_fp8: bool = False) -> float:
        """Per token, the matmul parameters the step runs beyond N (the roofline's hardware FLOPs,
        not MFU's) with `expert_parallel` devices on the `expert` axis (`in_fp8`: those the block's
        fp8 matmul runs): none here; routed experts run every capacity slot, or dropless the whole
        expert-parallel receive buffer, filled or not (moe.py)."""
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
        None here, without routed experts (moe.py)."""
        return None

    def flops_per_token(self, params, seq_len: int) -> float:
        """Training FLOPs per token, 6N + 12 L (H K) S, a windowed layer's S its window when shorter
        (meshtrain/core/metrics.py)."""
        c = self.cfg
        return flops_per_token(self.active_matmul_params(params), c.num_layers, c.num_heads * c.head_dim, seq_len,
                               c.layer_windows())


# ---- the Llama-style Hugging Face form (LlamaForCausalLM's) that every family builds on ----

LAYER = "model.layers.{i}."
LLAMA_TENSORS = {
    ("embedding",): ("model.embed_tokens.weight", False),
    ("lm_head",): ("lm_head.weight", True),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("blocks", "attn_norm", "scale"): (LAYER + "input_layernorm.weight", False),
    ("blocks", "mlp_norm", "scale"): (LAYER + "post_attention_layernorm.weight", False),
    ("blocks", "wq"): (LAYER + "self_attn.q_proj.weight", True),
    ("blocks", "wk"): (LAYER + "self_attn.k_proj.weight", True),
    ("blocks", "wv"): (LAYER + "self_attn.v_proj.weight", True),
    ("blocks", "wo"): (LAYER + "self_attn.o_proj.weight", True),
    ("blocks", "w_gate"): (LAYER + "mlp.gate_proj.weight", True),
    ("blocks", "w_up"): (LAYER + "mlp.up_proj.weight", True),
    ("blocks", "w_down"): (LAYER + "mlp.down_proj.weight", True),
}


def read_llama_config(c: HFConfig, spec_type=ModelSpec, **fields) -> ModelSpec:
    """The decoder fields every Llama-like config.json has (width, heads, rope, norm, head), as a
    `spec_type` with `fields` (the family's own, or others' values in its place) added. Refuses
    biases and other activations."""
    c.refuse(attention_bias=bool, mlp_bias=bool, hidden_act=lambda v: v != "silu")
    rope = c.get("rope_parameters") or {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 10000.0)}
    rope_kind(c, rope)
    heads, width = c.need("num_attention_heads"), c.need("hidden_size")
    shared = dict(
        vocab_size=c.need("vocab_size"), num_layers=c.need("num_hidden_layers"), d_model=width, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or width // heads,
        mlp_dim=c.get("intermediate_size"), rope_theta=float(rope["rope_theta"]),
        norm_eps=float(c.need("rms_norm_eps")), tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    spec = spec_type(**{**shared, **fields})
    if not spec.mlp_dim:
        c.need("intermediate_size")
    read_rope_scaling(c, rope, spec)
    return spec


def rope_kind(c: HFConfig, rope: dict) -> str:
    """A config.json rope entry's type, which must be one meshtrain computes (`rope_frequencies`)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise UserError(f"{c.path}: rope scaling {rope_type!r} is not implemented (meshtrain has none, llama3, "
                        f"linear and yarn)")
    if rope_type == "yarn" and (rope.get("attention_factor") is not None or rope.get("truncate", True) is not True):
        raise UserError(f"{c.path}: yarn rope scaling with attention_factor or truncate=false is not implemented "
                        f"(meshtrain derives the factor from mscale and mscale_all_dim, and truncates)")
    return rope_type


def read_rope_scaling(c: HFConfig, rope: dict, spec: ModelSpec) -> None:
    """The spec's rope_* fields from a config.json rope entry (`rope_kind`'s types)."""
    rope_type = rope_kind(c, rope)
    if rope_type == "linear":
        spec.rope_scaling, spec.rope_factor = "linear", float(c.need("factor", rope))
    if rope_type == "llama3":
        spec.rope_scaling, spec.rope_factor = "llama3", float(c.need("factor", rope))
        spec.rope_low_freq_factor = float(c.need("low_freq_factor", rope))
        spec.rope_high_freq_factor = float(c.need("high_freq_factor", rope))
        spec.rope_original_max_len = int(c.need("original_max_position_embeddings", rope))
    if rope_type == "yarn":
        spec.rope_scaling, spec.rope_factor = "yarn", float(c.need("factor", rope))
        spec.rope_original_max_len = int(c.need("original_max_position_embeddings", rope))
        spec.rope_beta_fast = float(rope.get("beta_fast") or 32.0)  # transformers' defaults
        spec.rope_beta_slow = float(rope.get("beta_slow") or 1.0)
        spec.rope_mscale = float(rope.get("mscale") or 0.0)
        spec.rope_mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)


def write_rope(m: ModelSpec) -> dict:
    """A config.json rope entry (transformers 5's `rope_parameters` form) for the spec's rope_* fields."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=m.rope_factor)
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor, original_max_position_embeddings=m.rope_original_max_len)
    if m.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=m.rope_factor, original_max_position_embeddings=m.rope_original_max_len,
                    beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow,
                    **{k: v for k, v in (("mscale", m.rope_mscale), ("mscale_all_dim", m.rope_mscale_all_dim)) if v})
    return rope


def write_llama_config(m: ModelSpec, model_type: str = "llama", architecture: str = "LlamaForCausalLM") -> dict:
    """config.json's decoder fields for a resolved spec: rope given both as `rope_parameters`
    (transformers 5) and as `rope_theta` + `rope_scaling` (earlier versions)."""
    rope = write_rope(m)
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": m.vocab_size,
        "hidden_size": m.d_model, "intermediate_size": m.mlp_dim, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling != "none" else None,
        "max_position_embeddings": int(max(m.rope_original_max_len * (m.rope_factor if m.rope_scaling in (
            "llama3", "yarn") else 1), 2048)),
        "attention_bias": False, "mlp_bias": False,
    }
