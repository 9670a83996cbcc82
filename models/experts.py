"""Mixture-of-experts SwiGLU MLP as pure functions, with optional expert parallelism.

Contract: `moe_mlp(x_BxLxD, router_DxE, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
experts_per_token, capacity_factor, axis="expert") -> (y_BxLxD, stats)`. The residual is the
caller's: y is the experts' contribution only, and a token whose assignments are all dropped gets 0.

- Routing (Mixtral, Jiang et al. 2024): fp32 softmax over the E router logits; each token goes to
  its top-k experts, weighted by those k probabilities renormalised to sum 1.
- Capacity routing (capacity_factor > 0; GShard, Lepikhin et al. 2020; Switch, Fedus et al.
  2021): every sequence row is its own routing group, so what is dropped never depends on how the
  batch is sharded or split into microbatches. Each (row, expert) has
  C = min(L, ceil(capacity_factor * L * k / E)) slots. Assignments claim slots choice-major (every
  token's first choice in position order, then every second choice, ...); those beyond C are
  dropped. Dispatch and combine are a scatter of token ids into slots plus gathers by slot index,
  never a [B, L, E, C] one-hot mask: the buffer is [B, E, C, D].
- Dropless (capacity_factor == 0, as Mixtral; also what decoding uses): nothing is dropped, and
  the dispatch memory is proportional to tokens x k, not tokens x E: each device sorts its rows'
  B*L*K assignments by expert (stable), gathers their rows of x into a [B*L*K, D] buffer, runs the
  SwiGLU experts as grouped matmuls (`grouped_matmul`: a loop over (tile, expert) steps, O(rows x
  width) memory, since XLA expands jax.lax.ragged_dot densely into [E, rows, width], on CPU in JAX
  0.10 and on an H100 in JAX 0.11.2) and unsorts. This runs in a shard_map manual over the batch's
  mesh axes (`row_axes`), so the sort never spans devices. Where the rules split the experts' width
  F (`mlp`: tensor), that shard_map is manual over those axes too (`width_axes`): each device runs
  its F slice (partial sums of the down projection), combines them with the gates, and the sum over
  the F shards runs once on [B, L, D], as Megatron's MLP all-reduce (and once backward on x's
  cotangent, plus the gates' fp32 [B, L, K]). Left to the compiler it ran inside the grouped
  matmuls' loops, every (tile, expert) step: on fsdp=2,tensor=2 qwen3_moe_tiny read 11.2x the
  all-reduce formula, deepseek_v3_tiny 8.0x (XLA:CPU).
- Expert matmuls run in x's dtype; the combine (each assignment's output times its gate) is fp32.
- LoRA (`adapters`): each routed expert has its own adapter on gate, up and down, A [E, in, r] and
  B [E, r, out], run by the same grouped matmuls (or slot einsums) as the expert weights
  (`projection`), so routing and dropless exactness are unchanged.
- Expert parallelism: when the active mesh has a compiler-managed axis `axis` of size ep > 1, each
  device holds E/ep experts. Both routings run in one shard_map manual over the batch's mesh axes
  (`in_row_shards`; `axis` first, the batch's major factor under the default rules, so the rows
  enter without a reshuffle): each device routes its own rows and an all_to_all over `axis` sends
  device n what its E/ep experts need, they run, and a second all_to_all returns the results.
  Capacity: the [b, E, C, D] slot buffer, expert chunk n to device n. Dropless: a device sends
  device n its assignments of n's experts, sorted by expert, in a worst-case buffer of
  b*L*min(K, E/ep) rows per destination (a token picks at most min(K, E/ep) of n's experts;
  all_to_all needs static shapes), and the counts per expert; device n runs its experts on what it
  received as it arrived, a run per sender each sorted by expert (the grouped matmul's `runs`: no
  sort, no [ep*A, D] gather), and sends the results back. On GPUs both exchanges move only the
  rows routed (meshtrain/ops/block_exchange.py: ragged all-to-alls from and into the sender's b*L*K
  assignments sorted by expert, no worst-case send buffer; elsewhere the whole blocks): K of a
  token's ep*min(K, E/ep) rows when balanced, 1/8 at qwen3_30b_a3b's pod; the receive buffer stays
  worst-case sized. Per device [ep, b*L*min(K, E/ep), D],
  against [b, E, L, D] for E slots of L: ep*min(K, E/ep)/E of it, so the same at E/ep = 1,
  K/(E/ep) of it at E/ep >= K (`dispatch_bytes`). The router, top-k and combine stay outside,
  under the compiler's sharding. Raises UserError when E or B is not divisible by the axis size.

stats (fp32): `aux_loss` the sequence-wise balance loss (DeepSeek-V3, 2024; Switch's loss per
row), mean over rows of E * sum_e f_e * P_e, where f_e is the row's share of assignments routed to
e (before capacity) and P_e the row's mean router probability of e; `z_loss` the router z-loss
(ST-MoE, Zoph et al. 2022), mean over tokens of logsumexp(logits)^2; `dropped` the fraction of
assignments dropped; `load` [E] each expert's share of assignments before capacity;
`row_load_max` per row the busiest expert's share times E (1 when balanced), a mean over rows
(so, like every other statistic but `load`, the same however the batch is split).
Gradients reach the router (and x) through the gate weights, aux_loss and z_loss.

Names carry their shapes: B batch, L sequence, D width, E experts, F expert mlp width,
K experts per token, C capacity (slots per row and expert), S = E * C slots per row; in the
dropless path N = b*K*L this device's assignments, M rows of a grouped matmul, G its groups,
A = b*L*min(K, E/ep) rows sent to each expert-parallel device, e = E/ep local experts.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from meshtrain.core.errors import UserError
from meshtrain.models.lora import adapter_axes
from meshtrain.ops.block_exchange import collect, dispatch
from meshtrain.ops.grouped_matmul import grouped_matmul
from meshtrain.parallel.sharding import constrain, manual_axes_rules, mesh_axis, rule_axes

# The routed experts' weights [E, in, out] and their LoRA adapters (one per expert, `lora_expert_<w>_a`
# [E, in, r] and `_b` [E, r, out], split over `expert` as the experts) by parameter name; a MLP target
# of model.lora adapts its expert projection (`EXPERT_LORA`).
EXPERT_LORA = {"gate": "expert_gate", "up": "expert_up", "down": "expert_down"}
EXPERT_WEIGHT_AXES = {"expert_gate": ("experts", "embed", "mlp"), "expert_up": ("experts", "embed", "mlp"),
                      "expert_down": ("experts", "mlp", "embed")}
EXPERT_AXES = EXPERT_WEIGHT_AXES | adapter_axes(EXPERT_WEIGHT_AXES)


def capacity(seq_len: int, num_experts: int, experts_per_token: int, capacity_factor: float) -> int:
    """Slots per (sequence row, expert): L when dropless (capacity_factor == 0)."""
    if capacity_factor == 0:
        return seq_len
    return min(seq_len, math.ceil(capacity_factor * seq_len * experts_per_token / num_experts))


def dispatch_bytes(rows: float, seq_len: int, num_experts: int, experts_per_token: int, capacity_factor: float,
                   width: int, act_bytes: int, expert_axis: int = 1) -> dict:
    """One MoE layer's dispatch buffer per device, `rows` sequence rows held: capacity routing's
    slots rows x E x C x D; dropless, the sorted assignments rows x L x K x D, or under expert
    parallelism (N = expert_axis) the per-destination worst case N x rows x L x min(K, E/N) x D.
    `slot_buffer_bytes`: the dropless E-slot buffer rows x E x L x D (C = L) that sorting replaced;
    `routed_share`: the share of the buffer's rows a balanced routing fills, K of the N x min(K, E/N)
    a token may send dropless (what a ragged all-to-all moves: meshtrain/ops/block_exchange.py), 1
    for capacity routing (every slot travels, filled or not)."""
    L, E, K = seq_len, num_experts, experts_per_token
    slot_buffer = rows * E * L * width * act_bytes
    if capacity_factor:
        C = capacity(L, E, K, capacity_factor)
        return {"bytes": rows * E * C * width * act_bytes, "capacity": C, "slot_buffer_bytes": slot_buffer,
                "routed_share": 1.0}
    sent = dropless_rows_per_token(E, K, expert_axis)
    return {"bytes": rows * L * sent * width * act_bytes, "capacity": 0, "slot_buffer_bytes": slot_buffer,
            "routed_share": K / sent}


def dropless_rows_per_token(num_experts: int, experts_per_token: int, expert_axis: int = 1) -> int:
    """Rows per token of a dropless layer's buffer on a device: its K assignments without expert
    parallelism; under it (N = expert_axis) the worst case ep x min(K, E/N) that all_to_all's static
    shapes need (`dropless_local`), filled or not (K of them when the routing is balanced)."""
    return expert_axis * min(experts_per_token, num_experts // expert_axis)


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


@dataclass(frozen=True)
class Router:
    """How tokens pick experts. Mixtral's (the default): softmax scores, top-k, gates renormalised to
    sum 1. DeepSeek-V3's (Liu et al. 2024, section 2.1.2): `score="sigmoid"`; a per-expert bias
    (`moe_mlp`'s `bias_E`, aux-loss-free balancing) added to the scores for the choice only, never
    to the gates and outside the gradient; `groups` > 1: the experts split into that many groups,
    a group's score the sum of its two best, and only the `topk_groups` best groups chosen from;
    `normalize`: gates renormalised over the k chosen (else the scores themselves); then x `scale`
    (routed_scaling_factor)."""
    score: str = "softmax"
    groups: int = 1
    topk_groups: int = 1
    normalize: bool = True
    scale: float = 1.0


def route(x_BxLxD, router_DxE, experts_per_token: int, router: Router = Router(), bias_E=None):
    """fp32 logits, probs (the scores; sigmoid ones normalised to sum 1 per token, for the balance
    statistics), top-k expert ids and gate weights (`Router`)."""
    logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32),
                              router_DxE.astype(jnp.float32))
    softmax = router.score == "softmax"
    scores_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1) if softmax else jax.nn.sigmoid(logits_BxLxE)
    if softmax and bias_E is None and router.groups == 1:
        top_BxLxK, expert_BxLxK = top_k(scores_BxLxE, experts_per_token)
    else:
        choice_BxLxE = scores_BxLxE if bias_E is None else scores_BxLxE + jax.lax.stop_gradient(
            bias_E.astype(jnp.float32))
        if router.groups > 1:
            E, G = choice_BxLxE.shape[-1], router.groups
            group_BxLxG = jnp.sum(top_k(choice_BxLxE.reshape(*choice_BxLxE.shape[:-1], G, E // G), 2)[0], axis=-1)
            best_BxLxT = top_k(group_BxLxG, router.topk_groups)[1]
            kept_BxLxG = jnp.any(jax.nn.one_hot(best_BxLxT, G, dtype=jnp.bool_), axis=-2)
            choice_BxLxE = jnp.where(jnp.repeat(kept_BxLxG, E // G, axis=-1), choice_BxLxE, -jnp.inf)
        expert_BxLxK = top_k(choice_BxLxE, experts_per_token)[1]
        top_BxLxK = jnp.take_along_axis(scores_BxLxE, expert_BxLxK, axis=-1)
    if router.normalize:  # transformers' DeepSeek denominator adds 1e-20
        top_BxLxK = top_BxLxK / (jnp.sum(top_BxLxK, axis=-1, keepdims=True) + (0.0 if softmax else 1e-20))
    if not softmax:  # DeepSeek's balance statistics normalise the sigmoid scores (V3 report, eq. 18)
        scores_BxLxE = scores_BxLxE / jnp.sum(scores_BxLxE, axis=-1, keepdims=True)
    return logits_BxLxE, scores_BxLxE, expert_BxLxK, top_BxLxK * router.scale if router.scale != 1 else top_BxLxK


def slots(expert_BxKL, num_experts: int, cap: int):
    """Per assignment (choice-major within a row): its slot e * C + position, or S when dropped;
    also the per-row assignment counts [B, E] (before capacity)."""
    onehot_BxKLxE = jax.nn.one_hot(expert_BxKL, num_experts, dtype=jnp.int32)
    position_BxKL = jnp.sum((jnp.cumsum(onehot_BxKLxE, axis=1) - 1) * onehot_BxKLxE, axis=-1)
    kept_BxKL = position_BxKL < cap
    slot_BxKL = jnp.where(kept_BxKL, expert_BxKL * cap + position_BxKL, num_experts * cap)
    return slot_BxKL, kept_BxKL, jnp.sum(onehot_BxKLxE, axis=1)


def projection(matmul, x, experts: dict, name: str, lora_scale: float):
    """x through each row's expert of the projection `name` (expert_gate, expert_up, expert_down)
    by `matmul(x, w_ExIxO)`, plus that expert's LoRA adapter (`with_adapter`)."""
    return with_adapter(matmul(x, experts[name]), matmul, x, experts, name, lora_scale)


def with_adapter(y, matmul, x, experts: dict, name: str, lora_scale: float):
    """y = x W_e (the projection `name`) plus expert e's LoRA adapter where `experts` holds one:
    x W_e + (alpha / rank) (x A_e) B_e (models/lora.py), through the same matmul."""
    if f"lora_{name}_a" not in experts:
        return y
    x_a = matmul(x, experts[f"lora_{name}_a"])
    return y + (lora_scale * matmul(x_a, experts[f"lora_{name}_b"])).astype(y.dtype)


def gate_and_up(matmul, x_MxD, experts: dict, lora_scale: float):
    """The gate and up projections (`projection`) as one grouped matmul of both weights, their columns
    interleaved ([G, D, F, 2] -> [G, D, 2F]: a device's share of F holds both halves of its columns),
    so that the backward's dx is one kernel's sum, not two worst-case buffers added (Qwen3-30B-A3B on
    expert=8: bf16[262144, 2048] a microbatch and layer)."""
    w_GxDxFx2 = jnp.stack([experts["expert_gate"], experts["expert_up"]], axis=-1)
    G, D, F, _ = w_GxDxFx2.shape
    both_MxFx2 = matmul(x_MxD, w_GxDxFx2.reshape(G, D, 2 * F)).reshape(x_MxD.shape[0], F, 2)
    return (with_adapter(both_MxFx2[..., 0], matmul, x_MxD, experts, "expert_gate", lora_scale),
            with_adapter(both_MxFx2[..., 1], matmul, x_MxD, experts, "expert_up", lora_scale))


def swiglu_experts(buf_BxNxExCxD, experts: dict, einsum=jnp.einsum, lora_scale: float = 1.0):
    """Each expert's SwiGLU on its slots, in the buffer's dtype. N: the devices the slots came
    from (1 without expert parallelism); `experts`: expert_gate, expert_up [E, D, F], expert_down
    [E, F, D] and their adapters (`projection`); `einsum`: the block's matmul
    (a recipe's, meshtrain/ops/recipes.py, whose scales are then this device's: it runs inside the row
    shard_map)."""
    dtype = buf_BxNxExCxD.dtype
    matmul = lambda x, w_ExIxO: einsum("bneci,eio->bneco", x, w_ExIxO.astype(dtype))
    gate = projection(matmul, buf_BxNxExCxD, experts, "expert_gate", lora_scale)
    up = projection(matmul, buf_BxNxExCxD, experts, "expert_up", lora_scale)
    h_BxNxExCxF = jax.nn.silu(checkpoint_name(gate, "mlp_gate")) * checkpoint_name(up, "mlp_up")
    h_BxNxExCxF = constrain(h_BxNxExCxF, ("batch", None, None, None, "mlp"))
    return checkpoint_name(projection(matmul, h_BxNxExCxF, experts, "expert_down", lora_scale), "mlp_out")


def capacity_local(x_bxLxD, expert_bxKL, experts: dict, *, C: int, axis: str, ep: int, einsum=jnp.einsum,
                   lora_scale: float = 1.0):
    """Capacity routing of this device's rows: the [b, E, C, D] slot buffer through the experts;
    per assignment its output (0 when dropped) [b, K*L, D], whether it was kept, and the per-row
    counts [b, E]. ep > 1 (inside a shard_map manual over `axis`): each device sends its slots of
    expert chunk n to device n (an all_to_all on dim N), runs its E/ep experts on the slots of all
    ep devices, and sends the results back. `experts` (this device's e = E/ep), `einsum`,
    `lora_scale`: as `swiglu_experts`."""
    b, L, D = x_bxLxD.shape
    e, KL = experts["expert_gate"].shape[0], expert_bxKL.shape[1]
    E = e * ep
    slot_bxKL, kept_bxKL, count_bxE = slots(expert_bxKL, E, C)
    token_bxKL = jnp.broadcast_to(jnp.tile(jnp.arange(L), KL // L), (b, KL))

    # Dispatch: the token id of every slot (L where empty), then gather the rows of x.
    token_of_slot_bxS = jax.vmap(lambda s, t: jnp.full((E * C,), L).at[s].set(t, mode="drop"))(
        slot_bxKL, token_bxKL)
    buf_bxSxD = jax.vmap(lambda x, t: jnp.take(x, t, axis=0, mode="fill", fill_value=0))(
        x_bxLxD, token_of_slot_bxS)
    buf_bxNxexCxD = buf_bxSxD.reshape(b, ep, e, C, D)
    swap = lambda t: jax.lax.all_to_all(t, axis, 1, 1, tiled=True) if ep > 1 else t
    out_bxNxexCxD = swap(swiglu_experts(swap(buf_bxNxexCxD), experts, einsum, lora_scale))
    out_bxKLxD = jax.vmap(lambda o, s: jnp.take(o, s, axis=0, mode="fill", fill_value=0))(
        out_bxNxexCxD.reshape(b, E * C, D), slot_bxKL)
    return out_bxKLxD, kept_bxKL, count_bxE


# ---- dropless: assignments sorted by expert, the experts as a grouped matmul (meshtrain/ops/grouped_matmul.py) ----

def grouped_swiglu(xs_MxD, gs_M, experts: dict, lora_scale: float = 1.0, rows: int | None = None,
                   runs: int = 1):
    """The expert SwiGLU of rows sorted by group (or `runs` runs each sorted, grouped_matmul's group
    ids): a grouped matmul for the gate and up projections together (`gate_and_up`), one for down, and
    two per adapter (`projection`). Padding rows' results are
    unspecified (`grouped_matmul`): no caller reads them.
    In x's dtype. `experts`: the G experts' weights, as `swiglu_experts`. `rows`: how many are
    expected to have a group (grouped_matmul's; None: all)."""
    dtype = xs_MxD.dtype
    matmul = lambda x_MxI, w_GxIxO: grouped_matmul(x_MxI, w_GxIxO.astype(dtype), gs_M, rows, "auto", runs)
    gate, up = gate_and_up(matmul, xs_MxD, experts, lora_scale)
    h_MxF = jax.nn.silu(checkpoint_name(gate, "mlp_gate")) * checkpoint_name(up, "mlp_up")
    h_MxF = constrain(h_MxF, (None, "mlp"))
    return checkpoint_name(projection(matmul, h_MxF, experts, "expert_down", lora_scale), "mlp_out")


def sorted_swiglu(x_MxD, group_M, experts: dict, lora_scale: float = 1.0):
    """Each row's expert SwiGLU, rows in any order: sorted by group (stable), `grouped_swiglu`,
    unsorted. Rows with group >= G: unspecified."""
    order_M = jnp.argsort(group_M, stable=True)
    return unsort(grouped_swiglu(x_MxD[order_M], group_M[order_M], experts, lora_scale), order_M)


def unsort(sorted_MxD, order_M):
    """Rows back in their order before `order_M` (an argsort) sorted them."""
    return sorted_MxD[jnp.zeros_like(order_M).at[order_M].set(jnp.arange(order_M.shape[0]))]


def dropless_local(x_bxLxD, expert_bxKL, experts: dict, *, axis: str, ep: int, lora_scale: float = 1.0):
    """This device's assignments [b, K*L] through their experts, dropless; [b, K*L, D] out.
    ep == 1: the b*L*K assignments sorted by expert. ep > 1 (inside a shard_map manual over
    `axis`): device n gets this device's assignments of its E/ep experts, in expert order, in a
    buffer of A = b*L*min(K, E/ep) rows (the most a token can send it), plus their counts per
    expert; it runs them in the runs they arrived in (`grouped_swiglu`) and sends the results back.
    `experts` (this device's e = E/ep), `lora_scale`: as `swiglu_experts`."""
    b, L, D = x_bxLxD.shape
    KL = expert_bxKL.shape[1]
    x_TxD = x_bxLxD.reshape(b * L, D)
    token_bxKL = jnp.arange(b)[:, None] * L + jnp.arange(KL)[None, :] % L
    expert_N, token_N = expert_bxKL.reshape(-1), token_bxKL.reshape(-1)
    if ep == 1:
        return sorted_swiglu(x_TxD[token_N], expert_N, experts, lora_scale).reshape(b, KL, D)

    e = experts["expert_gate"].shape[0]  # local experts
    A = b * L * min(KL // L, e)
    count_E = jnp.zeros((ep * e,), jnp.int32).at[expert_N].add(1)
    # the assignments sorted by expert are a run per destination device, sent_ep rows each
    order_N = jnp.argsort(expert_N, stable=True)
    sent_ep = count_E.reshape(ep, e).sum(1)
    recv_count_epxe = jax.lax.all_to_all(count_E.reshape(ep, e), axis, 0, 0, tiled=True)
    recv_ep = recv_count_epxe.sum(1)
    # only the rows routed travel (a ragged all-to-all on GPUs), into the worst-case blocks and back
    recv_epxAxD = dispatch(x_TxD[token_N[order_N]], sent_ep, recv_ep, A, axis)
    # a received row's local expert: how many of its sender's groups end at or before it (e: padding);
    # each sender's block is sorted by expert, so the buffer is ep runs of grouped_matmul's group ids
    local_epxA = jax.vmap(lambda ends: jnp.searchsorted(ends, jnp.arange(A), side="right", method="compare_all"))(
        jnp.cumsum(recv_count_epxe, axis=1))
    id_epxA = jnp.arange(ep)[:, None] * (e + 1) + local_epxA
    # balanced routing sends each device as many rows as it sends: the grouped matmuls expect b*K*L
    out_MxD = grouped_swiglu(recv_epxAxD.reshape(ep * A, D), id_epxA.reshape(-1), experts, lora_scale,
                             rows=b * KL, runs=ep)
    back_NxD = collect(out_MxD.reshape(ep, A, D), recv_ep, sent_ep, order_N.shape[0], axis)
    return unsort(back_NxD, order_N).reshape(b, KL, D)


def row_axes(rows: int, axis: str, ep: int) -> list[str]:
    """The compiler-managed mesh axes that split the batch (rules' `batch` order, `axis` first
    under expert parallelism) and divide `rows`: in_row_shards makes them manual."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    names = ([axis] if ep > 1 else []) + [a for a in rule_axes("batch") if a != axis or ep == 1]
    chosen, n = [], 1
    for a in names:
        if sizes.get(a, 1) > 1 and kinds[a] != jax.sharding.AxisType.Manual and rows % (n * sizes[a]) == 0:
            chosen.append(a)
            n *= sizes[a]
    return chosen


def width_axes(width: int) -> list[str]:
    """The compiler-managed mesh axes that split the experts' width F (rules' `mlp`: tensor) and
    divide it: the dropless in_row_shards makes them manual too."""
    chosen, n = [], 1
    for a in rule_axes("mlp"):
        size, manual = mesh_axis(a)
        if size > 1 and not manual and width % (n * size) == 0:
            chosen.append(a)
            n *= size
    return chosen


def in_row_shards(local, x_BxLxD, expert_BxKL, experts: dict, axis: str, ep: int, width=()):
    """`local(x_bxLxD, expert_bxKL, experts)` in one shard_map manual over the batch's axes (see
    row_axes): each device routes its own rows, and under expert parallelism the all_to_alls over
    `axis` inside `local` send each device only its rows' assignments. One shard_map, not one
    nested in another: XLA (JAX 0.11) requires a program's manual axes in mesh order. The expert
    weights (`experts`, by parameter name: EXPERT_AXES gives their logical axes) enter as one
    copy per row shard, [R, E, ...] split on R (and on E over `axis` under expert parallelism):
    the broadcast outside is the compiler's gather of the weights for the matmuls (FSDP's), its
    transpose the compiler's gradient reduction. (Entering unsplit instead makes shard_map psum
    the weights' cotangent, and XLA:CPU aborts on a bf16 psum there, JAX 0.10: "Invalid binary
    instruction opcode copy".) Every output is split on its first dim (rows).
    `width` (width_axes): mesh axes made manual too, the weights split on F (`mlp`) over them
    (Megatron's expert MLP); x, and a weight without F (a LoRA A of gate/up, B of down), enter as
    one copy per F shard, [W, ...], so their partial cotangents are summed by the broadcast's
    transpose, and `local` returns partial sums [1, b, ...] that the caller sums over the leading
    W: outside the loops of the grouped matmuls, once."""
    rows = row_axes(x_BxLxD.shape[0], axis, ep)
    if not rows and not width:
        return local(x_BxLxD, expert_BxKL, experts)
    mesh = jax.sharding.get_abstract_mesh()
    copies = tuple(a for a in rows if a != axis)
    R = math.prod(mesh.shape[a] for a in copies)
    W = math.prod(mesh.shape[a] for a in width)
    manual = set(rows) | set(width)
    split = {"experts": axis if ep > 1 else None, "mlp": tuple(width) or None}  # logical axis -> manual axes
    lead, w_specs, experts_R = {}, {}, {}
    for name, w in experts.items():
        axes = EXPERT_AXES[name]
        lead[name] = (R, W) if width and "mlp" not in axes else (R,)
        experts_R[name] = jnp.broadcast_to(w, lead[name] + w.shape)
        w_specs[name] = P(copies or None, *(split["mlp"],) * (len(lead[name]) - 1), *(split.get(n) for n in axes))

    def body(x_bxLxD, expert_bxKL, experts_1):
        with manual_axes_rules(manual):
            mine = {name: w.reshape(w.shape[len(lead[name]):]) for name, w in experts_1.items()}
            return local(x_bxLxD[0] if width else x_bxLxD, expert_bxKL, mine)

    spec = P(tuple(rows) or None)
    x_spec = P(split["mlp"], tuple(rows) or None) if width else spec
    x_in = jnp.broadcast_to(x_BxLxD[None], (W,) + x_BxLxD.shape) if width else x_BxLxD
    return jax.shard_map(body, in_specs=(x_spec, spec, w_specs), out_specs=x_spec,
                         axis_names=manual, check_vma=False)(x_in, expert_BxKL, experts_R)


def by_chunks(local, chunks: int):
    """`local(x_bxLxD, routed, experts)` run on `chunks` slices of its rows one after another, its
    outputs (each split on rows) concatenated: the slices are independent, so XLA's scheduler can run
    one slice's dispatch and combine all-to-alls beside another slice's expert matmuls (the two-chunk
    overlap of DeepSeek-V3's training). The same math: routing, capacity and counts are per row."""
    if chunks == 1:
        return local

    def run(x_bxLxD, routed, experts):
        b = x_bxLxD.shape[0]
        part = lambda tree, i: jax.tree.map(lambda a: a[i * b // chunks:(i + 1) * b // chunks], tree)
        outs = [local(part(x_bxLxD, i), part(routed, i), experts) for i in range(chunks)]
        return jax.tree.map(lambda *o: jnp.concatenate(o, axis=0), *outs)

    return run


def combine(out_BxKLxD, gate_BxLxK):
    """Each assignment's output (0 when dropped) weighted by its gate, summed over the k, in fp32."""
    B, L, K = gate_BxLxK.shape
    return jnp.einsum("bkld,bkl->bld", out_BxKLxD.reshape(B, K, L, -1).astype(jnp.float32),
                      gate_BxLxK.swapaxes(1, 2))


def moe_mlp(x_BxLxD, router_DxE, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
            experts_per_token: int, capacity_factor: float, axis: str = "expert", einsum=jnp.einsum,
            router: Router = Router(), bias_E=None, adapters: dict | None = None, lora_scale: float = 1.0,
            chunks: int = 1):
    """The experts' output [B, L, D] in x's dtype and the routing stats (see the module doc).
    `einsum`: the capacity routing's expert matmul (fp8 under precision=fp8); the dropless grouped
    matmuls run in x's dtype. `router`, `bias_E`: how tokens pick experts (`Router`). `adapters`:
    LoRA adapters, one per expert, by parameter name (`lora_expert_gate_a` [E, D, r], `_b` [E, r, F],
    ...), run inside each expert's matmuls (`projection`) times `lora_scale`. `chunks`: each device's
    rows in that many slices, one's exchanges beside another's matmuls (`by_chunks`)."""
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

    logits_BxLxE, probs_BxLxE, expert_BxLxK, gate_BxLxK = route(x_BxLxD, router_DxE, K, router, bias_E)
    expert_BxKL = expert_BxLxK.swapaxes(1, 2).reshape(B, K * L)  # choice-major
    experts = {"expert_gate": w_gate_ExDxF, "expert_up": w_up_ExDxF, "expert_down": w_down_ExFxD, **(adapters or {})}
    if capacity_factor == 0:
        count_BxE = jax.vmap(lambda e: jnp.zeros((E,), jnp.int32).at[e].add(1))(expert_BxKL)
        kept_BxKL = jnp.ones((B, K * L), jnp.bool_)
        # Megatron over F: each device's F slice gives partial sums, combined, then summed over
        # `width` once in x's dtype (the dense MLP's all-reduce); left inside the grouped matmuls'
        # loops, the compiler all-reduced every step's tile
        width = width_axes(w_gate_ExDxF.shape[-1])

        def routed_rows(x_bxLxD, routed, experts):  # routed: (expert ids, gates), both split on their rows
            expert_bxKL, gate_bxLxK = routed
            out_bxKLxD = dropless_local(x_bxLxD, expert_bxKL, experts, axis=axis, ep=ep, lora_scale=lora_scale)
            return combine(out_bxKLxD, gate_bxLxK)

        def local(x_bxLxD, routed, experts):
            y_bxLxD = by_chunks(routed_rows, chunks)(x_bxLxD, routed, experts)
            return y_bxLxD.astype(x_bxLxD.dtype)[None] if width else y_bxLxD

        y_BxLxD = in_row_shards(local, x_BxLxD, (expert_BxKL, gate_BxLxK), experts, axis, ep, width)
        y_BxLxD = jnp.sum(y_BxLxD, axis=0) if width else y_BxLxD
    else:
        local = by_chunks(functools.partial(capacity_local, C=C, axis=axis, ep=ep, einsum=einsum,
                                            lora_scale=lora_scale), chunks)
        out_BxKLxD, kept_BxKL, count_BxE = in_row_shards(local, x_BxLxD, expert_BxKL, experts, axis, ep)
        y_BxLxD = combine(out_BxKLxD, gate_BxLxK)
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
