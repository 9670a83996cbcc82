"""A GPU program's step time, kernel by kernel: the roofline the GPU compiler's HLO allows (issue 39,
section 5). The formula roofline (meshtrain/planner/roofline.py) prices a step at datasheet peaks; this
one walks what XLA's GPU compiler launches (meshtrain/planner/kernels.py: a top-level instruction of a
computation that runs, never one inside a fusion) in the compiled schedule's order and costs each:

- GEMM (Triton GEMM fusion, cuBLAS call): FLOPs = 2·m·n·k from the dot's shapes (m the lhs's rows, batch
  dims included; k the contracted size; n the rest of the result); at the operand type's peak (bf16/f16,
  fp8; f32 as TF32) x `gemm_efficiency(m, n, k)`;
- fp8_blockwise's Triton GEMM (meshtrain/ops/fp8_blockwise_triton.py, named `meshtrain_fp8_blockwise`):
  a GEMM of its operands' shapes at the fp8 peak, as XLA's are, but at `grouped_gemm_peak` (the share
  measured of meshtrain's other Triton kernels; this one is not measured);
- meshtrain's grouped-matmul Triton kernels (meshtrain/ops/grouped_matmul_triton.py, a
  `__gpu$xla.gpu.triton` call named `meshtrain_<kernel>_rows<R>`): G GEMMs of the R rows expected
  routed plus a tile of BM rows per group boundary (R + (G - 1)·BM rows: a tile holding two groups
  runs once for each), FLOPs 2·rows·K·N at the operand type's peak x `gemm_efficiency(rows / G, N, K)`
  (`tgmm`, dw: `gemm_efficiency(K, N, rows / G)`) with `grouped_gemm_peak` for `gemm_peak` (measured on
  an H200: the Triton kernels reach less of the peak than XLA's GEMMs), bytes its rows of x, the weights
  once and each routed row of the output once (padding rows are not written; `tgmm`: its rows of x and
  dy, dw in fp32); the grid's
  programs of empty tiles exit before their K loop (not priced);
- cuDNN fused attention: forward 4·B·H·Lq·Lk·D FLOPs (QK^T and PV), the backward 2.5x that (it reruns
  QK^T, then dV, dP, dQ, dK: 5 matmuls for 2), a causal mask half of it, a sliding window Lk <= window;
  at the bf16 peak x `attention_efficiency`;
- every other kernel (loop/input fusions, Triton block fusions, copies): memory-bound. A kernel's bytes
  are its operands read and its result written, except that a fusion reads of an operand only what its
  dynamic-slices/slices take, a buffer it updates in place (a dynamic-update-slice's operand 0) is not read,
  also where the fusion reads a slice of it first (the grouped matmul's step: read a tile, write it back),
  and a dynamic-update-slice root writes only its update; an async fusion (`fusion-start`/`fusion-done`,
  which XLA in JAX 0.11 makes of a scan's residual writes) is its fusion, priced once at its start;
- an allocation (`AllocateBuffer`, meshtrain/ops/unfilled.py): no kernel, nothing;
- each kernel takes the longest of its arithmetic at its efficiency, its bytes at HBM bandwidth x
  `hbm_efficiency` (a GEMM's too), and `launch_s` (`kernel_seconds`); a `while` runs its body
  trip-count times (XLA's known_trip_count, or the loop's bounds where a pass dropped it:
  loops.py) and its condition once more, a `conditional` costs its branches weighted by
  the share each takes where its index is a constant array's element (a layer scan's switch over the
  layers' kinds, `branch_shares`), else the mean of its branches
  (blockwise attention's skipped and computed blocks: about half and half);
- a pipeline's phase of ticks (meshtrain/planner/ticks.py): each stage's cell of a tick walks the
  branches its table entries take; the stages run a tick in lockstep, so it costs its slowest cell, and
  the rest of it, a device's mean, is `pipeline_wait` (the bubble and the stages' imbalance);
- collectives (meshtrain/planner/hlo.py's records) on the link their replica groups cross (roofline.py),
  on their own stream: an async `-start` begins when the link is free and its `-done` waits for it, so
  the kernels scheduled between them hide it; a synchronous one stops the compute stream.
- copies between host and device memory (an async `copy-start`, or a `fusion-start` of a dynamic slice
  or update, with a host array, layout memory space S(5), in its shape: parallel.offload's state,
  meshtrain/ops/offload.py) on the host link (`host_bw`, each direction its own stream: PCIe is
  full duplex), as collectives are: the device-side array's bytes, the `-done` waiting for them.

The memory-bound kernels' seconds are also summed by what they are (`memory_top`: the op, its shape,
the JAX operation it came from), the largest first: where a step's memory-bound time goes.

The constants (`KERNEL_CONSTANTS` in meshtrain/core/metrics.py) are calibrated on measured steps and
stated there with the rows they came from (benchmarks/RESULTS.md, "A step time to book a pod on").
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict

from meshtrain.ops import grouped_matmul_triton as grouped
from meshtrain.planner import hlo, kernels, roofline, ticks
from meshtrain.planner.hlo import DTYPE_BYTES, KINDS, Module, typed_array_elements
from meshtrain.planner.loops import LOOP_BODY

_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\["?([\d",]*)"?\]')
_BACKEND = re.compile(r"backend_config=(\{.*\})\s*$")
_DIMS = re.compile(r"\[([\d,]*)\]")
_FREE = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "copy-done", "send-done", "recv-done", "async-done",
         "fusion-done")  # no kernel of their own (an async fusion is priced at its fusion-start)
_SLICES = ("dynamic-slice", "slice", "gather")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
MEMORY_TOP = 12  # memory-bound kernels listed (`memory_top`)


_LAID_OUT = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_ASYNC_HOST = ("copy-start", "fusion-start")


def host_transfer(ins) -> tuple[str, int] | None:
    """("to_host" or "to_device", bytes) of an async copy between host and device memory (module doc),
    None for any other instruction. The bytes are the device side's arrays (a row's slice or update,
    not the host buffer it lands in); the direction is where the start's output lies (a copy-start's
    first element, a fusion-start's second)."""
    if ins.op not in _ASYNC_HOST or ":S(5)" not in ins.shape:
        return None
    arrays = [(dtype, dims, layout or "") for dtype, dims, layout in _LAID_OUT.findall(ins.shape)]
    on_device = sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
                    for dtype, dims, layout in arrays if "S(5)" not in layout and dims)
    if ins.op == "copy-start":
        output = arrays[0]
    else:  # ((operands...), output, context): the output follows the operands' tuple
        operands = ins.shape[1:].split(")", 1)[0]
        output = arrays[len(_LAID_OUT.findall(operands))]
    return ("to_host" if "S(5)" in output[2] else "to_device"), on_device


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _bytes(shape: str) -> int:
    return sum(n * DTYPE_BYTES[t] for t, n in typed_array_elements(shape))


def gemm_efficiency(m: int, n: int, k: int, c: dict) -> float:
    """The share of peak a GEMM of [m, k] x [k, n] reaches: `gemm_peak` for a large one, less for a thin
    one, each side s at s / (s + `gemm_half_size`) (a tile row or column that cannot fill the tensor cores
    or the SMs; a half-size side reaches half the rate)."""
    half = c["gemm_half_size"]
    return c["gemm_peak"] * math.prod(s / (s + half) for s in (m, n, k))


def gemm_shape(module: Module, comp: str, ins) -> tuple[str, int, int, int] | None:
    """(operand type, m, n, k) of a GEMM kernel, None when `ins` is not one (kernels.gemm_types)."""
    if kernels.gemm_types(module, comp, ins) is None:
        return None
    if ins.op == "custom-call":  # cuBLAS: the call's first operand, its own contracting dims
        lhs = module.comps[comp][ins.operands[0]]
        contracting = _CUBLAS_CONTRACTING.search(ins.line)
        picked = [int(d) for d in contracting.group(1).replace('"', "").split(",")] if contracting else [-1]
        out = _dims(ins.shape if not ins.shape.startswith("(") else ins.shape[1:])
    else:
        body = module.callee(ins)
        dot = next(i for i in module.comps[body].values() if i.op in ("dot", "scaled-dot"))
        lhs = module.comps[body][dot.operands[0]]
        picked = [int(d) for d in _CONTRACTING.search(dot.line).group(1).split(",") if d]
        out = _dims(dot.shape)
    lhs_dims = _dims(lhs.shape)
    k = math.prod(lhs_dims[d] for d in picked)
    rows = math.prod(lhs_dims) // k  # the lhs's free (and batch) dims
    n = max(1, math.prod(out) // max(rows, 1))
    return lhs.arrays[0][0], rows, n, k


def _peak(profile: dict, dtype: str) -> float:
    """The peak FLOP/s of a GEMM on `dtype` operands: fp8's, fp4's (Blackwell's block-scaled e2m1), TF32's
    for f32, else bf16's."""
    peaks = {"f8": "peak_fp8_flops", "f4": "peak_fp4_flops"}
    return profile[peaks[dtype[:2]]] if dtype[:2] in peaks else profile["peak_tf32_flops"] if dtype == "f32" \
        else profile["peak_flops"]


def _grouped_gemm(module: Module, comp: str, ins) -> tuple[str, float, tuple[float, float, float], int] | None:
    """(operand type, FLOPs, the (m, n, k) its efficiency takes, bytes) of one of meshtrain's grouped-matmul
    kernels (module doc), None for any other instruction."""
    found = kernels.GROUPED_GEMM.search(ins.line) if ins.op == "custom-call" else None
    if found is None:
        return None
    dw = found.group(1) == "tgmm"
    operands = [module.comps[comp][o] for o in ins.operands]
    x, out = operands[2 if dw else 3], _dims(ins.shape)
    (_, K), dtype = _dims(x.shape), x.arrays[0][0]
    G, N = (out[0], out[2]) if dw else (_dims(operands[4].shape)[0], out[1])
    routed = int(found.group(2))
    rows = routed + (G - 1) * grouped.BM  # a tile holding two groups runs once for each
    b = DTYPE_BYTES[dtype]
    if dw:  # reads the rows of x and dy, writes dw in fp32
        shape, nbytes = (K, N, rows / G), rows * (K + N) * b + G * K * N * 4
    else:  # reads the rows of x and the weights, writes each routed row once (padding rows: not written)
        shape, nbytes = (rows / G, N, K), rows * K * b + G * K * N * b + min(routed, out[0]) * N * b
    return dtype, 2.0 * rows * K * N, shape, nbytes


def _attention_flops(ins) -> float:
    """A cuDNN fused attention call's FLOPs (module doc)."""
    config = json.loads(_BACKEND.search(ins.line).group(1))["cudnn_fmha_backend_config"]
    b, h, lq, lk = (int(d) for d in config["intermediate_tensor_shape"]["dimensions"])
    head_dim = _dims(ins.line.split("operand_layout_constraints={", 1)[1])[-1]
    window = int(config.get("sliding_window_length", 0))
    keys = min(lk, window) if window else lk
    share = 0.5 if config.get("mask_type", "").startswith("CAUSAL") and not window else 1.0
    forward = 4.0 * b * h * lq * keys * head_dim * share
    return forward * (2.5 if "Backward" in ins.line.split("custom_call_target=")[1][:60] else 1.0)


def _uses(module: Module, comp: str, name: str) -> list[tuple[str, object]]:
    """(the value's name as used, the user) of each use of a value, through bitcasts (views of it)."""
    out = []
    for use in module.users(comp, name):
        out += _uses(module, comp, use.name) if use.op == "bitcast" else [(name, use)]
    return out


def _fusion_bytes(module: Module, comp: str, ins) -> int:
    """Bytes a fusion (or a bare instruction) moves: operands as read, its result as written (module doc)."""
    body = module.callee(ins) if ins.op in ("fusion", "fusion-start") else None  # an async fusion: its callee
    inner = module.comps.get(body, {})
    read = 0
    for index, name in enumerate(ins.operands):
        operand = module.comps[comp].get(name)
        if operand is None:
            continue
        param = module.parameter(body, index) if body else None
        uses = _uses(module, body, param) if param else []
        sliced = [u for v, u in uses if u.op in _SLICES and u.operands[0] == v]
        in_place = [u for v, u in uses if u.op == "dynamic-update-slice" and u.operands[0] == v]
        if uses and len(sliced) + len(in_place) == len(uses):  # the slices read; the buffer updated in place not
            read += sum(_bytes(u.shape) for u in sliced)
        else:
            read += _bytes(operand.shape)
    root = inner.get(module.roots.get(body, ""))
    outputs = [inner[n] for n in root.operands] if root is not None and root.op == "tuple" else [root]
    written = 0
    for out in outputs:
        if out is not None and out.op == "dynamic-update-slice":
            written += _bytes(inner[out.operands[1]].shape) if out.operands[1] in inner else 0
        elif out is not None:
            written += _bytes(out.shape)
    return read + (written if root is not None else _bytes(ins.shape))


def kernel_seconds(kind: str, arithmetic_s: float, nbytes: float, profile: dict) -> float:
    """One kernel's seconds: the longest of its arithmetic at its kind's efficiency (`gemm_peak` for
    GEMMs, `attention_efficiency` for fused attention), its bytes at HBM bandwidth x `hbm_efficiency`,
    and `launch_s`, the shortest a launch takes (the host issues kernels no faster)."""
    c = profile["kernels"]
    efficiency = {"gemm": c["gemm_peak"], "attention": c["attention_efficiency"]}.get(kind, 1.0)
    return max(arithmetic_s / efficiency, nbytes / (profile["hbm_bw"] * c["hbm_efficiency"]), c["launch_s"])


class StepTime:
    """The walk of one compiled GPU program on `profile` (meshtrain/core/metrics.py's DEVICE_PROFILES,
    its `kernels` constants); `link_s`: {collective instruction name: seconds per execution on its link}."""

    def __init__(self, hlo_text: str, profile: dict, link_s: dict[str, float], tick_plan: dict | None = None):
        self.module, self.profile, self.c, self.link_s = Module(hlo_text, tick_plan), profile, profile["kernels"], \
            link_s
        self.parts: dict[str, float] = defaultdict(float)  # seconds per step by kind of work
        self.counts: dict[str, float] = defaultdict(float)
        self.launched: list[tuple[str, float, int, float]] = []  # (kind, arithmetic s, bytes, times per step)
        self.memory_by_kernel: dict[str, float] = defaultdict(float)  # seconds per step (`memory_label`)

    def work(self, comp: str, ins) -> tuple[str, float, int] | None:
        """(kind, seconds of its arithmetic at the peak, bytes it moves) of a kernel-level instruction,
        None for one that launches nothing. A GEMM's seconds include its shape's efficiency
        (`gemm_efficiency` without `gemm_peak`)."""
        if ins.op in _FREE or kernels.allocation(ins):
            return None
        p, c = self.profile, self.c
        if (gemm := gemm_shape(self.module, comp, ins)) is not None:
            dtype, m, n, k = gemm
            peak = _peak(p, dtype)
            shape = gemm_efficiency(m, n, k, c) / c["gemm_peak"]
            # kernel_seconds divides a GEMM's arithmetic by gemm_peak: meshtrain's Triton GEMMs run at grouped_gemm_peak
            triton = c["gemm_peak"] / c["grouped_gemm_peak"] if kernels.BLOCKWISE_GEMM.search(ins.line) else 1.0
            return "gemm", 2.0 * m * n * k / (peak * shape) * triton, _fusion_bytes(self.module, comp, ins)
        if (found := _grouped_gemm(self.module, comp, ins)) is not None:
            dtype, flops, shape, nbytes = found
            shape_share = gemm_efficiency(*shape, c) / c["gemm_peak"]
            at_peak = flops / (_peak(p, dtype) * shape_share)
            return "gemm", at_peak * c["gemm_peak"] / c["grouped_gemm_peak"], nbytes
        target = kernels.CALL_TARGET.search(ins.line) if ins.op == "custom-call" else None
        if target and target.group(1).startswith("__cudnn$fmha"):
            return "attention", _attention_flops(ins) / p["peak_flops"], 0
        return "memory", 0.0, _fusion_bytes(self.module, comp, ins)

    def kernel(self, comp: str, ins, times: float) -> float:
        """Seconds of one launch (`kernel_seconds`), counted `times` per step by kind."""
        found = self.work(comp, ins)
        if found is None:
            return 0.0
        kind, arithmetic_s, nbytes = found
        self.launched.append((kind, arithmetic_s, nbytes, times))
        seconds = kernel_seconds(kind, arithmetic_s, nbytes, self.profile)
        self.parts[kind] += times * seconds
        self.counts[kind] += times
        if kind == "memory":
            self.memory_by_kernel[memory_label(ins)] += times * seconds
        return seconds

    def run(self, comp: str, times: float = 1.0, cell: frozenset | None = None) -> float:
        """Seconds of one execution of `comp`: compute stream and collective stream, in schedule order;
        `cell`: within a pipeline tick, the branches its stage takes (meshtrain/planner/ticks.py)."""
        clock = link_free = 0.0
        host_free = {"to_host": 0.0, "to_device": 0.0}
        ends: dict[str, float] = {}
        for ins in self.module.comps[comp].values():
            if (moved := host_transfer(ins)) is not None:
                direction, nbytes = moved
                seconds = nbytes / self.profile["host_bw"]
                host_free[direction] = ends[ins.name] = max(clock, host_free[direction]) + seconds
                self.parts["host"] += times * seconds
                self.counts["host"] += times
                continue
            if ins.op in ("copy-done", "fusion-done") and ins.operands and ins.operands[0] in ends:
                clock = max(clock, ends.pop(ins.operands[0]))
                continue
            kind = ins.op.removesuffix("-start").removesuffix("-done")
            if kind in KINDS or kind == hlo.RAGGED:
                seconds = self.link_s.get(ins.name, 0.0)
                if ins.op.endswith("-done"):
                    clock = max(clock, ends.pop(ins.operands[0], clock))
                    continue
                start = max(clock, link_free)
                link_free = ends[ins.name] = start + seconds
                self.parts["collectives"] += times * seconds
                if not ins.op.endswith("-start"):  # synchronous: the compute stream waits
                    clock = link_free
                continue
            if ins.op == "while":
                n = self.module.trip_count(comp, ins)
                body, cond = LOOP_BODY.search(ins.line).group(1), re.search(r"condition=%?([\w.\-]+)", ins.line)
                clock += (n + 1) * (self.run(cond.group(1), times * (n + 1), cell) if cond else 0.0)
                if (cells := ticks.phase(self.module.ticks, ins.line, n)) is not None:  # each tick its slowest stage
                    clock += self.ticks_of(cells, lambda c, body=body: body, times, n / len(cells))
                else:
                    clock += n * self.run(body, times * n, cell)
            elif ins.op == "conditional" and cell is None and (tick := ticks.loose(self.module.ticks, ins.line)):
                clock += self.ticks_of(tick, lambda c, line=ins.line: ticks.chosen(line, c), times, 1 / len(tick))
            elif ins.op == "conditional":
                branches = ticks.branches(ins.line)
                shares = (ticks.taken(ins.line, cell) or branch_shares(self.module, comp, ins, len(branches))
                          or [1 / len(branches)] * len(branches))
                clock += sum(share * self.run(b, times * share, cell) for b, share in zip(branches, shares) if share)
            elif ins.op == "call" and (callee := re.search(r"to_apply=%?([\w.\-]+)", ins.line)):
                clock += self.run(callee.group(1), times, cell)
            else:
                clock += self.kernel(comp, ins, times)
        return max(clock, link_free)


    def ticks_of(self, cells, computation, times: float, scale: float = 1.0) -> float:
        """Seconds of a phase's ticks (x `scale`: 1, or the share of them an iteration or an inlined
        conditional stands for), each as long as its slowest stage's cell, which runs `computation(cell)`;
        a device's work counts its cells over the stages, and it waits the rest (`pipeline_wait`)."""
        shares = ticks.weighted(cells, scale)
        seconds = {c: self.run(computation(c), times * share, c) for c, share in shares}
        lockstep = ticks.lockstep(cells, seconds) * scale
        self.parts["pipeline_wait"] += times * (lockstep - sum(share * seconds[c] for c, share in shares))
        return lockstep


def branch_shares(module: Module, comp: str, ins, branches: int) -> list[float] | None:
    """The share of executions each branch of a `conditional` takes where its index is an element
    of a constant integer array (a layer scan's switch over the layers' kinds: gemma3's local and
    global layers), each branch the count of its value there (clamped into range, as XLA does);
    None where the index is computed otherwise (a residual the forward saved: the mean then)."""
    index = module.through(comp, ins.operands[0]) if ins.operands else None
    if index is None or index.op != "fusion":
        return None
    inner = module.comps.get(module.callee(index), {})
    candidates = [module.through(comp, o) for o in index.operands] + list(inner.values())
    for c in candidates:
        m = re.search(r"\bconstant\(\{([-\d,\s]+)\}\)", c.line) if c is not None and c.op == "constant" else None
        if m and re.match(r"s32\[\d+\]", c.shape):
            values = [min(max(int(v), 0), branches - 1) for v in m.group(1).split(",")]
            return [values.count(b) / len(values) for b in range(branches)]
    return None


def memory_label(ins) -> str:
    """A memory-bound kernel as `memory_top` lists it: its op, its shape (a tuple's first array) and the
    last part of the JAX operation's name it came from (XLA's metadata), e.g. `copy f32[151936,2048]`."""
    name, array = _OP_NAME.search(ins.line), _LAID_OUT.search(ins.shape)
    shape = f"{array.group(1)}[{array.group(2)}]" if array else ""
    return " ".join(filter(None, (ins.op, shape, name.group(1).rsplit("/", 1)[-1] if name else "")))


def step_time(hlo_text: str, profile: dict, link_s: dict[str, float], tick_plan: dict | None = None) -> dict:
    """The step's seconds by the walk (`StepTime`), with the seconds per step of each kind of work
    (GEMMs, fused attention, memory-bound kernels, collectives on their links) and the
    kernels launched of each kind, the largest memory-bound kernels (`memory_top`: [label, seconds per
    step]); `calibrated`: whether the constants were fitted on this device's steps (else they are the
    H100/H200's, and the plan says so)."""
    walk = StepTime(hlo_text, profile, link_s, tick_plan)
    step = walk.run(walk.module.entry)
    busy = sum(walk.parts[k] for k in ("gemm", "attention", "memory"))
    wait = walk.parts["pipeline_wait"]  # a pipeline's stages waiting for each tick's slowest one
    return {"step_s": step, "kernels_s": busy, "exposed_comm_s": max(0.0, step - busy - wait), "pipeline_wait_s": wait,
            "by_kind_s": {k: walk.parts[k] for k in ("gemm", "attention", "memory", "collectives", "host")},
            "launches": {k: walk.counts[k] for k in ("gemm", "attention", "memory", "host")},
            "memory_top": sorted(walk.memory_by_kernel.items(), key=lambda kv: -kv[1])[:MEMORY_TOP],
            "constants": dict(walk.c), "calibrated": profile.get("kernels_calibrated", True)}


def link_seconds(collectives, sizes: dict[str, int], profile: dict, devices_per_node: int) -> dict[str, float]:
    """{instruction name: seconds per execution} of each collective (hlo.py's records): its ring link
    traffic at the bandwidth of the link its replica groups cross (roofline.py); 0 on no axis."""
    out, bandwidth = {}, {}
    for c in collectives:
        axes = roofline.axes_of_groups(c.groups, sizes)
        if axes and axes not in bandwidth:
            bandwidth[axes] = roofline.link_bandwidth(profile, axes, sizes, devices_per_node)
        out[c.name] = out.get(c.name, 0.0) + (c.traffic / bandwidth[axes] if axes else 0.0)
    return out


def price(hlo_text: str, collectives, sizes: dict[str, int], profile: dict, devices_per_node: int,
          formula: dict, tick_plan: dict | None = None) -> dict:
    """The roofline of a GPU plan: `formula` (roofline.estimate's) with the step, the MFU and HFU
    ceilings and tokens/s from the GPU program's kernels (`step_time`), the formula's step kept as
    `formula_step_s`, and `priced_by` saying which priced the step."""
    walked = step_time(hlo_text, profile, link_seconds(collectives, sizes, profile, devices_per_node), tick_plan)
    step, flops = walked["step_s"], formula["flops"]
    scale = formula["step_s"] / step if step else 0.0
    out = {**formula, "priced_by": "kernels", "formula_step_s": formula["step_s"], "step_s": step,
           "kernel_time": walked, "tokens_per_s": formula["tokens_per_s"] * scale,
           "mfu_ceiling": flops["model_per_device"] / profile["peak_flops"] / step if step else 0.0,
           "hfu_ceiling": flops["hardware_per_device"] / profile["peak_flops"] / step if step else 0.0}
    if "mfu_fp8_ceiling" in formula:
        out["mfu_fp8_ceiling"] = flops["model_per_device"] / profile[formula["low_peak"]] / step if step else 0.0
    return out
