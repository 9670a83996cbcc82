"""The planner behind `python -m meshtrain.plan --config ...`: compile the real train step for a
target mesh on simulated CPU devices and report memory, collectives, FLOPs and a roofline, each
next to its analytical formula.

Formulas (per device; Psi parameters; D, F, T, P the data, fsdp, tensor, pipeline sizes):
- ZeRO memory, fp32 Adam (16 bytes/param): parameters 4Psi, gradients 4Psi, moments 8Psi, each
  divided by F x T x P and also by D from stage 3, 2 and 1 respectively.
- Ring all-reduce of B bytes over N devices moves 2(N-1)/N x B per device; all-gather and
  reduce-scatter (N-1)/N x B (B the full tensor).
- Data parallelism (zero <= 1): one gradient all-reduce over D per step, also with microbatches
  (meshtrain/data_parallel.py). ZeRO 1/2: the updated parameter shards are all-gathered over D;
  ZeRO 2 reduce-scatters gradients over D once per step; ZeRO 3 with microbatches or a pipeline
  gathers parameters and reduce-scatters gradients over D once per step.
- FSDP (over F, and D at zero 3 without microbatches or a pipeline): weights all-gathered for
  every microbatch in the forward and again in the backward (and in the recomputed forward under
  remat=full), gradients reduce-scattered per microbatch.
- Megatron tensor parallelism: 2 activation all-reduces per layer forward and 2 backward (2 more
  when remat recomputes the forward), each of (batch/(D x F)) x seq x width.
- Pipeline: one activation forward and one cotangent back per tick; bubble (S-1)/(V*M+S-1).
Roofline: compute time = compiled FLOPs / peak, stretched by the pipeline bubble; communication
time = link traffic / link bandwidth; the step takes the larger (perfect overlap), so the MFU
ceiling = model FLOPs / peak / step time.
"""
from __future__ import annotations

import dataclasses
import json
import math

import jax
from jax.sharding import NamedSharding

from meshtrain import data_parallel
from meshtrain.config import load_config
from meshtrain.hlo import KINDS, collectives
from meshtrain.mesh import describe, simulate_cpu_devices
from meshtrain.plan import DEVICE_PROFILES
from meshtrain.schedules import executor_tables, sends_per_step, timetable
from meshtrain.sharding import pipeline_microbatches

GB = 1e9


def shard_bytes(tree, shardings) -> int:
    return int(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))))


def zero_formula(psi: int, sizes: dict, zero: int) -> dict[str, float]:
    """ZeRO's 16 bytes/param (fp32 params 4, grads 4, Adam moments 8), per device."""
    D, split = sizes["data"], sizes["fsdp"] * sizes["tensor"] * sizes["pipeline"]
    over = lambda stage: split * (D if zero >= stage else 1)
    return {"parameters": 4 * psi / over(3), "gradients": 4 * psi / over(2), "optimizer_state": 8 * psi / over(1)}


def expected_traffic(program) -> dict[str, dict]:
    """Analytical link traffic per device per step, by collective kind, with what it stands for."""
    cfg, sizes = program.cfg, program.sizes
    D, F, T, P = (sizes[a] for a in ("data", "fsdp", "tensor", "pipeline"))
    m, t, zero = program.model.cfg, cfg.train, cfg.zero
    act = 2 if cfg.precision == "bf16" else 4
    slice_bytes = 4 * program.num_params / (T * P)  # fp32 bytes of this device's tensor x pipeline slice
    out = {k: {"traffic_bytes": 0.0, "terms": []} for k in KINDS}

    def add(kind, value, term):
        if value > 0:
            out[kind]["traffic_bytes"] += value
            out[kind]["terms"].append(term)

    if zero <= 1:
        add("all-reduce", 2 * (D - 1) / D * slice_bytes / F, "data-parallel gradient all-reduce 2(D-1)/D x grads")
    if zero in (1, 2):
        add("all-gather", (D - 1) / D * slice_bytes / F, "ZeRO-1/2 all-gather of updated parameter shards")
    if zero == 2:
        add("reduce-scatter", (D - 1) / D * slice_bytes / F, "ZeRO-2 gradient reduce-scatter over data")
    micro = t.microbatches if P == 1 else pipeline_microbatches(cfg, P)  # FSDP gathers again for every microbatch
    data_once = data_parallel.is_manual(D, microbatches=micro, pipelined=P > 1, zero=zero)  # reduced once per step
    if zero >= 3 and data_once:  # the compute-dtype copy gathered once per step
        add("all-gather", (D - 1) / D * slice_bytes / F * act / 4, "ZeRO-3 parameter all-gather over data, once per step")
        add("reduce-scatter", (D - 1) / D * slice_bytes / F, "ZeRO-3 gradient reduce-scatter over data, once per step")
    A = F * (D if zero >= 3 and not data_once else 1)
    gathers = 3 if m.remat == "full" else 2  # forward, backward (and the recomputed forward)
    add("all-gather", gathers * micro * (A - 1) / A * slice_bytes * act / 4,
        f"FSDP weight all-gather in the compute dtype, {gathers} per microbatch x {micro}")
    add("reduce-scatter", micro * (A - 1) / A * slice_bytes, f"FSDP gradient reduce-scatter per microbatch x {micro}")
    per_layer = 6 if m.remat == "full" else 4
    activation = t.batch_size / (D * F) * t.seq_len * m.d_model * act
    add("all-reduce", per_layer * m.num_layers / P * 2 * (T - 1) / T * activation,
        f"Megatron: {per_layer} activation all-reduces per layer")
    if P > 1:
        tables = executor_tables(timetable(cfg.pipeline.schedule, P, micro, cfg.pipeline.virtual_stages))
        sends = sends_per_step(tables)
        add("collective-permute", sends * activation / micro, f"pipeline: {sends} sends (activations forward, "
            f"cotangents back) over {len(tables['F'])} ticks")
    return out


def plan(cfg, profile: dict, device_memory: float) -> dict:
    from meshtrain.program import TrainProgram

    program = TrainProgram(cfg)
    compiled = program.lower().compile()
    ma = compiled.memory_analysis()
    mesh, sizes, n = program.mesh, program.sizes, program.mesh.size
    state, shardings = program.abstract_state, program.state_shardings
    grad_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), program.grad_specs,
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    temporaries = int(ma.temp_size_in_bytes)
    total = int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + temporaries)
    memory = {"parameters": shard_bytes(state["params"], shardings["params"]),
              "optimizer_state": shard_bytes(state["opt_state"], shardings["opt_state"]),
              "gradients": shard_bytes(state["params"], grad_shardings),
              "temporaries": temporaries, "total": total, "device_memory": device_memory}
    consumers = {"parameters": memory["parameters"], "optimizer state": memory["optimizer_state"],
                 "activations and temporaries (gradients included)": temporaries}
    memory["largest"] = max(consumers, key=consumers.get)
    memory["fits"] = total <= device_memory

    measured = collectives(compiled.as_text(), n)
    expected = expected_traffic(program)
    comms = {k: {**measured[k], "formula_traffic_bytes": expected[k]["traffic_bytes"], "formula": expected[k]["terms"]}
             for k in KINDS}

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    t = cfg.train
    model_flops = program.flops_per_token * t.batch_size * t.seq_len / n
    flops = {"compiled_per_device": float(cost.get("flops", 0.0)), "model_per_device": model_flops}

    bubble = 0.0
    if sizes["pipeline"] > 1:
        bubble = timetable(cfg.pipeline.schedule, sizes["pipeline"], pipeline_microbatches(cfg, sizes["pipeline"]),
                           cfg.pipeline.virtual_stages, cfg.pipeline.residuals).bubble
    compute_s = max(flops["compiled_per_device"], model_flops) / profile["peak_flops"] / (1 - bubble)
    comm_s = sum(c["traffic_bytes"] for c in measured.values()) / profile["link_bw"]
    step_s = max(compute_s, comm_s)
    roofline = {"device": profile["name"], "compute_s": compute_s, "comm_s": comm_s, "pipeline_bubble": bubble,
                "step_s": step_s, "mfu_ceiling": model_flops / profile["peak_flops"] / step_s,
                "tokens_per_s": t.batch_size * t.seq_len / step_s}
    return {"config": {"model": dataclasses.asdict(program.model.cfg), "batch_size": t.batch_size, "seq_len": t.seq_len,
                       "precision": cfg.precision, "zero": cfg.zero, "remat": cfg.model.remat},
            "mesh": describe(sizes), "devices": n, "params": program.num_params, "memory": memory,
            "zero_formula": zero_formula(program.num_params, sizes, cfg.zero), "collectives": comms,
            "flops": flops, "roofline": roofline}


def human_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:,.0f} B"


def format_plan(r: dict) -> str:
    mem, zf, roof = r["memory"], r["zero_formula"], r["roofline"]
    gb = human_bytes
    verdict = (f"FITS in {gb(mem['device_memory'])}" if mem["fits"] else
               f"DOES NOT FIT in {gb(mem['device_memory'])}: the largest consumer is {mem['largest']}")
    lines = [f"plan: {r['params'] / 1e6:,.1f}M params on {r['devices']} devices, mesh {r['mesh']}, "
             f"zero={r['config']['zero']}, {r['config']['precision']}, remat={r['config']['remat']}",
             "", "memory per device    measured      formula (ZeRO, 16 bytes/param)"]
    for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"), ("gradients", "gradients")):
        lines.append(f"  {label:<18} {gb(mem[key]):>12}  {gb(zf[key]):>12}")
    lines += [f"  {'temporaries':<18} {gb(mem['temporaries']):>12}  (activations and gradients, from the compiled step)",
              f"  {'total':<18} {gb(mem['total']):>12}  -> {verdict}", "",
              "collectives per device per step   count    payload   link traffic   formula traffic"]
    for kind, c in r["collectives"].items():
        lines.append(f"  {kind:<30} {c['count']:>7.0f} {gb(c['payload_bytes']):>12} {gb(c['traffic_bytes']):>12} "
                     f"{gb(c['formula_traffic_bytes']):>12}  {'; '.join(c['formula'])}")
    if r["config"]["precision"] == "bf16":
        lines.append("  (XLA's CPU backend widens bf16 collectives to f32: their payload reads 2x what a GPU/TPU moves)")
    f = r["flops"]
    lines += ["", f"FLOPs per device per step: model (6N + 12LDS per token) {f['model_per_device']:.3e}; "
                  f"XLA cost analysis {f['compiled_per_device']:.3e} (it counts a loop body once, not per layer)",
              f"roofline on {roof['device']}: compute {roof['compute_s'] * 1e3:,.1f} ms"
              + (f" (bubble {roof['pipeline_bubble']:.1%})" if roof["pipeline_bubble"] else "")
              + f", communication {roof['comm_s'] * 1e3:,.1f} ms -> step >= {roof['step_s'] * 1e3:,.1f} ms, "
                f"MFU ceiling {roof['mfu_ceiling']:.1%}, {roof['tokens_per_s']:,.0f} tokens/s"]
    return "\n".join(lines)


def run(args) -> str:
    jax.config.update("jax_platforms", "cpu")  # plan on this machine's CPU whatever it has
    simulate_cpu_devices(args.devices)
    profile = DEVICE_PROFILES[args.device]
    device_memory = args.device_memory or profile["memory"]
    overrides = list(args.set) + ([f"mesh={args.mesh}"] if args.mesh else [])
    cfg = load_config(args.config, overrides)
    cfg.devices = 0
    if args.zero_table:
        rows = [plan(dataclasses.replace(cfg, zero=z), profile, device_memory) for z in range(4)]
        return json.dumps(rows) if args.json else format_zero_table(rows)
    if args.compare:
        rows = sorted((plan(dataclasses.replace(cfg, mesh=m), profile, device_memory) for m in args.compare),
                      key=lambda r: -r["roofline"]["mfu_ceiling"])
        return json.dumps(rows) if args.json else format_compare(rows)
    report = plan(cfg, profile, device_memory)
    return json.dumps(report) if args.json else format_plan(report)


def format_zero_table(rows) -> str:
    lines = ["| zero | params measured | formula | optimizer measured | formula | grads measured | formula | "
             "temporaries | total |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, f = r["memory"], r["zero_formula"]
        lines.append(f"| {r['config']['zero']} | {m['parameters']:,} | {f['parameters']:,.0f} | {m['optimizer_state']:,} | "
                     f"{f['optimizer_state']:,.0f} | {m['gradients']:,} | {f['gradients']:,.0f} | "
                     f"{m['temporaries']:,} | {m['total']:,} |")
    return "\n".join(lines)


def format_compare(rows) -> str:
    lines = ["| rank | mesh | fits | total/device | link traffic/device | compute | comm | step >= | MFU ceiling |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        m, roof = r["memory"], r["roofline"]
        traffic = sum(c["traffic_bytes"] for c in r["collectives"].values())
        lines.append(f"| {i} | {r['mesh']} | {'yes' if m['fits'] else 'NO'} | {m['total'] / GB:,.2f} GB | "
                     f"{traffic / GB:,.2f} GB | {roof['compute_s'] * 1e3:,.1f} ms | {roof['comm_s'] * 1e3:,.1f} ms | "
                     f"{roof['step_s'] * 1e3:,.1f} ms | {roof['mfu_ceiling']:.1%} |")
    return "\n".join(lines)



