"""The planner behind `python -m meshtrain.plan --config ...`: compile the real train step for a
target mesh and report memory, collectives, kernels, FLOPs and a roofline, each next to its
analytical formula.

The compiler is the pod's (meshtrain/planner/compilers.py): XLA's GPU compiler on compile-only
devices of the target GPU when the plan-gpu extra is installed, so memory is the GPU's buffer
assignment and the collectives and kernels are the GPU program's; else XLA:CPU on simulated devices,
whose program is corrected where it differs from a GPU's (the f32 copies below; meshtrain/planner/hlo.py
for the collectives). Formulas: meshtrain/planner/traffic.py (collectives), meshtrain/core/formulas.py
(ZeRO memory), meshtrain/parallel/schedules.py (bubble). Roofline: meshtrain/planner/roofline.py (each mesh
axis's traffic on the in-node or cross-node link it crosses, compute with recompute and the lockstep bubble,
an HBM floor).
"""
from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from meshtrain.config.loader import load_config
from meshtrain.config.validate import check_train_size
from meshtrain.core import formulas
from meshtrain.core.errors import LayoutError, UserError
from meshtrain.core.metrics import DEVICE_PROFILES
from meshtrain.engine.program import TrainProgram
from meshtrain.parallel.mesh import build_mesh, describe, parse_mesh
from meshtrain.parallel.sharding import make_rules
from meshtrain.planner import compilers, fit, hlo, kernel_time, kernels, traffic
from meshtrain.planner import roofline as roof
from meshtrain.planner.budget import budget, memory_fraction, verdict
from meshtrain.planner.hlo import KINDS
from meshtrain.planner.traffic import on_gpu

GB = 1e9
# XLA's CPU backend widens bf16 arithmetic to f32 and while-loop-invariant code motion then hoists
# f32 copies of the stacked bf16 residuals (and the layer inputs remat keeps) out of the backward
# loop: +25-50% temporaries that GPUs and TPUs, computing in bf16, never allocate. Memory is read
# from a compile with that pass off; collectives from the default compile (the pass also hoists
# loop-invariant gathers, as a GPU's does).
CPU_F32_COPIES = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# The plan command's process compiles and never runs what it compiles, so it asks XLA:CPU for the
# fastest compile, not the fastest code: LLVM at -O0, which changes no buffer and no HLO (every shipped
# config's plan on its pod gives the same bytes and collectives, 1.16-1.39x sooner: docs/planner.md). Not XLA's
# elemental fusion emitters, though faster still (the test suite uses them): they move the temporaries
# (qwen3_30b_a3b's train step -1.4%).
ANALYSIS_ONLY_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def compile_for_analysis_only(environ) -> None:
    """Add ANALYSIS_ONLY_XLA_FLAGS to `environ`'s XLA_FLAGS, each unless the user set that flag: for a
    process that only compiles, before JAX starts its CPU backend (which reads XLA_FLAGS once)."""
    flags = environ.get("XLA_FLAGS", "").split()
    named = {f.split("=")[0] for f in flags}
    environ["XLA_FLAGS"] = " ".join(flags + [f for f in ANALYSIS_ONLY_XLA_FLAGS if f.split("=")[0] not in named])


def cpu_widened(program) -> bool:
    """Whether XLA:CPU's f32 copies of bf16/fp16 loop values are to be left out (CPU_F32_COPIES)."""
    return program.plan.precision != "fp32" and not on_gpu(program)


def shard_bytes(tree, shardings) -> int:
    return int(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))))


def compiled_memory(lowered, widened: bool, default=None) -> dict:
    """Temporaries and the total per device (arguments + outputs - donated aliases + temporaries)
    of a lowered program; with `widened` (bf16/fp16 compute), compiled without the CPU-only f32
    copies (CPU_F32_COPIES), and `cpu_copies` the bytes the default compile (`default`, a compiled
    program, when given) holds more."""
    compiled = lowered.compile(compiler_options=CPU_F32_COPIES) if widened else (default or lowered.compile())
    ma = compiled.memory_analysis()
    temporaries = int(ma.temp_size_in_bytes)
    out = {"temporaries": temporaries, "arguments": int(ma.argument_size_in_bytes),
           "outputs": int(ma.output_size_in_bytes),
           "total": int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + temporaries),
           "cpu_copies": 0}
    if widened and default is not None:
        out["cpu_copies"] = max(0, int(default.memory_analysis().temp_size_in_bytes) - temporaries)
    return out


def eval_step_memory(program) -> dict:
    """The trainer's eval step (TrainProgram.eval_step: the train step's microbatches, forward
    only) compiled on the same mesh, its parameters included."""
    batch = jax.ShapeDtypeStruct(program.batch_shape, jnp.int32, sharding=program.batch_sharding)
    with program.context():
        lowered = program.eval_step().lower(program.abstract_state["params"], batch,
                                            *program.eval_inputs(program.abstract_state))
    return {**compiled_memory(lowered, cpu_widened(program)),
            "microbatches": program.plan.num_microbatches(program.sizes["pipeline"])}


def scoring_memory(program) -> dict:
    """The in-loop task scorer of eval.tasks (meshtrain/engine/scoring.py `for_program`: a training
    microbatch's rows, the parameters in the train state's layout) compiled on the same mesh, at the
    longest window it takes, train.seq_len (the run sizes it to its tasks' longest request)."""
    from meshtrain.engine import scoring

    scorer = scoring.for_program(program)
    shape = (scorer.rows, scorer.length)
    ids = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=scorer.row_sharding)
    mask = jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=scorer.row_sharding)
    with scorer.context():
        lowered = scorer.program.lower(program.abstract_state["params"], ids, ids, mask)
    return {**compiled_memory(lowered, cpu_widened(program)), "rows": scorer.rows,
            "length": scorer.length}


def generation_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """The mesh generation runs on: the plan's, with `pipeline` and `context` (which decoding does
    not use, meshtrain/generate.py) folded into `data`."""
    folded = {**sizes, "pipeline": 1, "context": 1}
    folded["data"] = sizes["data"] * sizes["pipeline"] * sizes["context"]
    return folded


def generation_memory(cfg, program) -> dict:
    """`python -m meshtrain.generate` for generate.batch_size prompts of train.seq_len tokens (the
    longest it takes) and generate.max_new_tokens new ones, on the plan's devices
    (`generation_sizes`), compiled: its total per device, and the KV cache by formula
    (formulas.kv_cache_bytes, fp32): keys and values [layers, rows, positions, kv heads, head dim]
    (a sliding-window layer's positions its window's) split over the batch axes and tensor, or MLA's
    latent [layers, rows, positions, kv_lora_rank + qk_rope_head_dim], which has no heads to split
    over tensor."""
    from meshtrain.engine import decode
    from meshtrain.models import FAMILIES

    sizes = generation_sizes(program.sizes)
    model = FAMILIES[cfg.model.family](cfg.model)
    mesh = build_mesh(sizes, list(program.mesh.devices.flat))
    prompt, new, rules = cfg.train.seq_len, cfg.generate.max_new_tokens, make_rules()
    rows = decode.padded_rows(cfg.generate.batch_size, mesh, rules)
    out = compiled_memory(decode.lower(model, mesh, cfg.generate.batch_size, prompt, new, rules), False)
    m = model.cfg
    positions = prompt + new - 1
    split = math.prod(sizes[a] for a in rules["batch"]) * (1 if m.latent_cache else sizes["tensor"])
    cache = formulas.kv_cache_bytes(m.cached_positions(positions), rows, m.cached_values(), split)
    terms = (f"{m.num_layers} layers x {positions:,} positions x {rows} rows x ({m.kv_lora_rank} kv_lora_rank + "
             f"{m.qk_rope_head_dim} qk_rope_head_dim) x 4 bytes / {split}" if m.latent_cache else None)
    return {**out, "mesh": describe(sizes), "rows": rows, "prompt_len": prompt, "max_new_tokens": new,
            "kv_cache_formula": cache, "kv_cache_terms": terms}


def format_moe(r: dict) -> list[str]:
    moe = r.get("moe")
    if not moe:
        return []
    how = (f"capacity C={moe['capacity']} slots per expert" if moe["capacity"] else
           f"sorted dropless; E-slot buffer would be {human_bytes(moe['slot_buffer_bytes'])}")
    return [f"  MoE dispatch buffer per layer: {human_bytes(moe['bytes'])} ({how})"]


def named_tokenizer_eos(dcfg) -> int | None:
    """The EOS id data.document_mask splits at without data.eos_id, where it is known without the
    data: data.tokenizer's when it names a tokenizer file ('auto' is the data's, 'byte' has none)."""
    if not dcfg.document_mask or dcfg.eos_id >= 0 or dcfg.tokenizer in ("auto", "byte"):
        return None
    from meshtrain.data import tokenizer as tokenizer_lib

    return tokenizer_lib.load(dcfg.tokenizer).eos_id


def train_step_plan(cfg, profile: dict, devices_per_node: int | None = None, devices=None) -> dict:
    """The train step compiled for the config's mesh on `devices` (compile-only GPU devices or CPU
    devices: meshtrain/planner/compilers.py; default the process's): memory, collectives beside their
    formulas, the GPU program's kernels, FLOPs and the roofline (`plan` adds the eval step, generation
    and the verdict)."""
    program = TrainProgram.from_config(cfg, devices=devices, tokenizer_eos=named_tokenizer_eos(cfg.data))
    check_train_size(program, (profile["memory"], f"one {profile['name']} has"))  # before an endless compile
    lowered = program.lower()
    compiled = lowered.compile()
    train_memory = compiled_memory(lowered, cpu_widened(program), default=compiled)
    gpu, text = on_gpu(program), compiled.as_text()
    mesh, sizes, n = program.mesh, program.sizes, program.mesh.size
    state, shardings = program.abstract_state, program.state_shardings
    grad_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), program.grad_specs,
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    memory = {"parameters": shard_bytes(state["params"], shardings["params"]),
              "optimizer_state": shard_bytes(state["opt_state"], shardings["opt_state"]),
              "gradients": shard_bytes(program.trained(state["params"]), grad_shardings),
              "temporaries": train_memory["temporaries"], "total": train_memory["total"],
              "cpu_copies": train_memory["cpu_copies"],
              "grad_error": shard_bytes(state["grad_error"], shardings["grad_error"]) if "grad_error" in state else 0,
              # DPO's frozen reference (meshtrain/engine/dpo.py): one more copy of the parameters, no state
              "reference": shard_bytes(state["reference"], shardings["reference"]) if "reference" in state else 0}
    consumers = {"parameters": memory["parameters"], "optimizer state": memory["optimizer_state"],
                 "activations and temporaries (gradients included)": memory["temporaries"]}
    memory["largest"] = max(consumers, key=consumers.get)

    records = hlo.read(text, n, correct=not gpu)  # the GPU's program needs no CPU corrections
    measured = hlo.by_kind(records)
    expected = traffic.expected_traffic(program)
    compared = traffic.compare(measured, expected, gaps=traffic.known_gaps(program))
    comms = {k: {**measured[k], "formula_traffic_bytes": expected[k]["traffic_bytes"], "formula": expected[k]["terms"],
                 "ratio": compared[k]["ratio"], "within": compared[k]["within"], "flag": compared[k]["flag"]}
             for k in KINDS}

    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}  # the GPU compiler's is empty
    t, par = cfg.train, cfg.parallel
    read_once = SimpleNamespace(argument_size_in_bytes=train_memory["arguments"],  # the HBM floor's bytes
                                temp_size_in_bytes=memory["temporaries"], output_size_in_bytes=train_memory["outputs"])
    roofline = roof.estimate(program, read_once, records, profile, devices_per_node)
    if gpu:  # the GPU program's kernels price the step; the CPU's program has none (the formulas do)
        roofline = kernel_time.price(text, records, sizes, profile, devices_per_node or profile["devices_per_node"],
                                     roofline)
    flops = {"compiled_per_device": float(cost["flops"]) if "flops" in cost else None,
             "model_per_device": roofline["flops"]["model_per_device"],
             "hardware_per_device": roofline["flops"]["hardware_per_device"]}
    return {"config": {"model": dataclasses.asdict(program.model.cfg), "batch_size": t.batch_size, "seq_len": t.seq_len,
                       "precision": par.precision, "zero": par.zero, "remat": par.remat,
                       "attention": par.attention, "context_strategy": par.context_strategy,
                       "ulysses_degree": par.ulysses_degree, "sequence_parallel": par.sequence_parallel,
                       "grad_compression": par.grad_compression, "optimizer": cfg.optim.optimizer,
                       "microbatches": par.num_microbatches(sizes["pipeline"])},
            "mesh": describe(sizes), "devices": n, "params": program.num_params,
            "trainable_params": program.trainable_params, "memory": memory,
            "zero_formula": zero_formula(program),
            "collectives": comms,
            "data_parallel": traffic.data_parallel_traffic(program), "corrections": hlo.corrections(records),
            "flops": flops, "roofline": roofline, "_program": program,
            **({"kernels": kernels.read(text)} if gpu else {}),
            **({"moe": moe} if (moe := traffic.moe_dispatch(program)) else {})}


def zero_formula(program) -> dict:
    """ZeRO's bytes per device (`formulas.zero_bytes`): the parameters all of them, the gradients
    and the optimizer state those of the trained parameters (LoRA: the adapters) only."""
    sizes, zero = program.sizes, program.plan.zero
    every = formulas.zero_bytes(program.num_params, sizes, zero, traffic.stage_replicated_params(program),
                                traffic.expert_params(program))
    trained = formulas.zero_bytes(program.trainable_params, sizes, zero,
                                  traffic.stage_replicated_params(program, trained=True),
                                  traffic.expert_params(program, trained=True), program.optimizer_state_bytes())
    return {**trained, "parameters": every["parameters"]}


def trainable_note(r: dict) -> str:
    """', trainable 0.42% (LoRA r=16)' when the run trains part of its parameters, else ''."""
    lora = r["config"]["model"]["lora"]
    if not lora["rank"]:  # all trained but a router bias (moved by the step, not the optimizer)
        return ""
    return f", trainable {r['trainable_params'] / 1e6:,.2f}M = {100 * r['trainable_params'] / r['params']:.2f}% " + \
        (f"(LoRA r={lora['rank']})" if lora["rank"] else "")


def plan(cfg, profile: dict, memory_budget: dict, devices_per_node: int | None = None, devices=None) -> dict:
    """One verdict for the run: the train step (`train_step_plan`), the eval step, the task scorer
    (when eval.tasks are set) and generation, compiled on the same devices, the largest against the
    budget (meshtrain/planner/budget.py)."""
    report = train_step_plan(cfg, profile, devices_per_node, devices)
    program, mem = report.pop("_program"), report["memory"]
    # The eval step and the scorer take the parameters only; the rest of the train state (the
    # optimizer state, int8 compression's residuals) stays on the device beside them.
    resident = mem["optimizer_state"] + mem["grad_error"] + mem["reference"]
    gen = generation_memory(cfg, program)
    steps = {"train": mem["total"], "generation": gen["total"]}
    # DPO's eval step takes the reference copy as an argument: its compiled memory holds it
    resident_eval = resident - (mem["reference"] if program.eval_inputs(program.abstract_state) else 0)
    ev = {**eval_step_memory(program), "resident_state": resident_eval}
    steps["eval"] = ev["total"] + resident_eval
    if cfg.eval.tasks:
        report["scoring"] = {**scoring_memory(program), "resident_state": resident}
        steps["scoring"] = report["scoring"]["total"] + resident
    peak_of = max(steps, key=steps.get)
    run_verdict = {**verdict(steps[peak_of], memory_budget), "peak_of": peak_of}
    report["memory"].update(device_memory=memory_budget["device_memory"], fits=run_verdict["status"] != "does not fit")
    return {**report, "eval_step": ev, "generation": gen, "steps": steps, "budget": memory_budget,
            "verdict": run_verdict}


def human_seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def human_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:,.0f} B"


def format_plan(r: dict) -> str:
    mem, zf, roof = r["memory"], r["zero_formula"], r["roofline"]
    gb = human_bytes
    lines = [f"plan: {r['params'] / 1e6:,.1f}M params{trainable_note(r)} on {r['devices']} devices, mesh {r['mesh']}, "
             f"zero={r['config']['zero']}, {r['config']['precision']}, remat={r['config']['remat']}, "
             f"{r['config']['microbatches']} microbatch(es)",
             *([compilers.summary(r["compiled_for"])] if "compiled_for" in r else []),
             "", "train step memory per device    measured      "
                 f"formula (ZeRO, {r['config'].get('optimizer', 'adamw')})"]
    for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"),
                       ("gradients", "gradients")):
        lines.append(f"  {label:<30} {gb(mem[key]):>12}  {gb(zf[key]):>12}")
    if mem["reference"]:
        lines.append(f"  {'DPO reference parameters':<30} {gb(mem['reference']):>12}  (the frozen initial parameters, "
                     f"laid out as the parameters; no gradient or optimizer state)")
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
              f"roofline on {roof['device']} ({roof['devices_per_node']} per node, {roof['nodes']} node(s)):"]
    for axes, link in roof["links"].items():
        if link["traffic_bytes"]:
            lines.append(f"  over {axes:<22} {gb(link['traffic_bytes']):>12} at {link['bandwidth'] / 1e9:,.0f} GB/s "
                         f"({'cross-node' if link['cross_node'] else 'in-node'}): {link['seconds'] * 1e3:,.1f} ms")
    lines += format_kernel_time(roof)
    lines.append(f"  compute {roof['compute_s'] * 1e3:,.1f} ms"
                 + (f" (bubble {roof['pipeline_bubble']:.1%})" if roof["pipeline_bubble"] else "")
                 + (f" (x {roof['stage_factor']:.3f}: the slowest stage over the mean; the first also runs the "
                    f"embedding's layers, the last the head{' and MTP' if mtp else ''})"
                    if roof.get("stage_factor", 1.0) != 1.0 else "")
                 + f", communication {roof['comm_s'] * 1e3:,.1f} ms, HBM {roof['memory_s'] * 1e3:,.1f} ms -> "
                   f"step >= {roof.get('formula_step_s', roof['step_s']) * 1e3:,.1f} ms at the datasheet peaks "
                   f"({roof['bound']}-bound; {roof['serial_s'] * 1e3:,.1f} ms without overlap)"
                 + (f"; priced by the GPU program's kernels: step {roof['step_s'] * 1e3:,.1f} ms"
                    if roof["priced_by"] == "kernels" else "; priced by these formulas")
                 + f", {'MFU' if roof['priced_by'] == 'kernels' else 'MFU ceiling'} {roof['mfu_ceiling']:.1%}"
                 + (f" ({roof['mfu_fp8_ceiling']:.1%} of the fp8 peak)" if "mfu_fp8_ceiling" in roof else "")
                 + f", {roof['tokens_per_s']:,.0f} tokens/s")
    lines += ["", format_verdict(r), *format_search(r)]
    return "\n".join(lines)


def format_kernel_time(roof: dict) -> list[str]:
    """The GPU program's step, kernel by kernel (meshtrain/planner/kernel_time.py), when it priced the step."""
    if roof["priced_by"] != "kernels":
        return []
    k, c = roof["kernel_time"], roof["kernel_time"]["by_kind_s"]
    n = k["launches"]
    return [f"  GPU kernels (calibrated, meshtrain/core/metrics.py KERNEL_CONSTANTS): GEMMs {c['gemm'] * 1e3:,.1f} ms "
            f"({n['gemm']:,.0f}), fused attention {c['attention'] * 1e3:,.1f} ms ({n['attention']:,.0f}), "
            f"memory-bound {c['memory'] * 1e3:,.1f} ms ({n['memory']:,.0f}); "
            f"collectives {c['collectives'] * 1e3:,.1f} ms on their links, {k['exposed_comm_s'] * 1e3:,.1f} ms of "
            f"it not hidden -> step {k['step_s'] * 1e3:,.1f} ms"]


def format_kernels(k: dict | None) -> list[str]:
    """The GPU program's kernels per step (meshtrain/planner/kernels.py)."""
    if not k:
        return []
    by = lambda counts: ", ".join(f"{what} {n:,.0f}" for what, n in sorted(counts.items(), key=lambda i: -i[1]))
    att = k["attention"]
    lines = ["", "kernels per device per step (the GPU program)",
             f"  GEMMs {sum(k['gemms'].values()):,.0f} by operand types: {by(k['gemms']) or 'none'}",
             f"  fused attention (cuDNN): {att['forward']:,.0f} forward, {att['backward']:,.0f} backward",
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
    return lines


def format_run_memory(r: dict) -> list[str]:
    """The run's programs, compiled, and the memory they run against."""
    gb, mem, ev, gen, b = human_bytes, r["memory"], r["eval_step"], r["generation"], r["budget"]
    held = "the optimizer state" + (" and int8 compression's residuals" if mem["grad_error"] else "")
    held += " and the DPO reference" if mem["reference"] else ""
    resident = f"with {held} left on the device, {gb(mem['optimizer_state'] + mem['grad_error'] + mem['reference'])}"
    copies = (f"; XLA:CPU's f32 copies of bf16 loop values, {gb(mem['cpu_copies'])} more there, left out: GPUs "
              f"compute in bf16" if mem["cpu_copies"] else "")
    return ["run memory per device (compiled)",
            f"  train step   {gb(mem['total']):>12}  (parameters, optimizer state, gradients and temporaries{copies})",
            *([f"  eval step    {gb(r['steps']['eval']):>12}  (forward only, {ev['microbatches']} microbatch(es) as "
               f"training; {resident})"] if ev else []),
            *([f"  task scorer  {gb(r['steps']['scoring']):>12}  (eval.tasks: {sc['rows']} rows of {sc['length']:,} "
               f"tokens, forward only; {resident})"] if (sc := r.get("scoring")) else []),
            f"  generation   {gb(gen['total']):>12}  ({gen['rows']} prompt(s) of {gen['prompt_len']:,} tokens + "
            f"{gen['max_new_tokens']:,} new, fp32, on {gen['mesh']}; "
            + (f"latent KV cache {gb(gen['kv_cache_formula'])} by formula: {gen['kv_cache_terms']})"
               if gen["kv_cache_terms"] else f"KV cache {gb(gen['kv_cache_formula'])} by formula)"),
            f"usable: {gb(b['device_memory'])} x {b['fraction']:.2f} ({b['fraction_source']}) = {gb(b['usable'])}; "
            f"{b['headroom']:.0%} kept free for fragmentation and collective buffers -> budget {gb(b['budget'])}"]


def format_verdict(r: dict) -> str:
    v, b, gb = r["verdict"], r["budget"], human_bytes
    of = {"generation": "generation", "scoring": "task scorer"}.get(v["peak_of"], f"{v['peak_of']} step")
    peak = f"peak {gb(v['peak'])} ({of})"
    if v["status"] == "fits":
        return f"verdict: FITS in {gb(b['budget'])}: {peak}, margin {gb(v['margin'])}"
    if v["status"] == "tight":
        return (f"verdict: TIGHT: {peak} fits the usable {gb(b['usable'])} with {gb(b['usable'] - v['peak'])} "
                f"to spare, less than the {b['headroom']:.0%} headroom ({gb(b['usable'] - b['budget'])})")
    return (f"verdict: DOES NOT FIT in {gb(b['usable'])}: {peak}, {gb(-v['margin'])} over the budget; the train "
            f"step's largest consumer is {r['memory']['largest']}")


def run(args) -> str:
    profile = DEVICE_PROFILES[args.device]
    target = compilers.choose(args.compiler, args.device, args.devices,
                              args.devices_per_node or profile["devices_per_node"])
    fraction, source = memory_fraction(profile, args.mem_fraction)
    memory_budget = budget(args.device_memory or profile["memory"], fraction, args.headroom, source)
    overrides = list(args.set) + ([f"parallel.mesh={args.mesh}"] if args.mesh else [])
    cfg = load_config(args.config, overrides)
    cfg.devices = 0
    with target.compiling():
        return _run(args, cfg, overrides, target, profile, memory_budget)


def _run(args, cfg, overrides: list[str], target, profile: dict, memory_budget: dict) -> str:
    compiled_for, devices = target.describe(), target.devices
    if args.zero_table:
        rows = [{**plan(with_plan(cfg, zero=z), profile, memory_budget, args.devices_per_node, devices),
                 "compiled_for": compiled_for} for z in range(4)]
        return json.dumps(rows) if args.json else "\n".join([compilers.summary(compiled_for), format_zero_table(rows)])
    if args.compare:
        rows, skipped = [], []
        for entry in args.compare:  # a mesh, then any KEY=VALUE settings of its own (as --set)
            mesh, *settings = entry.split()
            try:
                entry_cfg = load_config(args.config, [*overrides, f"parallel.mesh={mesh}", *settings]) if settings \
                    else with_plan(cfg, mesh=mesh)
                entry_cfg.devices = 0
                row = plan(entry_cfg, profile, memory_budget, args.devices_per_node, devices)
                rows.append({**row, "settings": settings})
            except UserError as e:
                skipped.append({"mesh": entry, "reason": str(e)})
        rows.sort(key=lambda r: -r["roofline"]["mfu_ceiling"])
        return (json.dumps({"plans": rows, "skipped": skipped, "compiled_for": compiled_for}) if args.json else
                "\n".join([compilers.summary(compiled_for), format_compare(rows, skipped)]))
    try:
        report = {**plan(cfg, profile, memory_budget, args.devices_per_node, devices), "compiled_for": compiled_for}
    except LayoutError as e:  # the config's layout does not divide: --fit searches the valid ones
        if not (args.fit and args.search_budget):
            raise
        report = {"layout_error": str(e), "compiled_for": compiled_for}
    if args.search_budget and (args.fit or report["verdict"]["status"] != "fits"):
        per_node = args.devices_per_node or profile["devices_per_node"]
        starts, known = fit.valid_layouts(cfg, args.devices, per_node, "gpu" if target.gpu else "cpu"), {}
        if "verdict" in report:  # the config's own layout, planned above: the first start
            base = fit.Layout.of(cfg, parse_mesh(cfg.parallel.mesh, args.devices))
            starts = [base, *(s for s in starts if s != base)]
            known[base] = {"layout": base, "peak": report["memory"]["total"], "step_s": report["roofline"]["step_s"],
                           "fits": report["memory"]["total"] <= memory_budget["budget"],
                           "mfu_ceiling": report["roofline"]["mfu_ceiling"],
                           "priced_by": report["roofline"]["priced_by"]}
        found = fit.search(cfg, starts, profile, memory_budget, args.search_budget, args.devices_per_node, known,
                           devices, measure=train_step_plan)
        report["search"] = {"best": found["best"] and search_row(found["best"], args, cfg),
                            "compiled": [search_row(r, args, cfg) for r in found["compiled"]],
                            "path": found["path"], "budget": args.search_budget}
    if args.json:
        return json.dumps(report)
    return format_plan(report) if "verdict" in report else format_layout_search(report, args.devices)


def format_layout_search(r: dict, devices: int) -> str:
    """`--fit` from a config whose own layout does not divide: why, and what the search found."""
    return "\n".join([f"plan: the config's layout is not valid on {devices} devices ({r['layout_error']}); "
                      f"searching the layouts that are", compilers.summary(r["compiled_for"]), "", *format_search(r)])


def search_row(r: dict, args, cfg) -> dict:
    layout = r["layout"]
    row = {"layout": fit.describe_layout(layout), "settings": layout.settings()}
    if "invalid" in r:
        return {**row, "invalid": r["invalid"]}
    return {**row, "peak": r["peak"], "fits": r["fits"], "step_s": r["step_s"], "mfu_ceiling": r["mfu_ceiling"],
            "priced_by": r["priced_by"],
            "command": fit.command(args.config, list(args.set), cfg, layout)}


def with_plan(cfg, **changes):
    """The config with some ParallelPlan settings changed."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **changes))


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



