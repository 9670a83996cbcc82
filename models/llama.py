"""The `llama` family: the dense decoder of Llama 2 and 3 (grouped-query attention, SwiGLU, RoPE with
Llama 3.1's long-context scaling, tied or untied head), which is models/base.py's model as it is.
Hugging Face form: `LlamaForCausalLM` (model_type llama), models/hf_llama.py's tensor names and config
translation, without sliding windows.

Architecture fields: the shared ones (models/spec.py `ModelSpec`), none of its own.
"""
from __future__ import annotations

from meshtrain.models.base import LanguageModel
from meshtrain.models.hf_llama import LLAMA_TENSORS, read_llama_config, write_llama_config
from meshtrain.models.spec import Family, HFConfig, HFMap, ModelSpec


def read_llama(c: HFConfig) -> ModelSpec:
    c.refuse(sliding_window=lambda v: v is not None)
    return read_llama_config(c)


FAMILY = Family("llama", "dense decoder (Llama 2/3): GQA, SwiGLU, RoPE (llama3 scaling), tied or untied head",
                ModelSpec, LanguageModel, HFMap(("llama",), LLAMA_TENSORS, read_llama, write_llama_config))
