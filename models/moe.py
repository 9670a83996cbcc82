"""The `moe` family: the llama decoder with a mixture-of-experts MLP in every block (Mixtral, Jiang
et al. 2024; DeepSeek's shared experts as `num_shared_experts`): top-k routing, capacity or dropless
(models/experts.py), the blocks and protocol of models/routed.py. Hugging Face form:
`MixtralForCausalLM` (model_type mixtral); a moe model without experts is a Llama.

Architecture fields: the shared ones with mlp_dim the width of one expert, the routed-expert fields
(models/routed.py `RoutedExperts`) and `num_shared_experts`.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshtrain.core.bounds import setting
from meshtrain.core.errors import UserError
from meshtrain.models.hf_llama import LAYER, LLAMA_TENSORS, read_llama_config, write_llama_config
from meshtrain.models.routed import MoELanguageModel, RoutedExperts, refuse_router_bias
from meshtrain.models.spec import Family, HFConfig, HFMap, family_setting


@dataclass
class MoESpec(RoutedExperts):
    family: str = family_setting("moe")
    num_shared_experts: int = setting(0, "experts every token passes through besides its routed ones (DeepSeek)",
                                      min=0)

    def shared_experts(self) -> int:
        return self.num_shared_experts


# ---- its Hugging Face form: MixtralForCausalLM (a moe model without experts is a Llama) ----

EXPERT = LAYER + "block_sparse_moe.experts.{j}."
MIXTRAL_TENSORS = {
    **LLAMA_TENSORS,
    ("blocks", "router"): (LAYER + "block_sparse_moe.gate.weight", True),
    ("blocks", "expert_gate"): (EXPERT + "w1.weight", True),
    ("blocks", "expert_down"): (EXPERT + "w2.weight", True),
    ("blocks", "expert_up"): (EXPERT + "w3.weight", True),
}


def read_mixtral(c: HFConfig) -> MoESpec:
    """Hugging Face routes dropless (capacity_factor 0), with no z-loss."""
    c.refuse(sliding_window=lambda v: v is not None)
    return read_llama_config(c, MoESpec, num_experts=c.need("num_local_experts"),
                             experts_per_token=c.need("num_experts_per_tok"), capacity_factor=0.0, router_z_loss=0.0,
                             router_aux_loss=float(c.get("router_aux_loss_coef", 0.001)))  # MixtralConfig's default


def write_mixtral(m: MoESpec) -> dict:
    refuse_router_bias(m, "Mixtral")
    if m.num_shared_experts:
        raise UserError("model.num_shared_experts > 0 has no Mixtral form (DeepSeek's layout); export is for "
                        "llama and Mixtral-style moe models")
    if not m.num_experts:
        return write_llama_config(m)
    config = write_llama_config(m, "mixtral", "MixtralForCausalLM")
    del config["mlp_bias"]
    return {**config, "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
            "router_aux_loss_coef": m.router_aux_loss, "sliding_window": None}


FAMILY = Family("moe", "mixture-of-experts MLPs (Mixtral; DeepSeek's shared experts): top-k routing, "
                       "capacity or dropless", MoESpec, MoELanguageModel,
                HFMap(("mixtral",), MIXTRAL_TENSORS, read_mixtral, write_mixtral))
