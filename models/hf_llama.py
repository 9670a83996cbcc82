"""The Llama-style Hugging Face form (LlamaForCausalLM's config.json and tensor names) that every
family's form starts from: `LLAMA_TENSORS`, `read_llama_config`, `write_llama_config` and the rope
entries (`rope_kind`, `read_rope_scaling`, `write_rope`). meshtrain/interop/hf.py applies a family's
`HFMap`.
"""
from __future__ import annotations

from meshtrain.core.errors import UserError
from meshtrain.models.spec import HFConfig, ModelSpec

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
