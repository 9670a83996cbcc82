"""The `qwen3_moe` family: qwen3's attention (per-head q/k RMSNorm, models/qk_norm.py) with routed
SwiGLU experts in every block (models/experts.py `moe_mlp`): no shared experts, top-k of the softmax
router renormalized to sum 1 (Hugging Face's norm_topk_prob=True, Qwen3-30B-A3B and Qwen3-235B-A22B).
Hugging Face form: `Qwen3MoeForCausalLM` (model_type qwen3_moe); configs with dense layers
(mlp_only_layers, decoder_sparse_step != 1) or unnormalized top-k are refused.

Architecture fields: the shared ones with mlp_dim the width of one expert (moe_intermediate_size),
and the routed-expert fields (models/routed.py `RoutedExperts`).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshtrain.core.errors import UserError
from meshtrain.models.base import Transformer
from meshtrain.models.hf_llama import LAYER, LLAMA_TENSORS, read_llama_config, write_llama_config
from meshtrain.models.qk_norm import QK_NORM_AXES, QK_NORM_TENSORS, Qwen3Block, refuse_windows
from meshtrain.models.routed import MOE_PARAM_AXES, MoEBlock, MoELanguageModel, RoutedExperts, refuse_router_bias
from meshtrain.models.spec import Family, HFConfig, HFMap, family_setting


@dataclass
class Qwen3MoESpec(RoutedExperts):
    family: str = family_setting("qwen3_moe")

    def check(self) -> None:
        super().check()
        if not self.num_experts:
            raise UserError("model.num_experts=0: every qwen3_moe block routes to experts; set model.num_experts "
                            "(Qwen3-30B-A3B: 128), or model.family=qwen3 for a dense model")


class Qwen3MoEBlock(Qwen3Block, MoEBlock):
    """q/k-normalized attention (Qwen3Block), the mixture-of-experts MLP (MoEBlock)."""


class Qwen3MoETransformer(Transformer):
    block_type = Qwen3MoEBlock


class Qwen3MoELanguageModel(MoELanguageModel):
    module = Qwen3MoETransformer
    param_axes = {**MOE_PARAM_AXES, **QK_NORM_AXES}


EXPERT = LAYER + "mlp.experts.{j}."
DENSE_MLP = {("blocks", "w_gate"), ("blocks", "w_up"), ("blocks", "w_down")}
TENSORS = {**{path: name for path, name in LLAMA_TENSORS.items() if path not in DENSE_MLP}, **QK_NORM_TENSORS,
           ("blocks", "router"): (LAYER + "mlp.gate.weight", True),
           ("blocks", "expert_gate"): (EXPERT + "gate_proj.weight", True),
           ("blocks", "expert_up"): (EXPERT + "up_proj.weight", True),
           ("blocks", "expert_down"): (EXPERT + "down_proj.weight", True)}


def read_qwen3_moe(c: HFConfig) -> Qwen3MoESpec:
    """Hugging Face routes dropless (capacity_factor 0), with no z-loss; its aux loss weight is
    router_aux_loss_coef."""
    refuse_windows(c)
    c.refuse(mlp_only_layers=bool, decoder_sparse_step=lambda v: v != 1, norm_topk_prob=lambda v: not v)
    experts = c["num_experts"] if "num_experts" in c else c.need("num_local_experts")  # hub files, transformers 5
    return read_llama_config(c, Qwen3MoESpec, mlp_dim=c.need("moe_intermediate_size"), num_experts=experts,
                             experts_per_token=c.need("num_experts_per_tok"), capacity_factor=0.0, router_z_loss=0.0,
                             router_aux_loss=float(c.get("router_aux_loss_coef", 0.001)))


def write_qwen3_moe(m: Qwen3MoESpec) -> dict:
    refuse_router_bias(m, "Qwen3-MoE")
    config = write_llama_config(m, "qwen3_moe", "Qwen3MoeForCausalLM")
    del config["mlp_bias"]
    return {**config, "moe_intermediate_size": m.mlp_dim, "num_experts": m.num_experts,
            "num_experts_per_tok": m.experts_per_token, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "router_aux_loss_coef": m.router_aux_loss, "use_sliding_window": False,
            "sliding_window": None}


FAMILY = Family("qwen3_moe", "qwen3 attention with routed experts in every block (Qwen3-MoE): no shared experts, "
                             "renormalized top-k", Qwen3MoESpec, Qwen3MoELanguageModel,
                HFMap(("qwen3_moe",), TENSORS, read_qwen3_moe, write_qwen3_moe))
