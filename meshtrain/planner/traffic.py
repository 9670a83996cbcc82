"""The analytical collective traffic of a compiled train step, per device per step, by kind, with
what each term stands for: what the planner prints beside the bytes read from the HLO (meshtrain/planner/hlo.py).

Formulas (per device; meshtrain/core/formulas.py; D, F, T, P, E, C the data, fsdp, tensor, pipeline,
expert, context sizes); a reduce-scatter of an X-byte tensor moves the all-gather's (N-1)/N x X.
Parameters count as this device's slice over T, P and E (`param_slices`): the layers split over
P, the embedding, head and final norm held whole by every pipeline stage; data, fsdp and context
(the `embed` rule shards weights over fsdp x context) are the axes they are gathered and reduced over.
- Data parallelism (zero <= 1): one gradient all-reduce over D per step. The manual executors
  (meshtrain/parallel/data_parallel.py: zero 0/1, microbatches, a pipeline) sum and reduce fp32 gradients;
  XLA's own reductions (zero 2/3 with one microbatch) reduce the compute-dtype copy's gradient in
  its dtype. With `parallel.grad_compression=int8` (meshtrain/parallel/compression.py) the reduction over D
  is an all-to-all of int8 values and fp32 block scales (at zero 0/1 also an all-gather of the same
  volume): (1/4 + 1/block) of the fp32 bytes, `formulas.compressed_reduction_traffic`. ZeRO 1/2
  all-gather the updated fp32 parameter shards over D; ZeRO 2 reduce-scatters gradients over D;
  ZeRO 3 with microbatches or a pipeline gathers parameters and reduce-scatters gradients over D
  once per step.
- FSDP (over F x C, and D at zero 3 without microbatches or a pipeline), per microbatch: the
  layers' weights all-gathered in the compute dtype in the forward and again in the backward
  (remat=full recomputes with the backward's gather; under a low-precision recipe XLA:GPU gathers the
  matrices the recipe quantizes, the model's `fp8_weight`, quantized: fp8's 1 byte, nvfp4's 0.5625 with its
  block scales: meshtrain/ops/recipes.py `gathered_bytes`), their gradients reduce-scattered in the
  compute dtype; the embedding, head and final norm gathered once per step (XLA:CPU hoists the gather
  out of the microbatch loop: an untied table in the compute dtype, the head twice in it; XLA:GPU
  does not: per microbatch, the table and head in the compute dtype) and reduced per microbatch,
  the head's in fp32 (the loss sums its gradient over its chunks per batch shard, meshtrain/ops/loss.py,
  so once), the lookup's in fp32 (meshtrain/ops/embedding.py; on XLA:GPU a tied table's apart from
  the head's). In a pipeline the stage that embeds gathers and reduces the table per microbatch (on
  XLA:CPU too: no gather leaves the stage's conditional), the one that applies the head the head and
  norm: a device's mean is 1/P of them (meshtrain/planner/ticks.py reads the program so), a tied table's
  twice; under `parallel.residuals=recompute` the backward reruns the chunk's forward, which gathers
  the layers' weights a third time (and the first stage's table again).
- Megatron tensor parallelism: 2 activation all-reduces per layer forward and 2 backward, 1 more
  when remat=full recomputes the forward (the attention output's; the MLP output's only use is the
  saved next-layer input); under sequence parallelism each becomes a reduce-scatter and an
  all-gather. The vocab-parallel embedding and head add one fp32 all-reduce of [b, s, h] each.
- Pipeline: one activation forward and one cotangent back per send of the executor's tables;
  the stage-replicated parameters' gradients all-reduced over P.
- Expert parallelism: 4 all-to-alls of the dispatch buffer (`moe_dispatch`) per MoE layer (6 under
  remat=full), and dropless one of the int32 counts per expert per forward run. On XLA:GPU the
  dropless buffer's all-to-alls are ragged (meshtrain/ops/block_exchange.py): the rows routed move,
  a balanced routing's share of the worst-case buffer (the model's `routed_share`; hlo.py reads a
  ragged one at its packed side, the rows routed). Outside the experts
  the expert axis is data parallel: those gradients (attention, router, norms, embedding, head)
  are all-reduced over E per microbatch, the layers' in the compute dtype (XLA:GPU all-reduces an
  untied lookup's fp32 shard once a step, out of the microbatch loop).
- Ulysses context parallelism (meshtrain/ops/ulysses.py), per layer: 4 all-to-alls forward (q, k,
  v to head-sharded, the output back) and their 4 transposes backward (4 more under remat=full),
  each (u-1)/u of the tensor's local bytes, u the all-to-all group (C; hybrid: ulysses_degree).
  Hybrid runs the ring below over its C/u groups: the same K/V bytes per device, C/u for C.
- Context parallelism (meshtrain/ops/context_parallel.py's ring), per layer: 2(C-1) sends of this
  device's keys and values (forward and backward; C-2 more under remat=full, whose recomputed
  forward's first send is the forward's own and XLA keeps one), and C sends of the fp32 dK/dV
  sums (C-1 round the ring, one home); K/V heads split over T. A sliding window shorter than the
  ring needs fewer exchanges (`ring_schedule.ring_sends`: 2D for a window D chunks deep), counted
  per kind of layer (a model's layers may differ in window: `ModelSpec.layer_windows`).

`compare` sets measured (meshtrain/planner/hlo.py, corrected) beside these per kind: the ratio, and a
flag where it is outside 10% or there are bytes and no formula, with the reason
meshtrain/planner/known_gaps.py knows for that layout and ratio (else UNEXPLAINED) and that the roofline
(meshtrain/planner/roofline.py) times the measured bytes. Checked within 10% (tests/test_traffic.py,
tests/test_traffic_configs.py, tests/test_shipped_configs.py) for data (zero 1 and 3), fsdp, tensor (with
fsdp, under remat), pipeline, expert parallelism's all-to-all, the ring's permutes, int8 compression and
each shipped pod's main kinds; flagged with their reasons (meshtrain/planner/known_gaps.py).
docs/planner.md lists measured/formula per kind on the shipped pods (`python -m meshtrain.plan --config
configs/C.yaml`, the config's `# pod:` flags).
"""
from __future__ import annotations

import math

import jax

from meshtrain.core import formulas
from meshtrain.core.formulas import ring_traffic
from meshtrain.models.layer_runs import recipe_share
from meshtrain.ops.precision import compute_bytes
from meshtrain.ops.recipes import RECIPES, is_low_precision
from meshtrain.ops.ring_schedule import ring_sends
from meshtrain.ops.ulysses import context_degrees
from meshtrain.parallel import compression, data_parallel
from meshtrain.parallel.schedules import forwards_of, timetable
from meshtrain.parallel.sharding import (  # STORAGE_AXES: gathered, reduced over
    STORAGE_AXES,
    entry_axes,
    stage_replicated,
)
from meshtrain.parallel.tick_tables import executor_tables, sends_per_step
from meshtrain.planner.hlo import KINDS


def on_gpu(program) -> bool:
    """Whether the program is compiled by XLA's GPU compiler (its mesh holds compile-only GPU devices)."""
    return program.mesh.devices.flat[0].platform == "gpu"


def _params_with_axes(program, trained: bool = False):
    """(parameter, its sharding, its logical axes, its name) for each parameter (`trained`: each one the
    step trains, `TrainProgram.trained`: LoRA's adapters)."""
    pick = program.trained if trained else (lambda tree: tree)
    axes = jax.tree.leaves(pick(program.logical_axes), is_leaf=lambda n: isinstance(n, tuple))
    named = jax.tree_util.tree_leaves_with_path(pick(program.abstract_state["params"]))
    return zip([leaf for _, leaf in named], jax.tree.leaves(pick(program.state_shardings["params"])), axes,
               [str(path[-1].key) for path, _ in named])


def stage_replicated_params(program, trained: bool = False) -> int:
    """Parameters every pipeline stage holds whole: ZeRO's formula (`formulas.zero_bytes`) does not
    divide them by `pipeline`."""
    return sum(leaf.size for leaf, _, axes, _ in _params_with_axes(program, trained) if stage_replicated(axes))


def expert_params(program, trained: bool = False) -> int:
    """The MoE experts' parameters (an `experts` axis): ZeRO's formula divides them by `expert` too."""
    return sum(leaf.size for leaf, _, axes, _ in _params_with_axes(program, trained) if "experts" in axes)


def unsharded_slice(program) -> float:
    """Trained parameters in this device's slice that no gathered axis shards (qwen3's and gemma3's
    per-head q/k norm weights, [head_dim]): each device holds them whole, and their gradients are
    all-reduced where the others' are reduce-scattered."""
    total = 0.0
    for leaf, sharding, _, _ in _params_with_axes(program, trained=True):
        used = [a for entry in sharding.spec for a in entry_axes(entry)]
        if not any(program.sizes[a] > 1 for a in used if a in STORAGE_AXES):
            total += leaf.size / math.prod(program.sizes[a] for a in used)
    return total


def param_slices(program, experts: bool = True, trained: bool = False) -> dict[str, float]:
    """Parameters in this device's slice, as split over tensor, pipeline and expert (data, fsdp and
    context, which the `embed` rule shards weights over, are the axes gathered and reduced over):
    `blocks` (the layer stack) and `outer` (the stage-replicated embedding, head and final norm).
    `experts=False`: the parameters outside the experts only (those the expert axis replicates).
    `table`: of `outer`, an untied embedding table's slice (the lookup gathers it in the compute
    dtype; a tied table is the head too); `lookup`: the table the lookup reads, tied or not;
    `vocab`: the parameters with a vocabulary axis (the table and an untied head); `fp8`: of `blocks`,
    those an fp8 recipe quantizes before its matmul (the model's `fp8_weight`: FSDP gathers their fp8
    copies; the layers parallel.bf16_layers keeps in bf16 less). `trained`: the trained parameters only, whose
    gradients are reduced (LoRA: the adapters)."""
    out = {"blocks": 0.0, "outer": 0.0, "table": 0.0, "lookup": 0.0, "vocab": 0.0, "fp8": 0.0}
    model, fp8 = program.model, is_low_precision(program.plan.precision)
    quantized = recipe_share(model.bf16_blocks)  # of the stacked blocks, those the recipe runs (bf16_layers)
    tied = model.cfg.tie_embeddings
    for leaf, sharding, axes, name in _params_with_axes(program, trained):
        if not experts and "experts" in axes:
            continue
        split = math.prod(program.sizes[a] for entry in sharding.spec for a in entry_axes(entry)
                          if a not in STORAGE_AXES)
        out["outer" if stage_replicated(axes) else "blocks"] += leaf.size / split
        if fp8 and not stage_replicated(axes) and model.fp8_weight(name, leaf):
            out["fp8"] += leaf.size / split * quantized
        if axes[:1] == ("vocab",):
            out["lookup"] += leaf.size / split
            out["table"] += 0 if tied else leaf.size / split
        out["vocab"] += leaf.size / split if "vocab" in axes else 0
    return out


def moe_dispatch(program, microbatches: int | None = None) -> dict | None:
    """One MoE layer's dispatch buffer per device (the model's `dispatch_bytes`, models/routed.py) for
    this layout's rows per microbatch (`microbatches`: the plan's unless given); None without routed
    experts."""
    sizes, t = program.sizes, program.train
    micro = microbatches or program.plan.num_microbatches(sizes["pipeline"])
    rows = t.batch_size * sequences_per_row(program) / (sizes["data"] * sizes["fsdp"] * sizes["expert"] * micro)
    return program.model.dispatch_bytes(rows, t.seq_len, compute_bytes(program.plan.precision), sizes["expert"])


def sequences_per_row(program) -> int:
    """The sequences a batch row holds (the objective's: a DPO pair's two, chosen and rejected)."""
    return program.objective.sequences_per_row


def forward_passes(program) -> int:
    """The forward-only passes over the batch the step runs before its gradient pass (the objective's
    `forward_passes`: DPO's reference model; GRPO's policy, and its reference under rl.kl_coef)."""
    return program.objective.forward_passes()


def forward_gathers(program) -> int:
    """Those of `forward_passes` that gather parameters of their own: all but a LoRA run's reference,
    the base the policy's passes already gather (the adapters off)."""
    shared = "reference" not in program.state_shardings and program.objective.scores_reference
    return forward_passes(program) - int(shared)


def tokens_per_device(program) -> float:
    """The tokens one device holds per step: the batch's sequences split over data, fsdp and expert,
    the sequence over context."""
    sizes, t = program.sizes, program.train
    rows = t.batch_size * sequences_per_row(program)
    return rows / (sizes["data"] * sizes["fsdp"] * sizes["expert"]) * t.seq_len / sizes["context"]


def ring_layer_traffic(program) -> list[tuple[int, float, int, int]]:
    """Ring attention's link bytes per device per step for one layer of each kind (its sliding
    window, `ModelSpec.window_kinds`), as (window, bytes, K/V sends, dK/dV sends): forward and
    backward pass this device's K/V round the ring, C-1 sends a pass (fewer under a short window:
    ring_schedule.ring_sends), remat=full's recomputed forward again but for each leg's first
    send (the forward's own: XLA keeps one; not when the kernels run behind a switch over the
    layers' kinds, whose forward and recomputed forward are two conditionals), and C sends of the
    fp32 dK/dV sums."""
    sizes, plan, m, t = program.sizes, program.plan, program.model.cfg, program.train
    T, C = sizes["tensor"], sizes["context"]
    act = compute_bytes(plan.precision)
    tokens = tokens_per_device(program)
    # this device's keys and values (heads split over T): under hybrid a ring member's slot of C/u
    # of the sequence holds 1/u of the kv heads, the same bytes
    kv = tokens * 2 * m.num_kv_heads / T * m.head_dim * act
    ring = context_degrees(plan.context_strategy, C, plan.ulysses_degree)[0]  # devices (hybrid: groups) round the ring
    out, switched = [], len(m.window_kinds()) > 1
    for window in m.window_kinds():
        sends = ring_sends(t.seq_len, ring, window)
        kv_sends = 2 * sends["kv"] + (sends["kv"] - (0 if switched else sends["legs"]) if plan.remat == "full" else 0)
        out.append((window, kv_sends * kv + sends["grads"] * kv * 4 / act, kv_sends, sends["grads"]))
    return out


def ulysses_layer_traffic(program) -> float:
    """Ulysses' all-to-all link bytes per device per step for one layer (`formulas.ulysses_all_to_all_bytes`):
    forward and backward, and the recomputed forward under remat=full."""
    sizes, plan, m = program.sizes, program.plan, program.model.cfg
    T, C = sizes["tensor"], sizes["context"]
    tokens = tokens_per_device(program)
    group = context_degrees(plan.context_strategy, C, plan.ulysses_degree)[1]
    return formulas.ulysses_all_to_all_bytes(tokens, m.num_heads / T, m.num_kv_heads / T, m.head_dim,
                                             group, compute_bytes(plan.precision),
                                             3 if plan.remat == "full" else 2)


def expected_traffic(program) -> dict[str, dict]:
    """Analytical link traffic per device per step, by collective kind, with what it stands for."""
    plan, sizes = program.plan, program.sizes
    D, F, T, P, E, C = (sizes[a] for a in ("data", "fsdp", "tensor", "pipeline", "expert", "context"))
    m, zero = program.model.cfg, plan.zero
    act = compute_bytes(plan.precision)
    gpu = on_gpu(program)  # XLA:GPU's program: where it differs from XLA:CPU's, said at each term
    slices, trained = param_slices(program), param_slices(program, trained=True)  # the latter's gradients
    slice_params = trained["blocks"] + trained["outer"]
    out = {k: {"traffic_bytes": 0.0, "terms": []} for k in KINDS}

    def add(kind, value, term):
        if value > 0:
            out[kind]["traffic_bytes"] += value
            out[kind]["terms"].append(term)

    over_data = lambda kind, nbytes: ring_traffic(kind, nbytes, D)
    compressed = compression.applies(plan, sizes)
    micro = plan.num_microbatches(P)  # FSDP gathers again for every microbatch
    data_once = data_parallel.is_manual(D, microbatches=micro, pipelined=P > 1, zero=zero,
                                        compressed=compressed)  # reduced once per step, from fp32 sums
    # XLA reduces the gradient of the compute-dtype copy where it appears (its dtype); the manual
    # executors (microbatches, pipeline) sum fp32 gradients and reduce them once.
    # XLA's reductions carry the layers' gradients in the compute dtype, the embedding's and head's
    # in fp32 (the lookup's scatter-add and the fp32 logits); the manual executors sum fp32.
    grad_bytes = 4 * slice_params if data_once else trained["blocks"] * act + trained["outer"] * 4
    grads = slice_params / (F * C)  # the gradient elements a device reduces over data (and updates)
    if compressed:
        for kind, value in formulas.compressed_reduction_traffic(4 * grads, D, plan.compression_block,
                                                                  zero <= 1).items():
            what = "all-to-all" if kind == "all-to-all" else "mean all-gather"
            add(kind, value, f"int8 data-parallel gradient {what} (int8 + a scale per {plan.compression_block}), "
                             "once per step")
    if zero <= 1 and not compressed:
        add("all-reduce", over_data("all-reduce", grad_bytes / (F * C)),
            "data-parallel gradient all-reduce 2(D-1)/D x grads")
    if zero in (1, 2):
        add("all-gather", over_data("all-gather", 4 * grads), "ZeRO-1/2 all-gather of updated fp32 parameter shards")
    if zero == 2 and not compressed:
        add("reduce-scatter", over_data("all-gather", grad_bytes / (F * C)), "ZeRO-2 gradient reduce-scatter over data")
    if zero >= 3 and data_once:  # the compute-dtype copy gathered once per step
        every = (slices["blocks"] + slices["outer"]) / (F * C)  # the frozen parameters too
        add("all-gather", over_data("all-gather", every * act), "ZeRO-3 parameter all-gather over data, once per step")
        if not compressed:
            add("reduce-scatter", over_data("all-gather", 4 * grads),
                "ZeRO-3 gradient reduce-scatter over data, once per step")
    A = F * C * (D if zero >= 3 and not data_once else 1)  # FSDP's group: the `embed` rule shards over fsdp, context
    # a pipeline's stage that embeds (the first model stage's) gathers and reduces the table, the one that
    # applies the head the head and norm (engine/pipeline.py): a device's mean is 1/P of them; a tied table twice
    tied_twice = slices["lookup"] if P > 1 and program.model.cfg.tie_embeddings else 0
    on_stages = (", on the stages that embed or apply the head: 1/P of them a device" + (", a tied table on both"
                                                                                       if tied_twice else "")
                 if P > 1 else "")
    # The layers' weights in the compute dtype, forward and backward (under remat=full the
    # recomputed forward uses the backward's gather); the embedding and head in fp32, once: the
    # forward's gather stays live for the backward (outside the layer loop).
    # a recipe's weights: XLA:GPU quantizes before the gather (`gathered_bytes`), XLA:CPU after (the compute dtype)
    fp8 = slices["fp8"] if gpu else 0.0
    recipe = RECIPES.get(program.plan.precision)
    layers = (slices["blocks"] - fp8) * act + (fp8 * recipe.gathered_bytes if fp8 else 0.0)
    in_fp8 = (f", their matrices as {program.plan.precision} quantizes them ({recipe.gathered_bytes:g} bytes an "
              f"element: XLA:GPU quantizes them before the gather)") if fp8 else ""
    if plan.gathers_once(sizes):  # the compute-dtype copy, kept for the step (engine/step.py)
        add("all-gather", ring_traffic("all-gather", (slices["blocks"] + slices["outer"]) * act, A),
            "FSDP all-gather of every parameter in the compute dtype once per step, before the microbatch loop "
            "(parallel.gather_once)")
    else:
        rerun = P > 1 and plan.residuals == "recompute"  # the pipeline's backward reruns the chunk's forward
        add("all-gather", micro * ring_traffic("all-gather", (3 if rerun else 2) * layers, A),
            f"FSDP weight all-gather per microbatch x {micro}: the layers' in the compute dtype{in_fp8}, forward "
            f"and backward" + (" and the forward the backward reruns (parallel.residuals=recompute)" if rerun else ""))
        if (gpu or P > 1) and micro > 1:  # XLA:GPU does not hoist a gather out of the microbatch loop, nor
            # XLA:CPU out of the pipeline stage's conditional that embeds or applies the head
            where = ("in the stage's conditional" if P > 1 else "XLA:GPU keeps it in the microbatch loop")
            once = "" if P > 1 else " (a tied table once)"
            rerun_lookup = slices["lookup"] * act if rerun else 0  # the rerun forward's lookup, on the first stage
            outer = slices["vocab"] * act + (slices["outer"] - slices["vocab"]) * 4 + (tied_twice * act + rerun_lookup)
            add("all-gather", micro * ring_traffic("all-gather", outer, A) / P,
                f"FSDP all-gather of the embedding, head and final norm per microbatch x {micro} ({where}): the "
                f"table and head in the compute dtype{once}, the norm in fp32{on_stages}")
        else:
            add("all-gather", ring_traffic("all-gather", (slices["outer"] - slices["table"]) * 4
                                           + slices["table"] * act, A),
                "FSDP all-gather of the embedding, head and final norm once per step (the microbatch loop does not "
                "change them: XLA hoists it): an untied table in the compute dtype (the vocab-parallel lookup), the "
                "head in the compute dtype twice, 4 bytes/param (a tied table, the norm in fp32)")
    if forward_passes(program) and P > 1:  # the forward-only pass through the stages (engine/pipeline.py)
        add("all-gather", micro * (ring_traffic("all-gather", slices["blocks"] * act, A)
                                   + ring_traffic("all-gather", (slices["outer"] + tied_twice) * act, A) / P),
            f"DPO: the reference's layers gathered in the compute dtype per microbatch x {micro} in its forward-only "
            f"pass through the stages, the embedding, head and norm too{on_stages}")
    elif gathers := forward_gathers(program):  # DPO's own copy of the weights; GRPO's policy (and reference)
        add("all-gather", gathers * (micro if gpu and micro > 1 else 1)
            * ring_traffic("all-gather", (slices["blocks"] + slices["outer"]) * act, A),
            f"the parameters of {gathers} forward-only pass(es) (DPO's reference; GRPO's policy, and its reference "
            f"under rl.kl_coef) gathered in the compute dtype, once per step (XLA:GPU: per microbatch)")
    # the lookup's gradient is summed over the shards in fp32 (meshtrain/ops/embedding.py); XLA:GPU
    # reduces a tied table's apart from the head's (meshtrain/ops/loss.py), XLA:CPU adds the two first
    lookup = trained["lookup"] * 4 if (gpu or P > 1) and program.model.cfg.tie_embeddings else 0
    table_grad = ("fp32 (a tied table's twice, the lookup's and the head's)" if lookup and P > 1 else
                  "fp32 (a tied table's twice on XLA:GPU, the lookup's and the head's)" if gpu else "fp32")
    add("reduce-scatter", micro * (ring_traffic("all-gather", trained["blocks"] * act, A)
                                   + ring_traffic("all-gather", trained["outer"] * 4 + lookup, A) / P),
        f"FSDP gradient reduce-scatter per microbatch x {micro}: the layers' in the compute dtype, the head's and "
        f"norm's in fp32, the embedding's in {table_grad}{on_stages}")
    if A > 1 and not data_once:
        add("all-reduce", micro * ring_traffic("all-reduce", 4 * unsharded_slice(program), A),
            f"fp32 gradient all-reduce of the parameters the fsdp axes leave whole (per-head q/k norms) per "
            f"microbatch x {micro}")
    if E > 1:  # outside the experts the expert axis is data parallel: XLA reduces those gradients over it
        shared = param_slices(program, experts=False, trained=True)  # per microbatch, the layers' in the compute dtype
        # the lookup's shard (meshtrain/ops/embedding.py), summed in fp32. XLA:GPU: an untied one's once a
        # step (its loop code motion takes it out of the microbatch loop), a tied one's per microbatch apart
        # from the head's; XLA:CPU: an untied one's per microbatch, read as the compute dtype it is narrowed
        # to, a tied one's added to the head's and reduced with it
        tied = program.model.cfg.tie_embeddings
        table = 0 if tied else shared["lookup"]
        if P > 1:  # in the stages' conditionals, per microbatch: the table's and head's on the stages that use them
            per_micro, once = shared["blocks"] * act + (shared["outer"] + shared["lookup"] * tied) * 4 / P, 0
        else:
            per_micro = (shared["blocks"] * act + (shared["outer"] - table) * 4
                         + (shared["lookup"] * 4 * tied if gpu else table * act))
            once = table * 4 if gpu else 0
        add("all-reduce", micro * ring_traffic("all-reduce", per_micro / A, E)
            + ring_traffic("all-reduce", once / A, E),
            f"expert axis: the gradients outside the experts (attention, router, norms, embedding, head; the "
            f"layers' in the compute dtype) all-reduced over expert per microbatch x {micro} (XLA:GPU: an untied "
            f"lookup's in fp32 once a step, a tied one's per microbatch apart from the head's){on_stages}")
    if P > 1:  # each stage's share of the stage-replicated parameters' gradient, summed over stages
        add("all-reduce", ring_traffic("all-reduce", 4 * trained["outer"] / (F * C), P),
            "pipeline: gradients of the embedding/head/final norm (held by every stage) all-reduced over stages")
    # Megatron: 2 forward, 2 backward; the recomputed forward (remat=full) redoes the attention
    # output's but not the MLP output's, whose only use is the next layer's (saved) input, unless
    # the block normalizes it (gemma3's post-MLP norm, whose backward needs it again).
    per_layer = (6 if program.model.post_norm else 5) if plan.remat == "full" else 4
    per_layer += 2 * forward_passes(program)  # each forward-only pass (DPO's reference), 2 more
    tokens = tokens_per_device(program)
    megatron = formulas.megatron_allreduce_bytes(tokens, m.d_model, T, m.num_layers / P, per_layer, act)
    if plan.sequence_parallel:
        add("reduce-scatter", megatron / 2, f"Megatron-SP: {per_layer} activation reduce-scatters per layer")
        add("all-gather", megatron / 2, f"Megatron-SP: {per_layer} activation all-gathers per layer")
    else:
        add("all-reduce", megatron, f"Megatron: {per_layer} activation all-reduces per layer")
    if T > 1:  # the lookup's partial rows (forward) and the head's input gradient (backward), fp32
        # (and each forward-only pass's lookup)
        vocab = formulas.megatron_allreduce_bytes(tokens, m.d_model, T, 1, 2 + forward_passes(program), 4) / P
        kind = "vocab-parallel embedding and head: an fp32 all-reduce of [b, s, h] each" + (
            " (on the stages that embed or apply the head: 1/P of them a device)" if P > 1 else "")
        if plan.sequence_parallel:
            add("reduce-scatter", vocab / 2, kind + " (a reduce-scatter and an all-gather under SP)")
            add("all-gather", vocab / 2, kind + " (a reduce-scatter and an all-gather under SP)")
        else:
            add("all-reduce", vocab, kind)
    if E > 1:
        passes = 6 if plan.remat == "full" else 4  # the recomputed forward exchanges again
        passes += 2 * forward_passes(program)  # each forward-only pass (DPO's reference model's)
        buffer = moe_dispatch(program, microbatches=1)  # the step's rows: the microbatches' buffers summed
        counts = 0 if m.capacity_factor else 4 * m.num_experts
        fill = buffer["routed_share"] if gpu else 1.0  # XLA:GPU's ragged all-to-alls move the rows routed
        dropless = "" if m.capacity_factor else " (sorted dropless: N x rows x L x min(K, E/N) x h" + (
            f"; ragged on XLA:GPU: the rows routed, {fill:.3g} of it when balanced)" if fill < 1 else ")")
        add("all-to-all", formulas.moe_all_to_all_bytes(buffer["bytes"] * fill, E, program.model.routed_layers / P,
                                                          passes, counts),
            f"expert parallelism: {passes} all-to-alls of the dispatch buffer per MoE layer{dropless}")
    ring, group = context_degrees(plan.context_strategy, C, plan.ulysses_degree)
    if group > 1:  # meshtrain/ops/ulysses.py's all-to-alls, the same in every layer
        passes = "forward, recomputed forward and backward" if plan.remat == "full" else "forward and backward"
        add("all-to-all", ulysses_layer_traffic(program) * m.num_layers / P,
            f"Ulysses context parallelism per layer: q, k, v and the output all-to-all'd over groups of {group} "
            f"({passes}), (u-1)/u of each")
    if ring > 1:  # meshtrain/ops/context_parallel.py's ring, per kind of layer
        windows = m.layer_windows()
        for window, layer_bytes, kv_sends, grad_sends in ring_layer_traffic(program):
            layers = windows.count(window)
            which = "" if len(set(windows)) == 1 else f" of the {layers} with window {window or 'none'}"
            add("collective-permute", layer_bytes * layers / P,
                f"ring attention per layer{which}: {kv_sends} K/V sends (forward, backward"
                f"{', recomputed forward' if plan.remat == 'full' else ''}), {grad_sends} sends of the fp32 "
                f"dK/dV sums")
    if P > 1:
        tables = executor_tables(timetable(plan.schedule, P, micro, plan.virtual_stages, plan.residuals))
        sends = sends_per_step(tables)
        what = f"pipeline: {sends} sends (activations forward, cotangents back) over {len(tables['F'])} ticks"
        if forward_passes(program):  # DPO: the reference's forward-only pass through the stages first
            forwards = executor_tables(timetable(forwards_of(plan.schedule), P, micro, plan.virtual_stages))
            sends += sends_per_step(forwards)
            what += f", and the reference's forward-only pass: {sends_per_step(forwards)} over {len(forwards['F'])}"
        add("collective-permute", sends * tokens * m.d_model * act * C / micro, what)
    return out


def data_parallel_traffic(program) -> dict:
    """The gradient reduction over `data` per device per step, by formula: fp32 (all-reduce at zero
    0/1, reduce-scatter at 2/3) and int8 (meshtrain/parallel/compression.py), whichever the plan uses."""
    plan, sizes = program.plan, program.sizes
    D, zero = sizes["data"], plan.zero
    slices = param_slices(program, trained=True)
    # the fp32 bytes reduced over data
    grads = 4 * (slices["blocks"] + slices["outer"]) / (sizes["fsdp"] * sizes["context"])
    fp32 = ring_traffic("all-reduce", grads, D) if zero <= 1 else ring_traffic("all-gather", grads, D)  # RS = AG
    int8 = sum(formulas.compressed_reduction_traffic(grads, D, plan.compression_block, zero <= 1).values())
    return {"compression": plan.grad_compression if compression.applies(plan, sizes) else "none",
            "block": plan.compression_block, "fp32_bytes": fp32, "int8_bytes": int8,
            "ratio": int8 / fp32 if fp32 else 0.0}


TOLERANCE = 0.10  # measured within 10% of the formula per kind (tests/test_traffic.py)
SCALARS = 1e4  # bytes per step below which a kind carries only scalars (the loss, the norm, the guard)
ROOFLINE_USES = "measured"  # meshtrain/planner/roofline.py times the corrected HLO records, not the formulas
UNEXPLAINED = "no known cause (meshtrain/planner/hlo.py `read` lists the collectives to look at)"


def compare(measured: dict, formula: dict, tol: float = TOLERANCE, gaps: dict | None = None) -> dict[str, dict]:
    """Per kind: measured and formula link bytes, `ratio` measured/formula (None without a
    formula), `within` tol, and `flag`: None, or why the two differ (a known gap, meshtrain/planner/known_gaps.py, or
    UNEXPLAINED) and which figure the roofline uses. A kind with measured bytes but no formula is always
    flagged; one carrying scalars only (< SCALARS bytes) and no formula is not."""
    gaps = gaps or {}
    out = {}
    for kind in KINDS:
        m, f = float(measured[kind]["traffic_bytes"]), float(formula[kind]["traffic_bytes"])
        ratio = m / f if f else None
        within = bool(abs(ratio - 1) <= tol) if f else m < SCALARS
        flag = None
        if not within:
            what = f"measured {ratio:.2f}x the formula" if f else "measured bytes with no formula"
            r = ratio or math.inf
            why = next((w for w, lo, hi in gaps.get(kind, ()) if lo * (1 - tol) <= r <= hi * (1 + tol)), UNEXPLAINED)
            flag = f"{what}: {why}; the roofline uses the {ROOFLINE_USES} bytes"
        out[kind] = {"measured_bytes": m, "formula_bytes": f, "ratio": ratio, "within": within, "flag": flag}
    return out
