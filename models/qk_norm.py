"""QK-norm (Qwen3 technical report, Yang et al. 2025; as in Dehghani et al. 2023): the llama block
with each query and key head RMS-normalized over its head_dim before the rotary embeddings, one
scale [K] per norm shared by all heads (`Qwen3Block`), those scales' logical axes and Hugging Face
tensor names, and the check of a Qwen3 config.json's sliding-window fields. The qwen3, qwen3_moe and
gemma3 families build on it.
"""
from __future__ import annotations

from meshtrain.models.base import Block
from meshtrain.models.hf_llama import LAYER
from meshtrain.models.spec import HFConfig

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


def refuse_windows(c: HFConfig) -> None:
    """Qwen3 configs carry a sliding_window size that only use_sliding_window turns on."""
    c.refuse(use_sliding_window=bool,
             layer_types=lambda types: any(t != "full_attention" for t in types or ()))
