"""What a compiled step's collectives move beyond their formulas (meshtrain/planner/traffic.py), where
the cause is known: `known_gaps` gives `traffic.compare` the reason it prints beside a flagged kind,
for the layout and ratio range it holds in (anything else is UNEXPLAINED). Each was read in the
compiled HLO (meshtrain/planner/hlo.py `read` lists the collectives with their groups)."""
from __future__ import annotations

import math

from meshtrain.core import formulas
from meshtrain.ops.precision import compute_bytes
from meshtrain.ops.recipes import is_low_precision
from meshtrain.ops.ulysses import context_degrees
from meshtrain.parallel import compression, data_parallel
from meshtrain.parallel.schedules import lookup
from meshtrain.planner import traffic
from meshtrain.planner.hlo import KINDS


def known_gaps(program) -> dict[str, list[tuple[str, float, float]]]:
    """Per kind, what the compiled step moves that the formulas (meshtrain/planner/traffic.py) do not model, where it is
    known, as (why, lowest ratio, highest ratio): `compare` gives the reason to a flagged row whose
    measured/formula ratio lies in that range, and UNEXPLAINED to any other. Each was read in
    the compiled HLO (meshtrain/planner/hlo.py `read` lists the collectives with their groups)."""
    sizes, plan = program.sizes, program.plan
    D, F, T, E, C = (sizes[a] for a in ("data", "fsdp", "tensor", "expert", "context"))
    micro = plan.num_microbatches(sizes["pipeline"])
    manual = data_parallel.is_manual(D, microbatches=micro, pipelined=sizes["pipeline"] > 1, zero=plan.zero,
                                     compressed=compression.applies(plan, sizes))
    gaps: dict[str, list] = {k: [] for k in KINDS}
    if plan.zero == 1 and D > 1 and F > 1:  # beside tensor alone, data is the minor factor: no reshard
        gaps["collective-permute"].append((
            "ZeRO-1's update reshards the fp32 parameter shards between the data-sharded optimizer layout and "
            "the fsdp layout: permutes with no formula", 0, math.inf))
    if manual and F * C > 1:
        why = ("the manual data executor (a shard_map over data) beside fsdp: the parameters do not change within "
               "the step, so XLA hoists loop-invariant FSDP gathers (and moves reduce-scatters) out of the "
               "microbatch and layer loops: fewer, partly fp32, where the formula counts them per microbatch")
        gaps["all-gather"].append((why, 0, 1))
        gaps["reduce-scatter"].append((why, 0, 1))
    if (C > 1 or manual) and F * C > 1:  # beside expert alone, meshtrain/ops/embedding.py reduce-scatters it
        why = ("the embedding lookup's gradient (its scatter-add, summed over every batch and sequence shard; on "
               "XLA:CPU the head's too) is all-reduced whole over the batch axes (fsdp with context or data) "
               "and then sliced to this device's shard, where the formula reduce-scatters it over fsdp x context and "
               "all-reduces the shard over the rest, as meshtrain/ops/loss.py sums the head's")
        gaps["all-reduce"].append((why, 1, math.inf))
        gaps["reduce-scatter"].append((why, 0, 1))
        # under Ulysses (no ring) those permutes are all there is: no formula to be a ratio of
        no_ring = C > 1 and context_degrees(plan.context_strategy, C, plan.ulysses_degree)[0] == 1
        permutes_hi = math.inf if no_ring else 2
        gaps["collective-permute"].append((why + "; two shards' sums are added through a permute", 1, permutes_hi))
    per_use = not plan.gathers_once(sizes)  # the gaps of gathers made per layer and use (not one copy a step)
    if plan.remat == "full" and F * C > 1 and per_use:
        gaps["all-gather"].append((
            "remat=full: XLA may gather a layer's MLP (or experts') weights again in the backward (the recomputed "
            "forward's gather and the weight gradient's stay two collectives; llama2_70b's gate and up, "
            "mixtral's experts), up to 3/2 of the layers' formula", 1, 1.5))
    windows = program.model.cfg.layer_windows()
    if C > 1 and len(set(windows)) > 1:  # the ring behind each layer's switch over its kinds
        per_layer = {w: b for w, b, _, _ in traffic.ring_layer_traffic(program)}
        formula = traffic.expected_traffic(program)["collective-permute"]["traffic_bytes"]
        extra = sum(b * (len(windows) - windows.count(w)) for w, b in per_layer.items()) / sizes["pipeline"]
        gaps["collective-permute"].append((
            "layers of several kinds (sliding windows): the HLO reader (meshtrain/planner/hlo.py) counts both "
            "branches of each layer's switch over its kinds' kernels as if taken, so every layer's ring as every "
            "kind's; the formula counts each layer's own", 1, (formula + extra) / formula))
    recipe = plan.precision
    amaxes = (f"the {recipe} recipe's scales: each quantized tensor's amax over its shards is all-reduced (a scalar; "
              "a row's or a block's where the contraction is sharded: weights over fsdp, dw's tokens over the batch)")
    low = is_low_precision(recipe)
    if low and T > 1:  # each dx rounds on its own; 7/4 for Llama-shaped blocks (LoRA, MLA: more)
        gaps["all-reduce"].append((f"{recipe} beside tensor: q's, k's and v's (gate's, up's) dx are each a scaled "
                                   f"{recipe} GEMM rounded on its own, all-reduced apart where bf16 sums them first: 5 "
                                   "backward Megatron all-reduces a layer, not 2; and " + amaxes, 1, 7 / 4))
    elif low and D * F * C > 1:  # no Megatron all-reduce to compare with: bytes the formula lacks
        gaps["all-reduce"].append((amaxes, 1, math.inf))
    if program.model.cfg.tie_embeddings and plan.precision == "fp32" and F * C > 1 and per_use:
        gaps["all-gather"].append((
            "a tied table in fp32: XLA gathers it over fsdp for each use (the lookup, the head's forward and "
            "backward) where the formula counts one gather", 1, 4))
    latent = program.model.cfg.latent_rank()
    if T > 1 and latent:  # models/deepseek_v3.py: the latents are normalized, then split by heads
        m = program.model.cfg
        width = m.q_lora_rank + latent + m.qk_rope_head_dim
        layers = m.num_layers / sizes["pipeline"]
        extra = formulas.megatron_allreduce_bytes(traffic.tokens_per_device(program), width, T, layers, 1,
                                                  compute_bytes(plan.precision))
        formula = traffic.expected_traffic(program)["all-reduce"]["traffic_bytes"]
        gaps["all-reduce"].append((
            "multi-head latent attention beside tensor: the backward also all-reduces the q, kv and rope latents' "
            f"gradients [b, s, {width}] over tensor (partial sums of the head-split up-projections, needed whole "
            "before the latents' norms): not in the Megatron formula", 1, (formula + extra) / formula))
    # W reads B's stash (engine/split_backward.py) and moves nothing, unless the stash would outweigh the layer's
    # residuals or B's part would make a weight gradient: then W reruns the layer's pullback
    w = (f"{plan.schedule} splits each layer's weight gradient (W) off its backward; where B's stash would outweigh "
         "the layer's residuals (remat=full keeps the layer's input alone; a MoE layer's receive buffers) or the "
         "experts' grouped-matmul loop makes dx and dw in one scan, W reruns the layer's pullback from its saved "
         "residuals (engine/split_backward.py)")
    splits = sizes["pipeline"] > 1 and lookup(plan.schedule).splits_weight_grad
    if splits and F * C > 1 and not plan.gathers_once(sizes):
        gaps["all-gather"].append((w + ", so it gathers the layer's weights a third time per microbatch (the formula: "
                                   "forward and backward)", 1, 1.5 * 1.05))
    if splits and E > 1:
        full = plan.remat == "full"  # the formula's 6 all-to-alls a MoE layer, else 4; W's pullback reruns the
        moved, again = (6, 4) if full else (4, 2)  # backward's 2 (and under remat=full the forward's 2 it recomputes)
        recomputed = " and, under remat=full, the two of the forward it recomputes" if full else ""
        gaps["all-to-all"].append((w + f", so the MoE backward's two all-to-alls move again{recomputed}: "
                                       f"{moved + again} a layer where the formula counts {moved}",
                                   1, (moved + again) / moved * 1.05))
    if E > 1:
        gaps["all-gather"].append((
            "the MoE routing (models/experts.py) gathers token positions and router statistics over expert: not "
            "modelled", 1, 1.5))
    if plan.sequence_parallel:
        why = ("sequence parallelism: besides the Megatron-SP reduce-scatter/all-gather pairs XLA reshards q, k, v "
               "and the fp32 softmax/RMSNorm statistics between the sequence- and head-split layouts (all-to-alls, "
               "all-gathers, small all-reduces and permutes over tensor): not modelled")
        for kind in KINDS:
            gaps[kind].append((why, 0, math.inf))
    return {k: v for k, v in gaps.items() if v}
