"""A roofline that knows the machine: where each mesh axis runs (inside a node or across nodes),
what each collective costs on that link, and what a step's compute, communication and memory
traffic take at best.

Placement. Devices are numbered the way `mesh.build_mesh` lays them out: the mesh's axes in
`mesh.AXES` order, major to minor (`np.arange(n).reshape(sizes)`, also build_mesh's layout on
several GPU processes, whose data axis spans them). A node holds
`devices_per_node` consecutive device ids (one process's local devices; a TPU slice). A set of
axes crosses nodes when one of its groups (the devices that differ only along those axes) holds
devices of two nodes; its collectives then run at the cross-node bandwidth (a ring runs at its
slowest link's pace), otherwise at the in-node one.

Attribution. A collective's replica groups name devices by their position in the mesh (the
compiled program's device assignment is the mesh's devices in order; on the planner's simulated
CPU mesh positions and ids coincide). The axes a collective spans are those along which the
devices of a group differ; its traffic is put on that set of axes (one axis, or several: a
ZeRO-3 gather over data and fsdp).

Times, per device per step (each a lower bound; the step is the largest when all of it overlaps
perfectly, the sum when none does):
- compute = hardware FLOPs / peak / (1 - pipeline bubble). Hardware FLOPs are the model's dense
  6N per token (meshtrain/core/metrics.py), corrected by the model's `slot_matmul_params`, N_slot
  (capacity routing runs every expert slot, empty or not, not N's k/E share; dropless routing under
  expert parallelism every row of its receive buffer, filled or not: models/experts.py), which counts
  with the blocks and, under fp8, with the fp8 matmuls where they run it; plus the forward the backward
  reruns, 2·(N_blocks + N_slot), under
  `parallel.remat=full` or a pipeline's `parallel.residuals=recompute` (`save_matmuls` and
  `offload` keep every matmul output, attention's included, so they rerun no matmul), plus
  attention as its kernel runs it: the share of the causal scores it computes (blockwise and ring
  skip the hidden blocks: about half) times its matmuls (flash-style backwards recompute the
  scores; meshtrain/ops/attention.py `executed_attention`). From the formula, not from XLA's cost
  analysis, which counts a loop body (the layer scan, the pipeline ticks) once. The bubble is the
  lockstep timetable's (meshtrain/parallel/schedules.py), a tick costing its slowest stage: where
  `embed` runs layers (the model's `embed_stacks`, deepseek_v3's dense first layers), the first stage
  runs them besides its share of the blocks, and again in its backward (their forward, for the
  embedding gradient); the last stage runs the head (6·V·D per token) and any multi-token prediction
  modules with their heads; compute is x `stage_factor`, the slowest stage's work over the mean's. Under
  precision=fp8 the matmuls the blocks run in fp8 (6·(N_fp8 + N_slot), and 2·(N_fp8 + N_slot) rerun; N_fp8 the model's
  `fp8_matmul_params`: the projections, the MLP, capacity-routed experts) run at the device's fp8
  peak, the rest (attention, the head, a MoE block's fp32 router, dropless experts) at its bf16 peak:
  compute = ((hardware - fp8) FLOPs / peak_bf16 + fp8 FLOPs / peak_fp8) / (1 - bubble).
- communication = sum over axis sets of ring link traffic (meshtrain/planner/hlo.py) / that set's link
  bandwidth.
- memory = (argument + output + temporary bytes of the compiled step) / HBM bandwidth: every
  argument read once, every output and temporary written once. A floor, not an estimate: it leaves
  out that weights are read again by every microbatch and activations again by the backward.
MFU ceiling = model FLOPs (no recompute: that is HFU's) / peak / step, against the bf16 peak under
fp8 too (meshtrain/core/metrics.py), and under fp8 `mfu_fp8_ceiling` against the fp8 peak.

These formulas price the step of a plan compiled by XLA:CPU (`priced_by: "formulas"`), whose program
has no GPU kernels; they are a bound, 0.16x-0.48x of the steps measured on a GPU. A plan compiled by
XLA's GPU compiler is priced from its kernels (meshtrain/planner/kernel_time.py, `priced_by:
"kernels"`, this bound kept as `formula_step_s`), with four constants (meshtrain/core/metrics.py,
KERNEL_CONSTANTS) calibrated on three measured steps: H200 llama_1b batch 8 with cuDNN attention
(272.3 ms) and with XLA's (674.2 ms), and H100 llama3-8b's shape with 4 layers, batch 2, remat full
(1,131.6 ms); held out and predicted within 3.2%: H200 llama_1b batch 16 cuDNN (530.9 ms) and batch 8
blockwise (654.7 ms), H100 batch 4 in 2 microbatches, save_matmuls (1,991.1 ms). Measured vs predicted:
benchmarks/RESULTS.md, "A step time to book a pod on".
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.core.metrics import DEVICE_PROFILES, flops_per_token
from meshtrain.models.layer_runs import recipe_share
from meshtrain.ops.attention import executed_attention
from meshtrain.ops.grouped_matmul import runs_rows_routed
from meshtrain.ops.recipes import RECIPES, is_low_precision
from meshtrain.ops.ulysses import context_degrees
from meshtrain.parallel.mesh import AXES
from meshtrain.parallel.schedules import timetable


# ---- where the axes run ----
def _shape(sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes.get(a, 1) for a in AXES)


def device_grid(sizes: dict[str, int]) -> np.ndarray:
    """Device ids in mesh order, shaped like the mesh: `arange(n).reshape(sizes)`. It is also
    build_mesh's multi-process layout, whose hosts split the outermost axes, `data` first
    (mesh.across_hosts): node g holds ids g*k .. g*k + k-1 either way (tests/test_roofline.py checks it against
    jax's create_hybrid_device_mesh)."""
    shape = _shape(sizes)
    return np.arange(math.prod(shape)).reshape(shape)


def _groups_along(grid: np.ndarray, axes: Sequence[str]) -> np.ndarray:
    """[groups, size]: each row the devices that differ only along `axes`."""
    picked = [AXES.index(a) for a in axes]
    rest = [i for i in range(grid.ndim) if i not in picked]
    return grid.transpose(rest + picked).reshape(-1, math.prod(grid.shape[i] for i in picked))


def crosses_nodes(axes: Sequence[str], sizes: dict[str, int], devices_per_node: int) -> bool:
    """Whether some group along `axes` holds devices of two nodes (device id // devices_per_node)."""
    if not axes:
        return False
    nodes = _groups_along(device_grid(sizes), axes) // devices_per_node
    return bool((nodes != nodes[:, :1]).any())


def placement(sizes: dict[str, int], devices_per_node: int) -> dict[str, str]:
    """'in-node' or 'cross-node' for every axis of size > 1, in mesh order."""
    return {a: "cross-node" if crosses_nodes((a,), sizes, devices_per_node) else "in-node"
            for a in AXES if sizes.get(a, 1) > 1}


# ---- which axes a collective spans ----
def axes_of_groups(groups: Iterable[Sequence[int]], sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) along which the devices of some group differ; devices are
    mesh positions, as in XLA's replica groups and a permute's source-target pairs. () when no
    group holds two different devices."""
    shape = _shape(sizes)
    varying = np.zeros(len(AXES), bool)
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), shape))  # [axes, members]
        varying |= (coords != coords[:, :1]).any(axis=1)
    return tuple(a for a, v in zip(AXES, varying) if v)


def traffic_by_axes(collectives: Iterable[tuple[Iterable[Sequence[int]], float]],
                    sizes: dict[str, int]) -> dict[tuple[str, ...], float]:
    """Sum (replica groups, link bytes per device) pairs by the axes their groups span."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for groups, nbytes in collectives:
        out[axes_of_groups(groups, sizes)] += nbytes
    return dict(out)


def members_per_node(axes: Sequence[str], sizes: dict[str, int], devices_per_node: int) -> int:
    """The fewest devices of one group along `axes` that share a node (device id // devices_per_node)."""
    nodes = _groups_along(device_grid(sizes), axes) // devices_per_node
    return int(min(np.unique(row, return_counts=True)[1].min() for row in nodes))


def link_bandwidth(profile: dict, axes: Sequence[str], sizes: dict[str, int], devices_per_node: int) -> float:
    """Bytes/s per device of a ring collective over `axes` (link traffic 2(n-1)/n x bytes for an
    all-reduce): `in_node_bw` within a node; across nodes NCCL runs a ring channel per NIC, so a group
    with k devices in each node crosses the node boundary on k NICs at once (each carrying 1/k of the
    traffic; the node's other devices' NICs serve the other groups): k x `cross_node_bw`, at most
    `in_node_bw`. On an H100 pod (8 x 400 Gb/s NICs a node) a group of 8 per node gets 400 GB/s; the
    published NCCL all_reduce_perf bus bandwidth of multi-node H100 and H200 pods on NDR InfiniBand is
    400-450 GB/s (saturncloud.io, "Validating Multi-Node GPU Clusters with NCCL Tests"), and 460-480 GB/s
    within an 8 x H100 SXM node (docs.alayanew.com, "NCCL-tests in practice", 2026-05-06). A group with
    one device per node is the 400 Gb/s NIC's 50 GB/s. Not calibrated on a measured pod."""
    if not crosses_nodes(axes, sizes, devices_per_node):
        return profile["in_node_bw"]
    return min(profile["in_node_bw"], members_per_node(axes, sizes, devices_per_node) * profile["cross_node_bw"])


def comm_times(traffic: dict[tuple[str, ...], float], sizes: dict[str, int], profile: dict,
               devices_per_node: int | None = None) -> dict[tuple[str, ...], dict]:
    """Per axis set: its traffic, whether it crosses nodes, the bandwidth it runs at and the
    seconds it takes. Traffic on no axis (a device sending to itself) moves nothing: 0 s."""
    per_node = devices_per_node or profile["devices_per_node"]
    out = {}
    for axes, nbytes in traffic.items():
        cross = crosses_nodes(axes, sizes, per_node)
        bw = link_bandwidth(profile, axes, sizes, per_node) if axes else profile["in_node_bw"]
        out[axes] = {"traffic_bytes": nbytes, "cross_node": cross, "bandwidth": bw,
                     "seconds": nbytes / bw if axes else 0.0}
    return out


# ---- compute, and the roofs together ----
def recomputes(remat: str, residuals: str, stages: int) -> bool:
    """Whether the backward reruns the blocks' forward: remat=full, or a pipeline (stages > 1)
    keeping only each chunk's input (residuals=recompute)."""
    return remat == "full" or (stages > 1 and residuals == "recompute")


def hardware_flops_per_token(model_flops_per_token: float, block_params: float, attention_width: int,
                             seq_len: int, recompute: bool, attention: list, windows: tuple[int, ...]) -> float:
    """The FLOPs a step executes per token: the dense 6N of `model_flops_per_token` (the caller adds
    6·N_slot to it and N_slot to `block_params`), plus one more forward of the
    blocks' matmuls, 2·N_blocks, when the forward is rerun (the embedding and the head are not),
    and attention as its kernel runs it (`attention`: per kind of layer, meshtrain.ops.attention.
    executed_attention's ((forward, backward) score-sized matmuls, share of the scores) and the
    kind's layer count): 2·H·K·S per matmul and layer x share x (forward + backward, + forward again
    when rerun). The model's attention term (metrics.flops_per_token of the layers' `windows`),
    12·L·H·K·S without windows, is xla's 2 + 4 x 1."""
    model_attention = flops_per_token(0, len(windows), attention_width, seq_len, windows)
    dense = model_flops_per_token - model_attention
    rerun = 2.0 * block_params if recompute else 0.0
    executed = sum(2.0 * layers * attention_width * seq_len * share * (forward + backward + forward * recompute)
                   for ((forward, backward), share), layers in attention)
    return dense + rerun + executed


def stage_factor(first_only: float, last_only: float, total: float, stages: int) -> float:
    """A pipeline's compute over balanced stages' where the first stage alone runs `first_only` of
    the `total` FLOPs, the last stage alone `last_only`, and each stage 1/S of the rest: a tick costs
    its slowest stage, whose work over the mean stage's is
    (max(first_only, last_only) + (total - first_only - last_only) / S) / (total / S)
    = 1 + S max(f, l) - f - l, f and l the two shares of `total` (1 + f (S - 1) for the first's alone)."""
    if not total:
        return 1.0
    f, l = first_only / total, last_only / total
    return 1.0 + stages * max(f, l) - f - l


def last_stage_flops_per_token(model, params, attention_width: int, seq_len: int, kernel: str, ring: int,
                               recompute: bool) -> float:
    """The FLOPs per token only a pipeline's last stage runs: the head, 6·V·D (forward and backward,
    never rerun), and with multi-token prediction its M modules (`embedded_flops_per_token` of the
    stack `mtp`, full causal attention, rerun as the blocks are) and their M passes through the
    shared head."""
    c, depth = model.cfg, model.mtp_depth
    modules = embedded_flops_per_token([params["mtp"]], attention_width, seq_len, (0,) * depth, kernel, ring,
                                       recompute) if depth else 0.0
    return 6.0 * c.vocab_size * c.d_model * (1 + depth) + modules


def embedded_flops_per_token(stacks, attention_width: int, seq_len: int, windows: tuple[int, ...],
                            kernel: str, ring: int, recompute: bool = True) -> float:
    """`hardware_flops_per_token` of the first layers `embed` runs (`stacks`: their parameter trees,
    each stacked on a leading layers axis; `windows`: every layer's, these first), their forward
    rerun unless `recompute` is False: a pipeline's first stage reruns it for the embedding gradient."""
    layers = sum(jax.tree.leaves(stack)[0].shape[0] for stack in stacks)
    params = sum(leaf.size for stack in stacks for leaf in jax.tree.leaves(stack))
    first = windows[:layers]
    attention = [(executed_attention(kernel, seq_len, ring, w), first.count(w)) for w in sorted(set(first))]
    return hardware_flops_per_token(6.0 * params + flops_per_token(0, layers, attention_width, seq_len, first), params,
                                    attention_width, seq_len, recompute, attention, first)


def times(model_flops: float, hardware_flops: float, comm_s: float, memory_bytes: float, profile: dict,
          bubble: float = 0.0, fp8_flops: float = 0.0, slowest_stage: float = 1.0, host_s: float = 0.0,
          low_peak: str = "peak_fp8_flops") -> dict:
    """The three roofs for one device's step, the step with perfect overlap (their max) and with
    none (their sum), and the MFU and HFU ceilings at the overlapped step. `fp8_flops`: the part of
    the hardware FLOPs that runs at the profile's `low_peak` (a recipe's GEMMs: fp8's, nvfp4's fp4); `slowest_stage`:
    a pipeline's `stage_factor`; `host_s`: host-link seconds (`offload_seconds`), a fourth roof where
    there are any (the GPU program overlaps the fetches with compute, the update's copies with none)."""
    fp8_s = fp8_flops / profile[low_peak] if fp8_flops else 0.0
    compute_s = ((hardware_flops - fp8_flops) / profile["peak_flops"] + fp8_s) / (1.0 - bubble) * slowest_stage
    memory_s = memory_bytes / profile["hbm_bw"]
    roofs = {"compute": compute_s, "communication": comm_s, "memory": memory_s, **({"host": host_s} if host_s else {})}
    step_s = max(roofs.values())
    out = {"compute_s": compute_s, "comm_s": comm_s, "memory_s": memory_s, "pipeline_bubble": bubble,
           "stage_factor": slowest_stage, "host_s": host_s,
           "step_s": step_s, "serial_s": sum(roofs.values()), "bound": max(roofs, key=roofs.get),
           "mfu_ceiling": model_flops / profile["peak_flops"] / step_s if step_s else 0.0,
           "hfu_ceiling": hardware_flops / profile["peak_flops"] / step_s if step_s else 0.0}
    if fp8_flops:
        out["mfu_fp8_ceiling"] = model_flops / profile[low_peak] / step_s if step_s else 0.0
        out["low_peak"] = low_peak
    return out


def refuse_on(profile: dict, precision: str) -> None:
    """A recipe planned on a device without its GEMMs (no peak for them, or a GPU before the recipe's
    compute capability: meshtrain/ops/recipes.py): one line naming the devices that have them."""
    recipe = RECIPES[precision]
    has = lambda p: recipe.peak in p and p.get("capability", recipe.capability) >= recipe.capability
    if not has(profile):
        runs = sorted(name for name, p in DEVICE_PROFILES.items() if has(p))
        raise UserError(f"parallel.precision={precision}: the {profile['name']} has no {precision} GEMMs "
                        f"({recipe.gpus}); plan it on --device {' or '.join(runs)}, or set parallel.precision=bf16")


def offload_seconds(program, profile: dict) -> float:
    """parallel.offload's host-link seconds per step by formula, one direction after the other as the
    GPU program schedules them: the update (after the backward, which it needs whole) brings each
    stacked layer's moments M in and writes them back (2 M); under optimizer+params the layers' fp32
    parameters P also come in for the forward and again for the backward's rerun, and in and out for
    the update (4 P), their gradients G out of the backward, in for the global norm and in for the
    update (3 G, G = P): 2 M + 7 P, the GPU program's own bytes (tests/test_offload.py)."""
    if program.plan.offload == "none":
        return 0.0
    if "host_bw" not in profile:
        raise UserError(f"parallel.offload={program.plan.offload}: no host link figure for the {profile['name']} "
                        f"(meshtrain/core/metrics.py); plan it on a GPU --device, or set parallel.offload=none")
    moments, params = program.offloaded_bytes(parts=True)
    return (2.0 * moments + 7.0 * params) / profile["host_bw"]


def _label(axes: tuple[str, ...]) -> str:
    return "+".join(axes) or "none"


def estimate(program, memory_analysis, collectives: Iterable, profile: dict,
             devices_per_node: int | None = None) -> dict:
    """The roofline of a compiled TrainProgram on `profile`'s machine. `collectives`: records with
    `groups` (mesh positions per replica group), `times` (executions per step) and `traffic`
    (ring link bytes per device per execution), as meshtrain/planner/hlo.py reads them;
    `memory_analysis`: the compiled step's."""
    sizes, plan, t, m = program.sizes, program.plan, program.train, program.model.cfg
    n, stages = math.prod(sizes.values()), sizes["pipeline"]
    per_node = devices_per_node or profile["devices_per_node"]
    tokens = t.batch_size * t.seq_len / n  # per device
    width = m.num_heads * m.head_dim
    recompute = recomputes(plan.remat, plan.residuals, stages)
    params = program.abstract_state["params"]
    # N_slot: every capacity slot runs, and dropless every row of the expert-parallel receive buffer where
    # the grouped matmul is the loop (the GPU's Triton kernels run the rows routed)
    rows_routed = runs_rows_routed(program.backend, m.d_model, m.mlp_dim // math.prod(
        sizes[a] for a in program.rules.get("mlp", ())))
    slot_params = program.model.slot_matmul_params(params, t.seq_len, sizes.get("expert", 1), rows_routed=rows_routed)
    block_params = program.model.block_matmul_params(params) + slot_params  # the head is not rerun
    model_flops = program.flops_per_token * tokens
    windows = m.layer_windows()  # 0: the whole causal past
    # hybrid: the ring over C / u groups
    ring = context_degrees(plan.context_strategy, sizes.get("context", 1), plan.ulysses_degree)[0]
    attention = [(executed_attention(plan.attention, t.seq_len, ring, w), windows.count(w))
                 for w in m.window_kinds()]
    hardware_flops = hardware_flops_per_token(program.flops_per_token + 6.0 * slot_params, block_params, width,
                                              t.seq_len, recompute, attention, windows) * tokens
    traffic = traffic_by_axes(((c.groups, c.times * c.traffic) for c in collectives), sizes)
    links = comm_times(traffic, sizes, profile, per_node)
    bubble, slowest_stage = 0.0, 1.0
    if stages > 1:
        bubble = timetable(plan.schedule, stages, plan.num_microbatches(stages), plan.virtual_stages,
                           plan.residuals).bubble
        embedded, first_flops = [params[name] for name in program.model.embed_stacks], 0.0
        if embedded:  # the first layers `embed` runs: on the first stage only, their forward twice
            first_flops = embedded_flops_per_token(embedded, width, t.seq_len, windows, plan.attention, ring)
            hardware_flops += (first_flops - embedded_flops_per_token(embedded, width, t.seq_len, windows,
                                                                      plan.attention, ring, recompute)) * tokens
        last_flops = last_stage_flops_per_token(program.model, params, width, t.seq_len, plan.attention, ring,
                                                recompute)
        slowest_stage = stage_factor(first_flops * tokens, last_flops * tokens, hardware_flops, stages)
    ma = memory_analysis
    memory_bytes = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
    fp8_flops = 0.0
    low_peak = RECIPES[plan.precision].peak if is_low_precision(plan.precision) else "peak_fp8_flops"
    if is_low_precision(plan.precision):  # the blocks' recipe matmuls (meshtrain/ops/recipes.py), rerun ones included
        refuse_on(profile, plan.precision)
        fp8_slot = program.model.slot_matmul_params(params, t.seq_len, sizes.get("expert", 1), in_fp8=True,
                                                    rows_routed=rows_routed)
        # less the layers parallel.bf16_layers keeps in bf16 (their share of the stacked blocks)
        fp8_flops = ((6.0 + 2.0 * recompute) * (program.model.fp8_matmul_params(params) + fp8_slot) * tokens
                     * recipe_share(program.model.bf16_blocks))
    roofs = times(model_flops, hardware_flops, sum(v["seconds"] for v in links.values()), memory_bytes, profile,
                  bubble, fp8_flops, slowest_stage, offload_seconds(program, profile), low_peak)
    return {"device": profile["name"], "priced_by": "formulas", "devices_per_node": per_node,
            "nodes": math.ceil(n / per_node),
            "placement": placement(sizes, per_node),
            "flops": {"model_per_device": model_flops, "hardware_per_device": hardware_flops,
                      "fp8_per_device": fp8_flops, "recompute": recompute,
                      "attention_share": sum(share * n for (_, share), n in attention) / m.num_layers},
            "links": {_label(axes): v for axes, v in links.items()}, "memory_bytes": memory_bytes,
            **roofs, "tokens_per_s": t.batch_size * t.seq_len / roofs["step_s"] if roofs["step_s"] else 0.0}
