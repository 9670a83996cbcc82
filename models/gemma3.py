"""The `gemma3` family: Gemma 3's text decoder (Gemma Team 2025, Gemma 3 technical report). Every
`sliding_window_pattern`-th layer is global (full causal attention, rotary base rope_theta and its
rope_scaling: linear x8 on 4B and up), the others local (a sliding window of `sliding_window`
positions, base rope_local_theta unscaled); sandwich norms (RMSNorm before and after attention and
the MLP); RMSNorm as x / rms(x) x (1 + w) in fp32; qwen3's per-head q/k RMSNorm; embeddings x
sqrt(d_model) (in their dtype); attention scores scaled by query_pre_attn_scalar^-1/2; GeGLU (gelu,
tanh approximation); tied head. Hugging Face form: `Gemma3ForCausalLM` (model_type gemma3_text);
logit soft-capping (Gemma 2's; Gemma 3 has none) and bidirectional attention are refused.

The layers differ only in kind (window and rotary base), so they run under the one layer scan with
their kinds (models/base.py `Block`: a switch over the kernels' static windows). Generation
keeps a ring buffer of `sliding_window` positions for a local layer (`Block.decode_window`) and every
position for a global one, and runs the layers as a scan over whole patterns (static kinds).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain.core.bounds import setting
from meshtrain.core.errors import UserError
from meshtrain.models.base import PARAM_AXES, RESIDUAL, LanguageModel, RMSNorm, Transformer
from meshtrain.models.hf_llama import LAYER, LLAMA_TENSORS, read_llama_config, rope_kind, write_llama_config, write_rope
from meshtrain.models.qk_norm import QK_NORM_AXES, QK_NORM_TENSORS, Qwen3Block
from meshtrain.models.rope import rope_frequencies
from meshtrain.models.spec import Family, HFConfig, HFMap, ModelSpec, family_setting
from meshtrain.parallel.sharding import constrain


@dataclass
class Gemma3Spec(ModelSpec):
    family: str = family_setting("gemma3")
    sliding_window: int = setting(1024, "a local layer's queries see this many latest positions (Gemma 3: 512 "
                                        "for 1B, 1024 for 4B and up)", min=1)
    sliding_window_pattern: int = setting(6, "every this many layers the last is global (full causal attention), "
                                             "the others local (Gemma 3: 6)", min=1)
    rope_local_theta: float = setting(10000.0, "rotary base of the local layers (rope_theta and rope_scaling are "
                                               "the global layers')", min=1.0)
    query_pre_attn_scalar: int = setting(0, "attention scores are scaled by this^-1/2; 0 = head_dim", min=0)

    def layer_windows(self) -> tuple[int, ...]:
        p = self.sliding_window_pattern
        return tuple(0 if (i + 1) % p == 0 else self.sliding_window for i in range(self.num_layers))


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with gain 1 + w, w starting at 0 (Gemma)."""
    initial = 0.0

    def gain(self):
        return 1.0 + self.scale[...].astype(jnp.float32)


class Gemma3Block(Qwen3Block):
    """x + post_attn_norm(attn(norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x))); q/k normalized
    per head (Qwen3Block), the rotary base of the layer's kind."""
    norm = GemmaRMSNorm
    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))

    def __init__(self, cfg, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.post_attn_norm = self.norm(cfg.d_model, cfg.norm_eps)
        self.post_mlp_norm = self.norm(cfg.d_model, cfg.norm_eps)

    def rope_frequencies(self, kind=0):
        """A global layer's (window 0): rope_theta with the spec's scaling; a local one's:
        rope_local_theta, unscaled."""
        c = self.cfg
        local = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_scaling="none")
        table = [rope_frequencies(local if w else c) for w in c.window_kinds()]
        return table[kind] if isinstance(kind, int) else jnp.stack(table)[kind]

    def normalize_qk(self, q_BxLxHxK, k_BxLxGxK):
        """Queries also scaled by (K / query_pre_attn_scalar)^1/2, so that the kernels' K^-1/2 scales
        the scores by query_pre_attn_scalar^-1/2 (before the rotary embedding, a rotation: the same)."""
        q_BxLxHxK, k_BxLxGxK = super().normalize_qk(q_BxLxHxK, k_BxLxGxK)
        K, scalar = self.cfg.head_dim, self.cfg.query_pre_attn_scalar
        if scalar and scalar != K:
            q_BxLxHxK = q_BxLxHxK * jnp.asarray((K / scalar) ** 0.5, q_BxLxHxK.dtype)
        return q_BxLxHxK, k_BxLxGxK

    def finish(self, x_BxLxD, ctx_BxLxHxK):
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, "attn_ctx")
        attn = checkpoint_name(self.adapted("o", self.einsum("blhk,hkd->bld", ctx_BxLxHxK, self.wo[...]),
                                            ctx_BxLxHxK), "attn_out")
        x_BxLxD = constrain(x_BxLxD + self.post_attn_norm(attn), RESIDUAL)
        out, stats = self.mlp(self.mlp_norm(x_BxLxD))
        return constrain(x_BxLxD + self.post_mlp_norm(out), RESIDUAL), stats


class Gemma3Transformer(Transformer):
    block_type = Gemma3Block


class Gemma3LanguageModel(LanguageModel):
    module = Gemma3Transformer
    param_axes = {**PARAM_AXES, **QK_NORM_AXES}
    post_norm = True

    def embed(self, params, tokens_BxL):
        x_BxLxD = super().embed(params, tokens_BxL)
        return constrain(x_BxLxD * jnp.asarray(self.cfg.d_model ** 0.5, x_BxLxD.dtype), RESIDUAL)  # in x's dtype

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """Keys and values [layers, B, T, G, K] of the global layers (T = max_len), and of the
        local ones (`_window`) with T = min(sliding_window, max_len): a ring buffer."""
        c, windows = self.cfg, self.cfg.layer_windows()
        zeros = lambda n, t: jnp.zeros((n, batch, t, c.num_kv_heads, c.head_dim), dtype)
        full, local = zeros(windows.count(0), max_len), zeros(len(windows) - windows.count(0),
                                                               min(c.sliding_window, max_len))
        return {"k": full, "v": full, "k_window": local, "v_window": local}

    def decode(self, params, tokens_BxL, cache, start_B, window: int | None = None, ends_B=None):
        """`LanguageModel.decode` with a cache per kind (`init_cache`): a scan over whole patterns
        of sliding_window_pattern layers, unrolled inside (each layer's kind static), then the
        layers past the last whole pattern."""
        c = self.cfg
        windows, p = c.layer_windows(), c.sliding_window_pattern
        groups = c.num_layers // p
        kinds = c.window_kinds()

        def run(x_BxLxD, blocks, caches, layer_windows):
            """The layers of `layer_windows` (their params stacked in `blocks`; `caches` theirs, per
            kind in layer order): the new x and caches."""
            written, used = {name: [] for name in caches}, {"": 0, "_window": 0}
            for i, w in enumerate(layer_windows):
                block = nnx.merge(self._decode_graphdef, jax.tree.map(lambda a, i=i: a[i], blocks))
                tail = "_window" if w else ""
                k, v = caches["k" + tail][used[tail]], caches["v" + tail][used[tail]]
                if w:
                    x_BxLxD, k, v = block.decode_window(x_BxLxD, k, v, start_B, w, window, kinds.index(w), ends_B)
                else:
                    x_BxLxD, k, v = block.decode(x_BxLxD, k, v, start_B, window, kinds.index(w))
                written["k" + tail].append(k)
                written["v" + tail].append(v)
                used[tail] += 1
            return x_BxLxD, {name: stack(written[name], caches[name]) for name in caches}

        def stack(arrays, like):
            return jnp.stack(arrays) if arrays else like

        pattern = windows[:p]
        per = {"": pattern.count(0), "_window": p - pattern.count(0)}  # cache entries of each kind per pattern
        head = lambda a, n: a[:groups * n].reshape(groups, n, *a.shape[1:])
        x_BxLxD = self.embed(params, tokens_BxL)
        grouped_blocks = jax.tree.map(lambda a: head(a, p), params["blocks"])
        grouped_caches = {name: head(a, per[name[1:]]) for name, a in cache.items()}
        x_BxLxD, grouped = jax.lax.scan(lambda x, xs: run(x, *xs, pattern), x_BxLxD, (grouped_blocks, grouped_caches))
        rest_blocks = jax.tree.map(lambda a: a[groups * p:], params["blocks"])
        rest_caches = {name: a[groups * per[name[1:]]:] for name, a in cache.items()}
        x_BxLxD, rest = run(x_BxLxD, rest_blocks, rest_caches, windows[groups * p:])
        merged = {name: jnp.concatenate([grouped[name].reshape(-1, *a.shape[1:]), rest[name]])
                  for name, a in cache.items()}
        return x_BxLxD, merged


# ---- Hugging Face form: Gemma3ForCausalLM ----

TENSORS = {**LLAMA_TENSORS, **QK_NORM_TENSORS,
           ("blocks", "post_attn_norm", "scale"): (LAYER + "post_attention_layernorm.weight", False),
           ("blocks", "mlp_norm", "scale"): (LAYER + "pre_feedforward_layernorm.weight", False),
           ("blocks", "post_mlp_norm", "scale"): (LAYER + "post_feedforward_layernorm.weight", False)}
ACTIVATION = "gelu_pytorch_tanh"


def layer_types(num_layers: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def read_pattern(c: HFConfig) -> int:
    """sliding_window_pattern, from layer_types when given (transformers 5 writes those), which
    must be periodic: local layers, then a global one."""
    layers, types = c.need("num_hidden_layers"), c.get("layer_types")
    pattern = int(c.get("sliding_window_pattern", 6))
    if types is None:
        return pattern
    guesses = [pattern, types.index("full_attention") + 1 if "full_attention" in types else layers + 1]
    found = next((p for p in guesses if layer_types(layers, p) == list(types)), None)
    if found is None:
        raise UserError(f"{c.path}: layer_types is not a repeating pattern of sliding_attention layers then a "
                        f"full_attention one, which meshtrain's gemma3 model computes; this checkpoint cannot be "
                        f"imported exactly")
    return found


def read_gemma3(c: HFConfig) -> Gemma3Spec:
    """rope_parameters per layer type (transformers 5), or rope_theta + rope_scaling for the global
    layers and rope_local_base_freq for the local ones (earlier config.json files)."""
    c.refuse(final_logit_softcapping=lambda v: v is not None, attn_logit_softcapping=lambda v: v is not None,
             use_bidirectional_attention=bool, hidden_activation=lambda v: v != ACTIVATION,
             hidden_act=lambda v: v != ACTIVATION)
    rope = c.get("rope_parameters") or {}
    full = rope.get("full_attention") or {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 1e6)}
    local = rope.get("sliding_attention") or {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
    if rope_kind(c, full) == "yarn":  # its cos/sin factor would reach the local layers too (models/rope.py)
        raise UserError(f"{c.path}: rope scaling 'yarn' is not implemented for gemma3 (meshtrain would scale the "
                        f"sliding_attention layers' rope as well); this checkpoint cannot be imported exactly")
    if rope_kind(c, local) != "default":
        raise UserError(f"{c.path}: the sliding_attention layers' rope scaling {rope_kind(c, local)!r} is not "
                        f"implemented (meshtrain scales the global layers' rope only)")
    llama_view = HFConfig({**{k: v for k, v in c.items() if k != "hidden_act"}, "rope_parameters": full,
                           "tie_word_embeddings": c.get("tie_word_embeddings", True)}, c.path)
    return read_llama_config(llama_view, Gemma3Spec, sliding_window=int(c.need("sliding_window")),
                             sliding_window_pattern=read_pattern(c), rope_local_theta=float(local["rope_theta"]),
                             query_pre_attn_scalar=int(c.get("query_pre_attn_scalar", 256)))


def write_gemma3(m: Gemma3Spec) -> dict:
    config = write_llama_config(m, "gemma3_text", "Gemma3ForCausalLM")
    del config["mlp_bias"], config["hidden_act"]
    local = {"rope_type": "default", "rope_theta": m.rope_local_theta}
    return {**config, "hidden_activation": ACTIVATION, "query_pre_attn_scalar": m.query_pre_attn_scalar or m.head_dim,
            "sliding_window": m.sliding_window, "sliding_window_pattern": m.sliding_window_pattern,
            "layer_types": layer_types(m.num_layers, m.sliding_window_pattern),
            "rope_parameters": {"full_attention": write_rope(m), "sliding_attention": local},
            "rope_local_base_freq": m.rope_local_theta, "max_position_embeddings": 131072,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False}


FAMILY = Family("gemma3", "Gemma 3 text decoder: 5 sliding-window layers per global one, sandwich norms, "
                          "q/k RMSNorm, GeGLU, scaled embeddings, tied head", Gemma3Spec, Gemma3LanguageModel,
                HFMap(("gemma3_text",), TENSORS, read_gemma3, write_gemma3))
