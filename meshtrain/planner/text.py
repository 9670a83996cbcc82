"""What `python -m meshtrain.plan` prints (meshtrain/planner/aot.py computes it): a plan with each
figure next to its formula, the verdict, the kernels and the layout search, ZeRO's table and the
comparison of meshes, from the plan's dict (the --json output).
"""
from __future__ import annotations

from meshtrain.core.metrics import FP8_MEASURED_OVER_PREDICTED, GROUPED_PARTLY_FILLED, LOW_PEAK_NAMES
from meshtrain.planner import compilers

GB = 1e9


def human_seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def human_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:,.0f} B"


def format_moe(r: dict) -> list[str]:
    moe = r.get("moe")
    if not moe:
        return []
    how = (f"capacity C={moe['capacity']} slots per expert" if moe["capacity"] else
           f"sorted dropless; E-slot buffer would be {human_bytes(moe['slot_buffer_bytes'])}")
    return [f"  MoE dispatch buffer per layer: {human_bytes(moe['bytes'])} ({how})"]


def trainable_note(r: dict) -> str:
    """', trainable 0.42% (LoRA r=16)' when the run trains part of its parameters, else ''."""
    lora = r["config"]["model"]["lora"]
    if not lora["rank"]:  # all trained but a router bias (moved by the step, not the optimizer)
        return ""
    return f", trainable {r['trainable_params'] / 1e6:,.2f}M = {100 * r['trainable_params'] / r['params']:.2f}% " + \
        (f"(LoRA r={lora['rank']})" if lora["rank"] else "")


def format_plan(r: dict) -> str:
    mem, zf, roof = r["memory"], r["zero_formula"], r["roofline"]
    gb = human_bytes
    lines = [f"plan: {r['params'] / 1e6:,.1f}M params{trainable_note(r)} on {r['devices']} devices, mesh {r['mesh']}, "
             f"zero={r['config']['zero']}, {r['config']['precision']}"
             + (f" (layers {r['config']['bf16_layers']} in bf16)" if r["config"].get("bf16_layers") else "")
             + f", remat={r['config']['remat']}, "
             f"{r['config']['microbatches']} microbatch(es)"
             + (" sharing one gather of the weights (parallel.gather_once)" if r["config"].get("gathers_once") else ""),
             *([compilers.summary(r["compiled_for"])] if "compiled_for" in r else []),
             "", "train step memory per device    measured      "
                 f"formula (ZeRO, {r['config'].get('optimizer', 'adamw')})"]
    on_host, layers = mem.get("offload", "none") != "none", mem.get("offload") == "optimizer+params"
    for key, label in (("parameters", "parameters (layers: host)" if layers else "parameters"),
                       ("optimizer_state", "optimizer state (host)" if on_host else "optimizer state"),
                       ("gradients", "gradients (layers: host)" if layers else "gradients")):
        lines.append(f"  {label:<30} {gb(mem[key]):>12}  {gb(zf[key]):>12}")
    if mem["reference"]:
        lines.append(f"  {'reference parameters':<30} {gb(mem['reference']):>12}  (DPO's, GRPO's KL: the frozen "
                     f"initial parameters, laid out as the parameters; no gradient or optimizer state)")
    if mem.get("objective_state"):
        lines.append(f"  {'kept rollout':<30} {gb(mem['objective_state']):>12}  (grpo, rl.updates_per_batch > 1: the "
                     f"rollout's rows and log-probs, for its later updates)")
    if mem["grad_error"]:
        lines.append(f"  {'int8 residuals':<30} {gb(mem['grad_error']):>12}  (error feedback: the local gradient's "
                     f"fp32 bytes, + 1/D of them at zero 0/1)")
    lines.append(f"  {'temporaries':<30} {gb(mem['temporaries']):>12}  "
                 "(activations and gradients, from the compiled step)")
    lines += format_moe(r)
    lines += ["", *format_run_memory(r), "",
              "collectives per device per step   count    payload   link traffic   formula traffic  measured/formula"]
    for kind, c in r["collectives"].items():
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        lines.append(f"  {kind:<30} {c['count']:>7.0f} {gb(c['payload_bytes']):>12} {gb(c['traffic_bytes']):>12} "
                     f"{gb(c['formula_traffic_bytes']):>12} {ratio:>8}{'  FLAGGED' if c['flag'] else ''}  "
                     f"{'; '.join(c['formula'])}")
        if c["flag"]:
            lines.append(f"  {'':<30} FLAGGED: {c['flag']}")
    dp = r["data_parallel"]
    if dp["fp32_bytes"]:
        used = "int8 (in use)" if dp["compression"] == "int8" else "int8 (parallel.grad_compression=int8)"
        lines.append(f"  data-parallel gradient reduction (formula): fp32 {gb(dp['fp32_bytes'])}"
                     f"{' (in use)' if dp['compression'] == 'none' else ''}, {used} {gb(dp['int8_bytes'])}, "
                     f"{dp['ratio']:.3f}x with a scale per {dp['block']} values")
    fix = r["corrections"]
    if any(fix.values()):
        lines.append(f"  corrected for the CPU backend (counted as a GPU runs them): {gb(fix['bf16_widened_bytes'])} "
                     f"widened bf16->f32 counted at bf16; {fix['all_reduce_as_reduce_scatter']:,.0f} all-reduce + "
                     f"slice as reduce-scatters; {gb(fix['all_reduce_reassociated_bytes'])} of all-reduces summed "
                     f"after reduction counted once")
    f, mtp = r["flops"], r["config"]["model"].get("mtp_depth", 0)
    xla = ("none from the GPU compiler" if f["compiled_per_device"] is None else
           f"{f['compiled_per_device']:.3e} (it counts a loop body once, not per layer)")
    lines += [*format_kernels(r.get("kernels")),
              "", f"FLOPs per device per step: model (6N + 12·L·H·K·S per token, MFU's) {f['model_per_device']:.3e}; "
                  f"executed (recompute included, HFU's) {f['hardware_per_device']:.3e}; XLA cost analysis {xla}",
              f"roofline on {roof['device']} ({roof['devices_per_node']} per node, {roof['nodes']} node(s); links at "
              f"their datasheet rates, a group with k devices a node on k NICs: not calibrated on a measured pod):"]
    for axes, link in roof["links"].items():
        if link["traffic_bytes"]:
            lines.append(f"  over {axes:<22} {gb(link['traffic_bytes']):>12} at {link['bandwidth'] / 1e9:,.0f} GB/s "
                         f"({'cross-node' if link['cross_node'] else 'in-node'}): {link['seconds'] * 1e3:,.1f} ms")
    lines += format_kernel_time(roof, r["config"]["precision"])
    lines.append(f"  compute {roof['compute_s'] * 1e3:,.1f} ms"
                 + (f" (bubble {roof['pipeline_bubble']:.1%})" if roof["pipeline_bubble"] else "")
                 + (f" (x {roof['stage_factor']:.3f}: the slowest stage over the mean; the first also runs the "
                    f"embedding's layers, the last the head{' and MTP' if mtp else ''})"
                    if roof.get("stage_factor", 1.0) != 1.0 else "")
                 + f", communication {roof['comm_s'] * 1e3:,.1f} ms, HBM {roof['memory_s'] * 1e3:,.1f} ms"
                 + (f", host link {roof['host_s'] * 1e3:,.1f} ms" if roof.get("host_s") else "") + " -> "
                   f"step >= {roof.get('formula_step_s', roof['step_s']) * 1e3:,.1f} ms at the datasheet peaks "
                   f"({roof['bound']}-bound; {roof['serial_s'] * 1e3:,.1f} ms without overlap)"
                 + (f"; priced by the GPU program's kernels: step {roof['step_s'] * 1e3:,.1f} ms"
                    if roof["priced_by"] == "kernels" else "; priced by these formulas")
                 + f", {'MFU' if roof['priced_by'] == 'kernels' else 'MFU ceiling'} {roof['mfu_ceiling']:.1%}"
                 + (f" ({roof['mfu_fp8_ceiling']:.1%} of the {LOW_PEAK_NAMES[roof['low_peak']]} peak)"
                    if "mfu_fp8_ceiling" in roof else "")
                 + f", {roof['tokens_per_s']:,.0f} tokens/s")
    lines += ["", format_verdict(r), *format_search(r)]
    return "\n".join(lines)


def format_kernel_time(roof: dict, precision: str) -> list[str]:
    """The GPU program's step, kernel by kernel (meshtrain/planner/kernel_time.py), when it priced the step,
    and how far a measured step of `precision`'s fp8 recipe ran from its prediction."""
    if roof["priced_by"] != "kernels":
        return []
    ratio = FP8_MEASURED_OVER_PREDICTED.get(precision)
    fp8 = [f"  {precision}: a step measured on an H200 ran {ratio:.2f}x the walk's prediction (llama_1b; bf16's "
           f"1.00x; benchmarks/RESULTS.md): the recipe's gain over bf16 is overstated here"] if ratio else []
    k, c = roof["kernel_time"], roof["kernel_time"]["by_kind_s"]
    n = k["launches"]
    how = "calibrated" if k.get("calibrated", True) else "NOT calibrated on this GPU: the H100/H200's shares"
    return [f"  GPU kernels ({how}, meshtrain/core/metrics.py KERNEL_CONSTANTS): GEMMs {c['gemm'] * 1e3:,.1f} ms "
            f"({n['gemm']:,.0f}), fused attention {c['attention'] * 1e3:,.1f} ms ({n['attention']:,.0f}), "
            f"memory-bound {c['memory'] * 1e3:,.1f} ms ({n['memory']:,.0f}); "
            f"collectives {c['collectives'] * 1e3:,.1f} ms on their links"
            + (f", host copies {c['host'] * 1e3:,.1f} ms on the host link ({n['host']:,.0f})" if c.get("host") else "")
            + f", {k['exposed_comm_s'] * 1e3:,.1f} ms of it not hidden"
            + (f"; the pipeline's ticks wait {k['pipeline_wait_s'] * 1e3:,.1f} ms for their slowest stage (each tick "
               f"as long as it: the bubble and the stages' imbalance)" if k.get("pipeline_wait_s") else "")
            + f" -> step {k['step_s'] * 1e3:,.1f} ms", *fp8]


def partly_filled(filled: float | None) -> list[str]:
    """The line a plan's grouped GEMMs get when their buffers are partly filled (expert parallelism's worst
    case): such a buffer ran slower on a GPU than the walk prices it (metrics.py GROUPED_PARTLY_FILLED)."""
    if filled is None or filled > 0.9:
        return []
    measured = GROUPED_PARTLY_FILLED
    return [f"    their buffers {filled:.0%} filled (the rows expected of the rows held): one 1/"
            f"{1 / measured['filled']:.0f} filled ran {measured['measured_over_predicted']:.2f}x its price on an "
            f"H200 (2026-12-04 kernels; the programs over empty tiles are not priced), so the step runs slower "
            f"than priced"]


def format_kernels(k: dict | None) -> list[str]:
    """The GPU program's kernels per step (meshtrain/planner/kernels.py)."""
    if not k:
        return []
    by = lambda counts: ", ".join(f"{what} {n:,.0f}" for what, n in sorted(counts.items(), key=lambda i: -i[1]))
    att = k["attention"]
    lines = ["", "kernels per device per step (the GPU program)",
             f"  GEMMs {sum(k['gemms'].values()):,.0f} by operand types: {by(k['gemms']) or 'none'}",
             f"  fused attention (cuDNN): {att['forward']:,.0f} forward, {att['backward']:,.0f} backward",
             *([f"  grouped GEMMs (meshtrain's Triton kernels) {sum(grouped.values()):,.0f}: {by(grouped)}"]
               if (grouped := k.get("grouped_gemms")) else []),
             *partly_filled(k.get("grouped_filled")),
             f"  async collectives {sum(k['collectives'].values()):,.0f}: {by(k['collectives']) or 'none'}",
             f"  other fusions {k['fusions']:,.0f}", "  largest arrays made:"]
    return lines + [f"    {a['shape']:<28} {human_bytes(a['bytes']):>10}  {a['op']}" for a in k["largest"][:5]]


def step_sign(roof: dict) -> str:
    """'step ~' for a step the GPU program's kernels priced (a prediction), 'step >=' for the formulas' bound
    (`roof`: a roofline, or a search candidate, which carries its `priced_by`)."""
    return "step ~" if roof["priced_by"] == "kernels" else "step >="


def format_search(r: dict) -> list[str]:
    """What the search found (meshtrain/planner/fit.py): the fastest fitting layout and its command."""
    found = r.get("search")
    if not found:
        return []
    tried = [c for c in found["compiled"] if "invalid" not in c]
    step = step_sign(tried[0]) if tried else "step"
    lines = [f"search: {len(tried)} layout(s) compiled (at most {found['budget']}: --search-budget), moves "
             f"{' -> '.join(found['path']) or 'none'}"]
    for c in sorted(tried, key=lambda c: (not c["fits"], c["step_s"]))[:8]:
        lines.append(f"  {'fits' if c['fits'] else 'over'}  peak {human_bytes(c['peak']):>11}  {step} "
                     f"{human_seconds(c['step_s']):>10}  {c['layout']}")
    best = found["best"]
    if best is None:
        lines.append("no layout searched fits; raise --search-budget, add devices, or shrink the batch or sequence")
    else:
        lines += [f"fastest that fits: {best['layout']} ({step} {human_seconds(best['step_s'])}, MFU ceiling "
                  f"{best['mfu_ceiling']:.1%})", f"  {best['command']}"]
        if (second := found.get("runner_up")) is not None:
            lines.append(f"runner-up: {second['layout']} ({step} {human_seconds(second['step_s'])}, "
                         f"{second['step_s'] / best['step_s'] - 1:+.1%})")
    return lines


def format_run_memory(r: dict) -> list[str]:
    """The run's programs, compiled, and the memory they run against."""
    gb, mem, ev, gen, b = human_bytes, r["memory"], r["eval_step"], r["generation"], r["budget"]
    on_host = mem.get("offload", "none") != "none"
    kept = [("the optimizer state", 0 if on_host else mem["optimizer_state"]),
            ("int8 compression's residuals", mem["grad_error"]), ("the reference parameters", mem["reference"])]
    kept = [(name, n) for name, n in kept if n]
    resident = (f"with {' and '.join(name for name, _ in kept)} left on the device, {gb(sum(n for _, n in kept))}"
                if kept else "nothing else of the train state on the device")
    held = {"none": "parameters, optimizer state, gradients and temporaries",
            "optimizer": "parameters, gradients and temporaries; the optimizer state in host memory",
            "optimizer+params": "the unstacked parameters and their gradients, a layer's fetched parameters and "
                                "temporaries; the layers' parameters and gradients and the optimizer state in host "
                                "memory"}[mem.get("offload", "none")]
    copies = (f"; XLA:CPU's f32 copies of bf16 loop values, {gb(mem['cpu_copies'])} more there, left out: GPUs "
              f"compute in bf16" if mem["cpu_copies"] else "")
    return ["run memory per device (compiled)",
            f"  train step   {gb(mem['total']):>12}  ({held}{copies})",
            *([f"  eval step    {gb(r['steps']['eval']):>12}  (forward only, {ev['microbatches']} microbatch(es) as "
               f"training; {resident})"] if ev else []),
            *([f"  task scorer  {gb(r['steps']['scoring']):>12}  (eval.tasks: {sc['rows']} rows of {sc['length']:,} "
               f"tokens, forward only; {resident})"] if (sc := r.get("scoring")) else []),
            *([f"  rollout      {gb(r['steps']['rollout']):>12}  (grpo: {ro['rows']} completion rows, prompts "
               f"padded to {ro['prompt_len']:,} tokens + {ro['max_new_tokens']:,} new, the parameters as the train "
               f"state lays them out, in the compute dtype; "
               + (f"KV cache {gb(ro['kv_cache_formula'])} by formula" if ro["kv_cache_formula"] else
                  "no KV cache: rl.sampler=exact")
               + f"; the rest of the train state beside it, {gb(ro['resident_state'])})"] if (ro := r.get("rollout"))
              else []),
            f"  generation   {gb(gen['total']):>12}  ({gen['rows']} prompt(s) of {gen['prompt_len']:,} tokens + "
            f"{gen['max_new_tokens']:,} new, {gen['precision']}, on {gen['mesh']}; "
            + (f"latent KV cache {gb(gen['kv_cache_formula'])} by formula: {gen['kv_cache_terms']})"
               if gen["kv_cache_terms"] else f"KV cache {gb(gen['kv_cache_formula'])} by formula)"),
            f"usable: {gb(b['device_memory'])} x {b['fraction']:.2f} ({b['fraction_source']}) = {gb(b['usable'])}; "
            f"{b['headroom']:.0%} kept free for fragmentation and collective buffers -> budget {gb(b['budget'])}",
            *format_host_memory(r)]


def format_host_memory(r: dict) -> list[str]:
    """parallel.offload's host memory per device against the device's share of its host's (budget.py)."""
    mem, host = r["memory"], r["budget"].get("host")
    if mem.get("offload", "none") == "none" or host is None:
        return []
    gb = human_bytes
    return [f"host memory per device: {gb(mem['host_total'])} ({mem['host_source']}) against "
            f"{gb(host['host_memory'])} a host ({host['source']}) / {host['sharing']} device(s) x "
            f"{1 - host['reserve']:.2f} (kept for the OS and the data pipeline) = {gb(host['budget'])}: "
            + ("fits" if mem["host_total"] <= host["budget"] else "DOES NOT FIT")]


def format_verdict(r: dict) -> str:
    v, b, gb = r["verdict"], r["budget"], human_bytes
    of = {"generation": "generation", "scoring": "task scorer"}.get(v["peak_of"], f"{v['peak_of']} step")
    peak = f"peak {gb(v['peak'])} ({of})"
    if v["status"] == "fits":
        return f"verdict: FITS in {gb(b['budget'])}: {peak}, margin {gb(v['margin'])}"
    if v["status"] == "tight":
        return (f"verdict: TIGHT: {peak} fits the usable {gb(b['usable'])} with {gb(b['usable'] - v['peak'])} "
                f"to spare, less than the {b['headroom']:.0%} headroom ({gb(b['usable'] - b['budget'])})")
    if (h := v.get("host")) and not h["fits"]:  # format_host_memory
        device = "fits" if v["margin"] >= 0 else "does not fit either" if v["peak"] > b["usable"] else "is tight"
        return (f"verdict: DOES NOT FIT in host memory: {gb(h['peak'])} per device, {gb(h['peak'] - h['budget'])} "
                f"over its share {gb(h['budget'])}; the device's {peak} {device}")
    if v["peak_of"] == "generation" and (training := max(r["steps"].get(k, 0) for k in ("train", "eval"))) \
            <= b["budget"]:  # the training run fits: the generate command is what does not, on these devices
        halved = " or in bf16 (generate.precision=bf16)" if r["generation"]["precision"] == "fp32" else ""
        return (f"verdict: DOES NOT FIT in {gb(b['usable'])}: {peak}, {gb(-v['margin'])} over the budget; training "
                f"fits (its peak {gb(training)}): generate on more devices (python -m meshtrain.generate --mesh)"
                f"{halved}")
    return (f"verdict: DOES NOT FIT in {gb(b['usable'])}: {peak}, {gb(-v['margin'])} over the budget; the train "
            f"step's largest consumer is {r['memory']['largest']}")


def format_layout_search(r: dict, devices: int) -> str:
    """`--fit` from a config whose own layout does not divide: why, and what the search found."""
    return "\n".join([f"plan: the config's layout is not valid on {devices} devices ({r['layout_error']}); "
                      f"searching the layouts that are", compilers.summary(r["compiled_for"]), "", *format_search(r)])


def format_zero_table(rows) -> str:
    lines = ["| zero | params measured | formula | optimizer measured | formula | grads measured | formula | "
             "temporaries | total |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, f = r["memory"], r["zero_formula"]
        lines.append(f"| {r['config']['zero']} | {m['parameters']:,} | {f['parameters']:,.0f} | "
                     f"{m['optimizer_state']:,} | {f['optimizer_state']:,.0f} | "
                     f"{m['gradients']:,} | {f['gradients']:,.0f} | {m['temporaries']:,} | {m['total']:,} |")
    return "\n".join(lines)


def format_compare(rows, skipped=()) -> str:
    step = step_sign(rows[0]["roofline"]) if rows else "step >="
    mfu = "MFU" if step == "step ~" else "MFU ceiling"  # a kernel-priced step's MFU is a prediction, not a ceiling
    lines = [f"| rank | mesh | verdict | peak/device | link traffic/device | compute | comm | {step} | {mfu} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        v, roof = r["verdict"], r["roofline"]
        traffic = sum(c["traffic_bytes"] for c in r["collectives"].values())
        label = " ".join([r["mesh"], *r.get("settings", ())])
        lines.append(f"| {i} | {label} | {v['status']} | {v['peak'] / GB:,.2f} GB ({v['peak_of']}) | "
                     f"{traffic / GB:,.2f} GB | {roof['compute_s'] * 1e3:,.1f} ms | {roof['comm_s'] * 1e3:,.1f} ms | "
                     f"{roof['step_s'] * 1e3:,.1f} ms | {roof['mfu_ceiling']:.1%} |")
    lines += [f"skipped {s['mesh']}: {s['reason']}" for s in skipped]
    return "\n".join(lines)
