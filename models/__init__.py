"""Model families, imported as `meshtrain.models` (this folder is installed under that name).

Each family is one module declaring a `FAMILY` (the protocol: models/spec.py), chosen by
`model.family`; `FAMILIES` is the registry the config, the program, the planner and Hugging Face
import/export read. Code outside models/ goes through this package, spec.py, base.py (the model
protocol `LanguageModel`, the shared blocks, `scan_blocks`, the parameters' logical axes) and the
shared modules, never through a family module; a family module imports no other family's, so a
family that only changes blocks stays one module (tests/test_layout.py). The families:
- llama.py: `llama`, the dense decoder (Llama 2/3): base.py's model as it is.
- moe.py: `moe`, mixture-of-experts MLPs (Mixtral; DeepSeek's shared experts).
- qwen3.py: `qwen3`, the dense decoder with per-head q/k RMSNorm.
- qwen3_moe.py: `qwen3_moe`, qwen3 attention with routed experts in every block.
- gemma3.py: `gemma3`, Gemma 3's text decoder: sliding-window and global layers interleaved.
- deepseek_v3.py: `deepseek_v3`, multi-head latent attention and DeepSeek MoE (shared experts, biased
  sigmoid routing), the first layers dense.
The shared modules: axes.py (the weights' logical axes), lora.py, rope.py, kv_cache.py, hf_llama.py
(the Llama-style Hugging Face form), experts.py (routing and dispatch of routed experts), routed.py
(the routed-expert blocks), qk_norm.py (q/k RMSNorm), latent_attention.py (MLA).
"""
from __future__ import annotations

import dataclasses

from meshtrain.core.errors import UserError
from meshtrain.models import deepseek_v3, gemma3, llama, moe, qwen3, qwen3_moe
from meshtrain.models.base import LanguageModel, Transformer
from meshtrain.models.routed import MoELanguageModel
from meshtrain.models.spec import Family, ModelSpec

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, moe.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                                   gemma3.FAMILY, deepseek_v3.FAMILY)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise UserError(f"model.family={name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def with_family(spec: ModelSpec, name: str) -> ModelSpec:
    """`spec` as a spec of family `name`: the fields both have carried over, the new family's own
    at their defaults."""
    target = family(name).spec
    carried = {f.name: getattr(spec, f.name) for f in dataclasses.fields(target) if hasattr(spec, f.name)}
    return target(**{**carried, "family": name})


def make_spec(values: dict) -> ModelSpec:
    """The spec a record describes (a run's run.json or checkpoint metadata: a `model` mapping), with
    the keys its family has; keys of the earlier flat spec that the family lacks (a llama run's
    num_experts: 0) are left out."""
    target = family(values.get("family", "llama"))
    names = {f.name for f in dataclasses.fields(target.spec)}
    return target.spec(**{k: v for k, v in values.items() if k in names})


def declaring(key: str) -> list[Family]:
    """The families whose spec has the field `key`."""
    return [f for f in FAMILIES.values() if any(x.name == key for x in dataclasses.fields(f.spec))]


__all__ = ["FAMILIES", "Family", "LanguageModel", "ModelSpec", "MoELanguageModel", "Transformer", "declaring",
           "family", "make_spec", "with_family"]
