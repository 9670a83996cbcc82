"""Mixture-of-experts SwiGLU MLP as pure functions, with optional expert parallelism.

Contract: `moe_mlp(x_BxLxD, router_DxE, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
experts_per_token, capacity_factor, axis="expert") -> (y_BxLxD, stats)`. The residual is the
caller's: y is the experts' contribution only, and a token whose assignments are all dropped gets 0.

- Routing (Mixtral, Jiang et al. 2024): fp32 softmax over the E router logits; each token goes to
  its top-k experts, weighted by those k probabilities renormalised to sum 1.
- Capacity (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): every sequence row is its
  own routing group, so what is dropped never depends on how the batch is sharded or split into
  microbatches. Each (row, expert) has C slots: C = L when capacity_factor == 0 (dropless: a token
  picks an expert at most once), else C = min(L, ceil(capacity_factor * L * k / E)). Assignments
  claim slots choice-major (every token's first choice in position order, then every second
  choice, ...); those beyond C are dropped.
- Dispatch and combine are a scatter of token ids into slots plus gathers by slot index, never a
  [B, L, E, C] one-hot mask. Expert matmuls run in x's dtype; the combine accumulates in fp32.
- Expert parallelism: when the active mesh has a compiler-managed axis `axis` of size ep > 1, the
  expert part runs in `jax.shard_map` over that axis only: the dispatch buffer [B, E, C, D] enters
  split on B (this device's rows), the expert weights split on E; an all_to_all sends each
  expert's slots to the device holding it, the local experts run, a second all_to_all returns the
  results. The router, top-k and combine stay outside, under the compiler's sharding. The
  shard_map makes `axis` the major factor of the rows, so a batch sharded with `axis` first among
  its axes enters and leaves without a reshuffle (any other order costs a collective-permute of
  the buffer each way). Raises UserError when E or B is not divisible by the axis size.

stats (fp32): `aux_loss` the sequence-wise balance loss (DeepSeek-V3, 2024; Switch's loss per
row), mean over rows of E * sum_e f_e * P_e, where f_e is the row's share of assignments routed to
e (before capacity) and P_e the row's mean router probability of e; `z_loss` the router z-loss
(ST-MoE, Zoph et al. 2022), mean over tokens of logsumexp(logits)^2; `dropped` the fraction of
assignments dropped; `load` [E] each expert's share of assignments before capacity;
`row_load_max` per row the busiest expert's share times E (1 when balanced), a mean over rows
(so, like every other statistic but `load`, the same however the batch is split).
Gradients reach the router (and x) through the gate weights, aux_loss and z_loss.

Names carry their shapes: B batch, L sequence, D width, E experts, F expert mlp width,
K experts per token, C capacity (slots per row and expert), S = E * C slots per row.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.sharding import constrain, manual_axes_rules, mesh_axis
from models.transformer import PARAM_AXES, Block, LanguageModel, Transformer, _init


def capacity(seq_len: int, num_experts: int, experts_per_token: int, capacity_factor: float) -> int:
    """Slots per (sequence row, expert): L when dropless (capacity_factor == 0)."""
    if capacity_factor == 0:
        return seq_len
    return min(seq_len, math.ceil(capacity_factor * seq_len * experts_per_token / num_experts))


def expert_parallel_size(axis: str) -> int:
    """Size of mesh axis `axis` if the active mesh has it and it is not manual already, else 1."""
    size, manual = mesh_axis(axis)
    return 1 if manual else size


def top_k(probs_BxLxE, k: int):
    """lax.top_k by k argmax passes: XLA's SPMD partitioner gathers a whole top_k operand onto
    every device (JAX 0.10, CPU), while argmax stays sharded over the batch. Ties go to the lower
    expert id, as in lax.top_k."""
    E = probs_BxLxE.shape[-1]
    values, ids = [], []
    for _ in range(k):
        id_BxL = jnp.argmax(probs_BxLxE, axis=-1)
        picked_BxLxE = jax.nn.one_hot(id_BxL, E, dtype=jnp.bool_)
        values.append(jnp.sum(jnp.where(picked_BxLxE, probs_BxLxE, 0.0), axis=-1))
        ids.append(id_BxL)
        probs_BxLxE = jnp.where(picked_BxLxE, -jnp.inf, probs_BxLxE)
    return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1).astype(jnp.int32)


def route(x_BxLxD, router_DxE, experts_per_token: int):
    """fp32 logits, probs, top-k expert ids and renormalised gate weights."""
    logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32),
                              router_DxE.astype(jnp.float32))
    probs_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
    top_BxLxK, expert_BxLxK = top_k(probs_BxLxE, experts_per_token)
    gate_BxLxK = top_BxLxK / jnp.sum(top_BxLxK, axis=-1, keepdims=True)
    return logits_BxLxE, probs_BxLxE, expert_BxLxK, gate_BxLxK


def slots(expert_BxKL, num_experts: int, cap: int):
    """Per assignment (choice-major within a row): its slot e * C + position, or S when dropped;
    also the per-row assignment counts [B, E] (before capacity)."""
    onehot_BxKLxE = jax.nn.one_hot(expert_BxKL, num_experts, dtype=jnp.int32)
    position_BxKL = jnp.sum((jnp.cumsum(onehot_BxKLxE, axis=1) - 1) * onehot_BxKLxE, axis=-1)
    kept_BxKL = position_BxKL < cap
    slot_BxKL = jnp.where(kept_BxKL, expert_BxKL * cap + position_BxKL, num_experts * cap)
    return slot_BxKL, kept_BxKL, jnp.sum(onehot_BxKLxE, axis=1)


def swiglu_experts(buf_BxNxExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Each expert's SwiGLU on its slots, in the buffer's dtype. N: the devices the slots came
    from (1 without expert parallelism)."""
    dtype = buf_BxNxExCxD.dtype
    gate = jnp.einsum("bnecd,edf->bnecf", buf_BxNxExCxD, w_gate_ExDxF.astype(dtype))
    up = jnp.einsum("bnecd,edf->bnecf", buf_BxNxExCxD, w_up_ExDxF.astype(dtype))
    h_BxNxExCxF = jax.nn.silu(checkpoint_name(gate, "mlp_gate")) * checkpoint_name(up, "mlp_up")
    h_BxNxExCxF = constrain(h_BxNxExCxF, ("batch", None, None, None, "mlp"))
    out = jnp.einsum("bnecf,efd->bnecd", h_BxNxExCxF, w_down_ExFxD.astype(dtype))
    return checkpoint_name(out, "mlp_out")


def exchange(buf_bxNxexCxD, axis: str):
    """all_to_all over `axis` on dim N: slice n goes to device n, and what device n sends lands
    at n. Inside a partial-manual shard_map XLA partitions an all_to_all by first gathering its
    compiler-managed dims (every data replica would then send the same slots); so the exchange
    alone runs with the rows also split, manually, over the other axes that divide them."""
    b = buf_bxNxexCxD.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    rows, n = [], 1
    for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types):
        if kind != jax.sharding.AxisType.Manual and size > 1 and b % (n * size) == 0:
            rows.append(name)
            n *= size
    swap = lambda t: jax.lax.all_to_all(t, axis, 1, 1, tiled=True)
    if not rows:
        return swap(buf_bxNxexCxD)
    spec = P(tuple(rows))
    return jax.shard_map(swap, in_specs=spec, out_specs=spec, axis_names=set(rows),
                         check_vma=False)(buf_bxNxexCxD)


def expert_parallel(buf_BxExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, axis: str, ep: int):
    """swiglu_experts with rows and experts split over `axis` (N = ep devices): each device sends
    its slots of expert chunk n to device n, runs its E/N experts on the slots of all N devices,
    and sends the results back."""

    def local(buf_bxExCxD, w_gate_exDxF, w_up_exDxF, w_down_exFxD):
        b, E, C, D = buf_bxExCxD.shape
        with manual_axes_rules({axis}):
            buf_bxNxexCxD = exchange(buf_bxExCxD.reshape(b, ep, E // ep, C, D), axis)
            out_bxNxexCxD = swiglu_experts(buf_bxNxexCxD, w_gate_exDxF, w_up_exDxF, w_down_exFxD)
            return exchange(out_bxNxexCxD, axis).reshape(b, E, C, D)

    spec = P(axis)
    return jax.shard_map(local, in_specs=(spec,) * 4, out_specs=spec, axis_names={axis},
                         check_vma=False)(buf_BxExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)


def moe_mlp(x_BxLxD, router_DxE, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
            experts_per_token: int, capacity_factor: float, axis: str = "expert"):
    """The experts' output [B, L, D] in x's dtype and the routing stats (see the module doc)."""
    B, L, D = x_BxLxD.shape
    E, K = router_DxE.shape[1], experts_per_token
    C = capacity(L, E, K, capacity_factor)
    ep = expert_parallel_size(axis)
    if E % ep:
        raise UserError(f"model.num_experts={E} is not divisible by the '{axis}' mesh axis ({ep}); "
                        f"use a multiple of {ep} experts or a smaller '{axis}' axis")
    if B % ep:
        raise UserError(f"{B} batch rows per step (or microbatch) are not divisible by the "
                        f"'{axis}' mesh axis ({ep}); use a batch size that is a multiple of it")

    logits_BxLxE, probs_BxLxE, expert_BxLxK, gate_BxLxK = route(x_BxLxD, router_DxE, K)
    expert_BxKL = expert_BxLxK.swapaxes(1, 2).reshape(B, K * L)  # choice-major
    slot_BxKL, kept_BxKL, count_BxE = slots(expert_BxKL, E, C)
    token_BxKL = jnp.broadcast_to(jnp.tile(jnp.arange(L), K), (B, K * L))

    # Dispatch: the token id of every slot (L where empty), then gather the rows of x.
    token_of_slot_BxS = jax.vmap(lambda s, t: jnp.full((E * C,), L).at[s].set(t, mode="drop"))(
        slot_BxKL, token_BxKL)
    buf_BxSxD = jax.vmap(lambda x, t: jnp.take(x, t, axis=0, mode="fill", fill_value=0))(
        x_BxLxD, token_of_slot_BxS)
    buf_BxExCxD = buf_BxSxD.reshape(B, E, C, D)

    weights = (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    if ep > 1:
        out_BxExCxD = expert_parallel(buf_BxExCxD, *weights, axis, ep)
    else:
        out_BxExCxD = swiglu_experts(buf_BxExCxD[:, None], *weights)[:, 0]

    # Combine: each assignment reads its slot (0 when dropped), weighted by its gate, in fp32.
    out_BxKLxD = jax.vmap(lambda o, s: jnp.take(o, s, axis=0, mode="fill", fill_value=0))(
        out_BxExCxD.reshape(B, E * C, D), slot_BxKL)
    gate_BxKxL = gate_BxLxK.swapaxes(1, 2)
    y_BxLxD = jnp.einsum("bkld,bkl->bld", out_BxKLxD.reshape(B, K, L, D).astype(jnp.float32),
                         gate_BxKxL)
    y_BxLxD = constrain(y_BxLxD.astype(x_BxLxD.dtype), ("batch", "seq", "embed"))

    count_BxE = jax.lax.stop_gradient(count_BxE.astype(jnp.float32))
    f_BxE = count_BxE / (L * K)
    stats = {
        "aux_loss": jnp.mean(E * jnp.sum(f_BxE * jnp.mean(probs_BxLxE, axis=1), axis=-1)),
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxE, axis=-1))),
        "dropped": jnp.mean((~kept_BxKL).astype(jnp.float32)),
        "load": jnp.sum(count_BxE, axis=0) / (B * L * K),
        # per row, the busiest expert's share over the mean share (1: balanced), averaged over rows
        "row_load_max": jnp.mean(E * jnp.max(f_BxE, axis=-1)),
    }
    return y_BxLxD, stats


# ---- the `moe` family: the llama decoder with this MLP in every block ----

MOE_PARAM_AXES = {**PARAM_AXES, "router": ("embed", None), "expert_gate": ("experts", "embed", "mlp"),
                  "expert_up": ("experts", "embed", "mlp"), "expert_down": ("experts", "mlp", "embed")}


def _expert_init():
    """fan-in scaling per expert: [E, in, out] with E a batch axis."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2,
                                                batch_axis=0)


class MoEBlock(Block):
    """The llama block with a mixture-of-experts MLP (Mixtral; DeepSeek's shared experts): routed
    SwiGLU experts, plus `num_shared_experts` experts every token passes through (one dense SwiGLU
    of that many times the expert width). With num_experts = 0 it is the dense llama block."""

    def init_mlp(self, cfg, rngs: nnx.Rngs):
        D, F, E = cfg.d_model, cfg.mlp_dim, cfg.num_experts
        if cfg.num_shared_experts or not E:
            super().init_mlp(cfg, rngs, width=F * max(cfg.num_shared_experts, 1))
        if E:
            self.router = nnx.Param(_init(0, 1)(rngs.params(), (D, E)))
            self.expert_gate = nnx.Param(_expert_init()(rngs.params(), (E, D, F)))
            self.expert_up = nnx.Param(_expert_init()(rngs.params(), (E, D, F)))
            self.expert_down = nnx.Param(_expert_init()(rngs.params(), (E, F, D)))

    def mlp(self, h_BxLxD):
        cfg = self.cfg
        if not cfg.num_experts:
            return super().mlp(h_BxLxD)
        out, stats = moe_mlp(h_BxLxD, self.router[...], self.expert_gate[...], self.expert_up[...],
                             self.expert_down[...], experts_per_token=cfg.experts_per_token,
                             capacity_factor=cfg.capacity_factor)
        if cfg.num_shared_experts:
            out = out + super().mlp(h_BxLxD)[0]
        return out, {"router_aux_loss": stats["aux_loss"], "router_z_loss": stats["z_loss"],
                     "dropped": stats["dropped"],
                     "expert_load_max": stats["row_load_max"]}


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

    def auxiliary_loss(self, stats):
        if not self.cfg.num_experts:
            return super().auxiliary_loss(stats)
        return self.cfg.router_aux_loss * stats["router_aux_loss"] + self.cfg.router_z_loss * stats["router_z_loss"]

    def active_matmul_params(self, params) -> int:
        """A token multiplies by its k routed experts only: N - (1 - k/E) x routed expert parameters."""
        total = super().active_matmul_params(params)
        if not self.cfg.num_experts:
            return total
        routed = sum(params["blocks"][name].size for name in ("expert_gate", "expert_up", "expert_down"))
        return int(total - routed * (1 - self.cfg.experts_per_token / self.cfg.num_experts))
