"""The `qwen3` family: the llama decoder with each query and key head RMS-normalized over its
head_dim before the rotary embeddings (QK-norm; Qwen3 technical report, Yang et al. 2025; as in
Dehghani et al. 2023), grouped-query attention with an explicit head_dim, no biases, tied or
untied head. Hugging Face form: `Qwen3ForCausalLM` (model_type qwen3).

Architecture fields: the shared ones (models/spec.py `ModelSpec`); the q/k norms' scales [K] are
the only parameters it adds, per layer (`q_norm`, `k_norm`, logical axis head_dim).
"""
from __future__ import annotations

from meshtrain.models.base import (
    LAYER,
    LLAMA_TENSORS,
    PARAM_AXES,
    Block,
    LanguageModel,
    Transformer,
    read_llama_config,
    write_llama_config,
)
from meshtrain.models.spec import Family, HFConfig, HFMap, ModelSpec

QK_NORM_AXES = {"q_norm": ("head_dim",), "k_norm": ("head_dim",)}
QK_NORM_TENSORS = {("blocks", "q_norm", "scale"): (LAYER + "self_attn.q_norm.weight", False),
                   ("blocks", "k_norm", "scale"): (LAYER + "self_attn.k_norm.weight", False)}


class Qwen3Block(Block):
    """The llama block with q_norm and k_norm: RMSNorm over each head's K channels, one scale [K]
    shared by all heads."""

    def __init__(self, cfg, rngs):
        super().__init__(cfg, rngs)
        self.q_norm = self.norm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = self.norm(cfg.head_dim, cfg.norm_eps)

    def normalize_qk(self, q_BxLxHxK, k_BxLxGxK):
        return self.q_norm(q_BxLxHxK), self.k_norm(k_BxLxGxK)


class Qwen3Transformer(Transformer):
    block_type = Qwen3Block


class Qwen3LanguageModel(LanguageModel):
    module = Qwen3Transformer
    param_axes = {**PARAM_AXES, **QK_NORM_AXES}


def refuse_windows(c: HFConfig) -> None:
    """Qwen3 configs carry a sliding_window size that only use_sliding_window turns on."""
    c.refuse(use_sliding_window=bool,
             layer_types=lambda types: any(t != "full_attention" for t in types or ()))


def read_qwen3(c: HFConfig) -> ModelSpec:
    refuse_windows(c)
    return read_llama_config(c, family="qwen3")


def write_qwen3(m: ModelSpec) -> dict:
    config = write_llama_config(m, "qwen3", "Qwen3ForCausalLM")
    del config["mlp_bias"]
    return {**config, "use_sliding_window": False, "sliding_window": None}


FAMILY = Family("qwen3", "dense decoder with per-head q/k RMSNorm before RoPE (Qwen3): GQA, explicit head_dim, "
                         "tied or untied head", ModelSpec, Qwen3LanguageModel,
                HFMap(("qwen3",), {**LLAMA_TENSORS, **QK_NORM_TENSORS}, read_qwen3, write_qwen3))
