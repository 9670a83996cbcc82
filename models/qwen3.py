"""The `qwen3` family: the llama decoder with each query and key head RMS-normalized over its
head_dim before the rotary embeddings (QK-norm; Qwen3 technical report, Yang et al. 2025; as in
Dehghani et al. 2023), grouped-query attention with an explicit head_dim, no biases, tied or
untied head. Hugging Face form: `Qwen3ForCausalLM` (model_type qwen3).

Architecture fields: the shared ones (models/spec.py `ModelSpec`); the q/k norms' scales [K] are
the only parameters it adds, per layer (`q_norm`, `k_norm`, logical axis head_dim).
"""
from __future__ import annotations

from meshtrain.models.base import PARAM_AXES, LanguageModel, Transformer
from meshtrain.models.hf_llama import LLAMA_TENSORS, read_llama_config, write_llama_config
from meshtrain.models.qk_norm import QK_NORM_AXES, QK_NORM_TENSORS, Qwen3Block, refuse_windows
from meshtrain.models.spec import Family, HFConfig, HFMap, ModelSpec


class Qwen3Transformer(Transformer):
    block_type = Qwen3Block


class Qwen3LanguageModel(LanguageModel):
    module = Qwen3Transformer
    param_axes = {**PARAM_AXES, **QK_NORM_AXES}


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
