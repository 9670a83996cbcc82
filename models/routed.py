"""The blocks of the families with routed experts (moe, qwen3_moe, deepseek_v3): the spec fields
they share (`RoutedExperts`), the llama block with a mixture-of-experts MLP (`MoEBlock`: the routed
experts of models/experts.py `moe_mlp`, plus shared experts), the model protocol with the router's
losses, counts and dispatch buffer (`MoELanguageModel`), and aux-loss-free balancing's bias update
(`update_router_bias`). Each family module builds on these; none imports another family.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.core.bounds import setting
from meshtrain.core.errors import UserError
from meshtrain.models.base import PARAM_AXES, Block, LanguageModel, Transformer, _init
from meshtrain.models.experts import (
    EXPERT_AXES,
    EXPERT_LORA,
    capacity,
    dispatch_bytes,
    dropless_rows_per_token,
    moe_mlp,
)
from meshtrain.models.lora import init_adapter
from meshtrain.models.spec import ModelSpec


@dataclass
class RoutedExperts(ModelSpec):
    """The fields of a family with routed experts (moe, qwen3_moe): the planner and the checks read
    them wherever a spec has `num_experts`."""
    num_experts: int = setting(0, "routed SwiGLU experts per block; 0 = a dense MLP (the llama block)", min=0)
    experts_per_token: int = setting(2, "experts each token is routed to (top-k)", min=1)
    capacity_factor: float = setting(0.0, "slots per expert and sequence = factor x seq_len x experts_per_token / "
                                          "num_experts; assignments beyond them are dropped (and counted); "
                                          "0 = dropless", min=0.0, architecture=False)
    router_aux_loss: float = setting(0.01, "weight of the load-balancing loss (sequence-wise)", min=0.0,
                                     architecture=False)
    router_z_loss: float = setting(0.001, "weight of the router z-loss (mean squared logsumexp of the router "
                                          "logits)", min=0.0, architecture=False)
    router_bias_update_rate: float = setting(0.0, "aux-loss-free balancing: after each step each routed layer's "
                                                  "per-expert selection bias moves by this toward balance "
                                                  "(DeepSeek-V3: 0.001); 0 = off (moe, qwen3_moe: without the bias "
                                                  "parameter, so 0 and > 0 do not resume into each other)",
                                     min=0.0, architecture=False)

    def check(self) -> None:
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise UserError(f"model.experts_per_token={self.experts_per_token} exceeds model.num_experts="
                            f"{self.num_experts}; route each token to at most num_experts experts")

    def routed_experts(self) -> int:
        return self.num_experts

    def has_router_bias(self) -> bool:
        """Whether the routed blocks hold `router_bias` (deepseek_v3's always do; the others' when
        the bias update is on)."""
        return bool(self.num_experts and self.router_bias_update_rate)

    def trainable(self, path: tuple[str, ...]) -> bool:
        """The router bias is never the optimizer's: the step moves it (`update_router_bias`)."""
        return path[-1] != "router_bias" and super().trainable(path)


def update_router_bias(bias_NxE, load_NxE, assignments: int, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3 section 2.1.2; Wang et al. 2024): b_e += rate x
    sign(mean load - load_e) per routed layer, from `load_NxE` the shares of the step's
    `assignments` (tokens x k per layer, the whole global batch) each expert received. The counts
    are recovered exactly (round(share x assignments); exact while a layer's busiest expert has
    fewer than ~2^23 / (microbatches x data shards + 2) assignments) and compared in integers:
    sign(sum_e' count_e' - E x count_e). Returns the new bias and the counts [N, E] (int32)."""
    count_NxE = jnp.round(load_NxE * assignments).astype(jnp.int32)
    E = count_NxE.shape[-1]
    toward_NxE = jnp.sign(jnp.sum(count_NxE, axis=-1, keepdims=True) - E * count_NxE).astype(bias_NxE.dtype)
    return bias_NxE + jnp.asarray(rate, bias_NxE.dtype) * toward_NxE, count_NxE


MOE_PARAM_AXES = PARAM_AXES | {"router": ("embed", None), "router_bias": ("experts",)} | EXPERT_AXES


def _expert_init():
    """fan-in scaling per expert: [E, in, out] with E a batch axis."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2,
                                                batch_axis=0)


class MoEBlock(Block):
    """The llama block with a mixture-of-experts MLP (Mixtral; DeepSeek's shared experts): routed
    SwiGLU experts, plus `num_shared_experts` experts every token passes through (one dense SwiGLU
    of that many times the expert width). With num_experts = 0 it is the dense llama block."""
    expert_chunks = 1  # parallel.expert_chunks (`LanguageModel.block` sets it): the rows in slices (`by_chunks`)

    def init_mlp(self, cfg, rngs: nnx.Rngs):
        D, F, E, shared = cfg.d_model, cfg.mlp_dim, cfg.num_experts, cfg.shared_experts()
        if shared or not E:
            super().init_mlp(cfg, rngs, width=F * max(shared, 1))
        if E:
            self.router = nnx.Param(_init(0, 1)(rngs.params(), (D, E)))
            self.expert_gate = nnx.Param(_expert_init()(rngs.params(), (E, D, F)))
            self.expert_up = nnx.Param(_expert_init()(rngs.params(), (E, D, F)))
            self.expert_down = nnx.Param(_expert_init()(rngs.params(), (E, F, D)))
            if cfg.has_router_bias():  # a selection bias (`Router`), moved by the step (`update_router_bias`)
                self.router_bias = nnx.Param(jnp.zeros((E,), jnp.float32))

    def init_lora(self, cfg, rngs: nnx.Rngs, targets=None):
        """Ordinary adapters on the attention and on the dense SwiGLU (the shared experts, or the
        llama MLP without routed ones); one adapter per routed expert on each MLP target
        (`EXPERT_LORA`)."""
        targets = cfg.lora.targets if targets is None else targets
        dense = cfg.shared_experts() or not cfg.num_experts
        super().init_lora(cfg, rngs, [t for t in targets if dense or t not in EXPERT_LORA])
        for w in self.expert_adapters(cfg, targets):
            a, b = init_adapter(rngs.params(), getattr(self, w).shape, MOE_PARAM_AXES[w], cfg.lora.rank, w)
            setattr(self, f"lora_{w}_a", nnx.Param(a))
            setattr(self, f"lora_{w}_b", nnx.Param(b))

    @staticmethod
    def expert_adapters(cfg, targets=None) -> list[str]:
        """The routed expert weights that have adapters (of `targets`; default model.lora's)."""
        targets = cfg.lora.targets if targets is None else targets
        return [EXPERT_LORA[t] for t in targets if t in EXPERT_LORA] if cfg.lora.rank and cfg.num_experts else []

    def mlp(self, h_BxLxD):
        if not self.cfg.num_experts:
            return super().mlp(h_BxLxD)
        return self.moe(h_BxLxD, bias_E=self.router_bias[...] if self.cfg.has_router_bias() else None)

    def moe(self, h_BxLxD, **routing):
        """The routed experts (`moe_mlp`; `routing`: its router and bias_E) plus the shared ones.
        With the bias update on, the stats hold `expert_load` [E] too: each expert's share of this
        layer's assignments (scan_blocks keeps it per layer, PER_LAYER_STATS)."""
        cfg = self.cfg
        adapters = {f"lora_{w}_{part}": getattr(self, f"lora_{w}_{part}")[...]
                    for w in self.expert_adapters(cfg) for part in "ab"}
        out, stats = moe_mlp(h_BxLxD, self.router[...], self.expert_gate[...], self.expert_up[...],
                             self.expert_down[...], experts_per_token=cfg.experts_per_token,
                             capacity_factor=cfg.capacity_factor, einsum=self.einsum, adapters=adapters,
                             lora_scale=cfg.lora.scale if cfg.lora.rank else 1.0,
                             chunks=self.expert_chunks, **routing)
        if cfg.shared_experts():
            out = out + super().mlp(h_BxLxD)[0]
        out_stats = {"router_aux_loss": stats["aux_loss"], "router_z_loss": stats["z_loss"],
                     "dropped": stats["dropped"], "expert_load_max": stats["row_load_max"]}
        if cfg.router_bias_update_rate:
            out_stats["expert_load"] = stats["load"]
        return out, out_stats


class MoETransformer(Transformer):
    block_type = MoEBlock


class MoELanguageModel(LanguageModel):
    """The llama protocol with MoE blocks; the router's losses join the objective, weighted by
    model.router_aux_loss and model.router_z_loss."""

    module = MoETransformer
    param_axes = MOE_PARAM_AXES

    def decoding_spec(self):
        """Decoding routes dropless (capacity_factor 0): a token's experts never depend on the other
        tokens of its prefill or batch. Under capacity_factor > 0 the full forward (and training) may
        drop assignments, so cached decoding matches it only where nothing was dropped."""
        return dataclasses.replace(self.cfg, capacity_factor=0.0)

    def balanced_router_bias(self, bias_NxE, load_NxE, assignments: int):
        """Aux-loss-free balancing after a step: (the routed layers' `router_bias` moved toward balance,
        the counts [N, E]) by `update_router_bias` at model.router_bias_update_rate."""
        return update_router_bias(bias_NxE, load_NxE, assignments, self.cfg.router_bias_update_rate)

    def auxiliary_loss(self, stats):
        if not self.cfg.num_experts:
            return super().auxiliary_loss(stats)
        return self.cfg.router_aux_loss * stats["router_aux_loss"] + self.cfg.router_z_loss * stats["router_z_loss"]

    def active_matmul_params(self, params) -> int:
        """A token multiplies by its k routed experts only: N - (1 - k/E) x routed expert parameters."""
        total = super().active_matmul_params(params)
        if not self.cfg.num_experts:
            return total
        return total - self._routed_params(params) + self._routed_per_token(params)

    def fp8_matmul_params(self, params) -> int:
        """Less the router's (it routes in fp32), and under dropless routing (capacity_factor 0) the
        active routed experts' (bf16 grouped matmuls): neither takes the block's `matmul`."""
        fp8 = super().fp8_matmul_params(params)
        if not self.cfg.num_experts:
            return fp8
        fp8 -= params["blocks"]["router"].size
        if self.cfg.capacity_factor == 0:
            fp8 -= self._routed_per_token(params)
        return fp8

    def fp8_weight(self, name: str, leaf) -> bool:
        """Less the router (fp32) and, dropless, the routed experts and their adapters (bf16 grouped matmuls)."""
        routed = name.startswith(("expert_", "lora_expert_")) and self.cfg.capacity_factor == 0
        return super().fp8_weight(name, leaf) and name != "router" and not routed

    def slot_matmul_params(self, params, seq_len: int, expert_parallel: int = 1, in_fp8: bool = False,
                           rows_routed: bool = False) -> float:
        """Capacity routing runs each row's E x C slots through the experts, empty or not: C/L of the
        routed expert parameters per token, against N's k/E (fewer where C < k L / E drops).
        Dropless routing under expert parallelism (ep > 1) runs the grouped matmuls over the whole
        receive buffer (`dropless_local`: ep x min(k, E/ep) rows per token, filled or not; 1/8
        filled at qwen3_30b_a3b's pod when balanced): (ep x min(k, E/ep) - k)/E of the routed
        parameters more; bf16 grouped matmuls, so none `in_fp8`. (The grouped matmul's spare steps,
        at most E/ep - 1 tiles per matmul where a tile holds rows of two experts, are not counted.)
        `rows_routed`: the grouped matmuls run only the rows routed (the GPU's Triton kernels,
        meshtrain/ops/grouped_matmul.py `runs_rows_routed`): k per token, none more when balanced."""
        c = self.cfg
        if not c.num_experts:
            return 0.0
        if c.capacity_factor == 0:
            if rows_routed:
                return 0.0
            rows = dropless_rows_per_token(c.num_experts, c.experts_per_token, expert_parallel)
            return 0.0 if in_fp8 else self._routed_params(params) / c.num_experts * (rows - c.experts_per_token)
        slots = capacity(seq_len, c.num_experts, c.experts_per_token, c.capacity_factor)
        return self._routed_params(params) * slots / seq_len - self._routed_per_token(params)

    @property
    def routed_layers(self) -> int:
        return self.cfg.num_layers if self.cfg.num_experts else 0

    def dispatch_bytes(self, rows: float, seq_len: int, act_bytes: int, expert_parallel: int = 1) -> dict | None:
        """`dispatch_bytes` for this model's experts and width; None without routed experts."""
        c = self.cfg
        if not c.num_experts:
            return None
        return dispatch_bytes(rows, seq_len, c.num_experts, c.experts_per_token, c.capacity_factor, c.d_model,
                              act_bytes, expert_parallel)

    @staticmethod
    def _routed_params(params) -> int:
        return sum(params["blocks"][name].size for name in ("expert_gate", "expert_up", "expert_down"))

    def _routed_per_token(self, params) -> int:
        """The routed expert parameters a token multiplies by: k of the E experts' (exact: each expert
        tensor's leading axis is E)."""
        return self._routed_params(params) // self.cfg.num_experts * self.cfg.experts_per_token


def refuse_router_bias(m, form: str) -> None:
    """A selection bias (model.router_bias_update_rate > 0) has no place in `form`'s tensors."""
    if m.has_router_bias():
        raise UserError(f"model.router_bias_update_rate > 0: the router's selection bias has no {form} form, and "
                        f"exporting without it would route differently; export a run trained without it")
