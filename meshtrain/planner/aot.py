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
from jax.errors import JaxRuntimeError
from jax.sharding import NamedSharding

from meshtrain.config.loader import load_config
from meshtrain.config.validate import check_train_size, resolve_attention
from meshtrain.core import formulas
from meshtrain.core.errors import LayoutError, UserError
from meshtrain.core.metrics import DEVICE_PROFILES, devices_per_host
from meshtrain.engine.compiler_options import flag_name, named_xla_flags
from meshtrain.engine.program import TrainProgram
from meshtrain.objectives.grpo import longest_prompt, prompts_per_batch
from meshtrain.ops import offload
from meshtrain.ops.attention import MIN_ATTENTION_BLOCK, attention_block
from meshtrain.ops.precision import compute_bytes
from meshtrain.parallel.mesh import build_mesh, describe, parse_mesh
from meshtrain.parallel.sharding import make_rules, shard_bytes
from meshtrain.planner import compilers, fit, hlo, kernel_time, kernels, known_gaps, ticks, traffic
from meshtrain.planner import roofline as roof
from meshtrain.planner.budget import budget, host_budget, memory_fraction, verdict
from meshtrain.planner.hlo import KINDS
from meshtrain.planner.text import format_compare, format_layout_search, format_plan, format_zero_table
from meshtrain.planner.traffic import on_gpu

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
    named = named_xla_flags(environ)
    environ["XLA_FLAGS"] = " ".join(environ.get("XLA_FLAGS", "").split()
                                    + [f for f in ANALYSIS_ONLY_XLA_FLAGS if flag_name(f) not in named])


def cpu_widened(program) -> bool:
    """Whether XLA:CPU's f32 copies of bf16/fp16 loop values are to be left out (CPU_F32_COPIES)."""
    return program.plan.precision != "fp32" and not on_gpu(program)


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
           # host memory space (the GPU program's S(5) buffers: parallel.offload's state); XLA:CPU has one memory
           "host": int(sum(getattr(ma, f"host_{k}_size_in_bytes", 0) for k in ("argument", "output", "temp"))
                       - getattr(ma, "host_alias_size_in_bytes", 0)),
           "cpu_copies": 0}
    if widened and default is not None:
        out["cpu_copies"] = max(0, int(default.memory_analysis().temp_size_in_bytes) - temporaries)
    return out


def eval_step_memory(program) -> dict:
    """The trainer's eval step (TrainProgram.eval_step: the train step's microbatches, forward
    only) compiled on the same mesh, its parameters included."""
    batch = jax.ShapeDtypeStruct(program.batch_shape, jnp.int32, sharding=program.batch_sharding)
    with program.context():
        extra = program.eval_inputs(program.abstract_state)
        lowered = program.eval_step().lower(program.abstract_state["params"], batch, *extra)
    if program.plan.offload == "optimizer+params" and on_gpu(program):  # the layers' parameters: host arguments
        offload.mark_host_arguments(lowered, jax.tree.leaves(program.host_params) + [False] * (
            1 + len(jax.tree.leaves(extra))))
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
    (`generation_sizes`), its parameters in generate.precision's dtype, compiled: its total per device,
    and the KV cache by formula (formulas.kv_cache_bytes, in that dtype): keys and values [layers,
    rows, positions, kv heads, head dim] (a sliding-window layer's positions its window's) split over
    the batch axes and tensor, or MLA's latent [layers, rows, positions, kv_lora_rank +
    qk_rope_head_dim], which has no heads to split over tensor."""
    from meshtrain.engine import decode
    from meshtrain.models import FAMILIES

    sizes = generation_sizes(program.sizes)
    model = FAMILIES[cfg.model.family](cfg.model)
    mesh = build_mesh(sizes, list(program.mesh.devices.flat))
    prompt, new, rules = cfg.train.seq_len, cfg.generate.max_new_tokens, make_rules()
    rows = decode.padded_rows(cfg.generate.batch_size, mesh, rules)
    held = cfg.generate.precision
    out = compiled_memory(decode.lower(model, mesh, cfg.generate.batch_size, prompt, new, rules, held=held), False)
    m, value_bytes = model.cfg, compute_bytes(held)
    positions = prompt + new - 1
    split = math.prod(sizes[a] for a in rules["batch"]) * (1 if m.latent_rank() else sizes["tensor"])
    cache = formulas.kv_cache_bytes(m.cached_positions(positions), rows, m.cached_values(), split, value_bytes)
    terms = (f"{m.num_layers} layers x {positions:,} positions x {rows} rows x ({m.kv_lora_rank} kv_lora_rank + "
             f"{m.qk_rope_head_dim} qk_rope_head_dim) x {value_bytes} bytes / {split}" if m.latent_rank() else None)
    return {**out, "mesh": describe(sizes), "rows": rows, "prompt_len": prompt, "max_new_tokens": new,
            "precision": held, "kv_cache_formula": cache, "kv_cache_terms": terms}


def rollout_memory(cfg, program) -> dict:
    """train.objective=grpo's sampler (meshtrain/engine/rollout.py) compiled on the training mesh:
    train.batch_size completion rows (or the held-out prompts' greedy ones, where more) of prompts
    padded to train.seq_len + 1 - rl.max_new_tokens tokens and rl.max_new_tokens new ones, the
    parameters as the train state lays them out, cast to the compute dtype inside; and its KV
    cache by formula (as `generation_memory`'s, in the compute dtype; none under rl.sampler=exact)."""
    from meshtrain.engine import decode

    rl, t = cfg.rl, cfg.train
    prompt, new, model = longest_prompt(t.seq_len, rl), rl.max_new_tokens, program.model
    rows = max(t.batch_size, t.eval_batches * prompts_per_batch(t.batch_size, rl) if t.eval_every else 0)
    rows = decode.padded_rows(rows, program.mesh, program.rules)
    exact = rl.sampler == "exact"
    lowered = decode.lower(model, program.mesh, rows, prompt, new, program.rules, program.state_shardings["params"],
                           program.plan.precision, exact)
    out = compiled_memory(lowered, False)
    m, sizes = model.cfg, program.sizes
    split = math.prod(sizes[a] for a in program.rules["batch"]) * (1 if m.latent_rank() else sizes["tensor"])
    cache = 0 if exact else formulas.kv_cache_bytes(m.cached_positions(prompt + new - 1), rows, m.cached_values(),
                                                    split, compute_bytes(program.plan.precision))
    return {**out, "rows": rows, "prompt_len": prompt, "max_new_tokens": new, "kv_cache_formula": cache}


def named_tokenizer_eos(dcfg) -> int | None:
    """The EOS id data.document_mask splits at without data.eos_id, where it is known without the
    data: data.tokenizer's when it names a tokenizer file ('auto' is the data's, 'byte' has none)."""
    if not dcfg.document_mask or dcfg.eos_id >= 0 or dcfg.tokenizer in ("auto", "byte"):
        return None
    from meshtrain.data import tokenizer as tokenizer_lib

    return tokenizer_lib.load(dcfg.tokenizer).eos_id


def for_the_gpu(cfg, devices):
    """`cfg` with parallel.attention=auto resolved for the GPUs a plan is for where XLA:CPU compiles it
    in their place: the GPU's kernel (`resolve_attention`), or where that is cuDNN's, which XLA:CPU
    cannot compile, blockwise (the same O(L) memory, not its speed; xla where blockwise cannot cut
    train.seq_len). XLA's GPU compiler needs none of this: the program resolves auto itself."""
    par, t = cfg.parallel, cfg.train
    if par.attention != "auto" or (devices is not None and devices[0].platform == "gpu"):
        return cfg
    sizes = parse_mesh(par.mesh, len(devices) if devices is not None else jax.device_count())
    kernel = resolve_attention(cfg.model, par, t.seq_len, sizes, "gpu", cfg.data.document_mask)[0].attention
    if kernel == "cudnn":
        kernel = "blockwise" if attention_block(t.seq_len) >= min(t.seq_len, MIN_ATTENTION_BLOCK) else "xla"
    return dataclasses.replace(cfg, parallel=dataclasses.replace(par, attention=kernel))


def train_step_plan(cfg, profile: dict, devices_per_node: int | None = None, devices=None) -> dict:
    """The train step compiled for the config's mesh on `devices` (compile-only GPU devices or CPU
    devices: meshtrain/planner/compilers.py; default the process's): memory, collectives beside their
    formulas, the GPU program's kernels, FLOPs and the roofline (`plan` adds the eval step, generation
    and the verdict)."""
    cfg = for_the_gpu(cfg, devices)
    program = TrainProgram.from_config(cfg, devices=devices, tokenizer_eos=named_tokenizer_eos(cfg.data))
    check_train_size(program, (profile["memory"], f"one {profile['name']} has"))  # before an endless compile
    lowered = program.lower()
    compiled = lowered.compile()
    train_memory = compiled_memory(lowered, cpu_widened(program), default=compiled)
    gpu, text = on_gpu(program), kernels.module_text(compiled)
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
              # DPO's and GRPO's frozen reference (meshtrain/objectives/): one more copy of the parameters, no state
              "reference": shard_bytes(state["reference"], shardings["reference"]) if "reference" in state else 0,
              # GRPO's kept rollout (rl.updates_per_batch > 1): a batch's rows and their log-probs
              "objective_state": sum(shard_bytes(state[k], shardings[k]) for k in program.objective.row_state())}
    memory.update(host_memory(program, gpu, memory, train_memory))
    consumers = {"parameters": memory["parameters"],
                 "optimizer state": 0 if memory["offload"] != "none" else memory["optimizer_state"],
                 "activations and temporaries (gradients included)": memory["temporaries"]}
    memory["largest"] = max(consumers, key=consumers.get)

    tick_plan = ticks.tick_plan(program)  # a pipeline's: which branches each stage takes at each tick
    ticks.check_named(tick_plan, text)
    records = hlo.read(text, n, correct=not gpu, tick_plan=tick_plan)  # the GPU's program needs no CPU corrections
    measured = hlo.by_kind(records)
    expected = traffic.expected_traffic(program)
    compared = traffic.compare(measured, expected, gaps=known_gaps.known_gaps(program))
    comms = {k: {**measured[k], "formula_traffic_bytes": expected[k]["traffic_bytes"], "formula": expected[k]["terms"],
                 "ratio": compared[k]["ratio"], "within": compared[k]["within"], "flag": compared[k]["flag"]}
             for k in KINDS}

    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}  # the GPU compiler's is empty
    t, par = cfg.train, program.plan  # the plan as the program runs it (parallel.attention=auto resolved)
    read_once = SimpleNamespace(argument_size_in_bytes=train_memory["arguments"],  # the HBM floor's bytes
                                temp_size_in_bytes=memory["temporaries"], output_size_in_bytes=train_memory["outputs"])
    roofline = roof.estimate(program, read_once, records, profile, devices_per_node)
    if gpu:  # the GPU program's kernels price the step; the CPU's program has none (the formulas do)
        roofline = kernel_time.price(text, records, sizes, profile, devices_per_node or profile["devices_per_node"],
                                     roofline, tick_plan)
    flops = {"compiled_per_device": float(cost["flops"]) if "flops" in cost else None,
             "model_per_device": roofline["flops"]["model_per_device"],
             "hardware_per_device": roofline["flops"]["hardware_per_device"]}
    return {"config": {"model": dataclasses.asdict(program.model.cfg), "batch_size": t.batch_size, "seq_len": t.seq_len,
                       "precision": par.precision, "zero": par.zero, "remat": par.remat,
                       "attention": par.attention, "context_strategy": par.context_strategy,
                       "ulysses_degree": par.ulysses_degree, "sequence_parallel": par.sequence_parallel,
                       "grad_compression": par.grad_compression, "optimizer": cfg.optim.optimizer,
                       "microbatches": par.num_microbatches(sizes["pipeline"]),
                       "gathers_once": par.gathers_once(sizes), "bf16_layers": list(par.bf16_layers)},
            "mesh": describe(sizes), "devices": n, "params": program.num_params,
            "trainable_params": program.trainable_params, "memory": memory,
            "zero_formula": zero_formula(program),
            "collectives": comms,
            "data_parallel": traffic.data_parallel_traffic(program), "corrections": hlo.corrections(records),
            "flops": flops, "roofline": roofline, "_program": program,
            **({"kernels": kernels.read(text, tick_plan=tick_plan)} if gpu else {}),
            **({"moe": moe} if (moe := traffic.moe_dispatch(program)) else {})}


def host_memory(program, gpu: bool, memory: dict, train_memory: dict) -> dict:
    """parallel.offload's host memory per device and where the figure comes from, with the train step's
    device `total` corrected where the program cannot tell the memories apart: the GPU program holds the
    offloaded state in host memory space and reports it apart (measured); XLA:CPU has one memory, so
    there the state's bytes (by formula, `TrainProgram.offloaded_bytes`) move from the device total to the host."""
    offload = program.plan.offload
    if offload == "none":
        return {"offload": offload, "host_total": 0, "host_source": ""}
    if gpu:
        return {"offload": offload, "host_total": train_memory["host"], "host_source": "the GPU program"}
    host = program.offloaded_bytes()
    return {"offload": offload, "host_total": host, "total": memory["total"] - host,
            "host_source": "by formula: XLA:CPU keeps host and device arrays in one memory"}


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


def plan(cfg, profile: dict, memory_budget: dict, devices_per_node: int | None = None, devices=None) -> dict:
    """One verdict for the run: the train step (`train_step_plan`), the eval step, the task scorer
    (when eval.tasks are set) and generation, compiled on the same devices, the largest against the
    budget (meshtrain/planner/budget.py)."""
    report = train_step_plan(cfg, profile, devices_per_node, devices)
    program, mem = report.pop("_program"), report["memory"]
    # The eval step and the scorer take the parameters only; the rest of the train state (the
    # optimizer state, int8 compression's residuals) stays on the device beside them.
    resident = (0 if mem["offload"] != "none" else mem["optimizer_state"]) + mem["grad_error"] + mem["reference"]
    gen = generation_memory(cfg, program)
    steps = {"train": mem["total"], "generation": gen["total"]}
    ev = None
    if program.objective.rolls_out:  # grpo samples with the whole train state on the device; no eval step
        kept = mem["optimizer_state"] + mem["grad_error"] + mem["reference"] + mem["objective_state"]
        report["rollout"] = {**rollout_memory(cfg, program), "resident_state": kept}
        steps["rollout"] = report["rollout"]["total"] + kept
    else:  # DPO's eval step takes the reference copy as an argument: its compiled memory holds it
        resident_eval = resident - (mem["reference"] if program.eval_inputs(program.abstract_state) else 0)
        ev = {**eval_step_memory(program), "resident_state": resident_eval}
        steps["eval"] = ev["total"] + resident_eval
    if cfg.eval.tasks:
        report["scoring"] = {**scoring_memory(program), "resident_state": resident}
        steps["scoring"] = report["scoring"]["total"] + resident
    peak_of = max(steps, key=steps.get)
    run_verdict = {**verdict(steps[peak_of], memory_budget), "peak_of": peak_of}
    if mem["offload"] != "none":  # the host's share too: over it, the run does not fit either
        if "host" not in memory_budget:
            raise UserError(f"parallel.offload={mem['offload']}: no host memory figure for this device; pass "
                            f"--host-memory (a node's, e.g. 1TB)")
        host = memory_budget["host"]
        run_verdict["host"] = {"peak": mem["host_total"], "budget": host["budget"],
                               "fits": mem["host_total"] <= host["budget"]}
        if not run_verdict["host"]["fits"]:
            run_verdict["status"] = "does not fit"
    report["memory"].update(device_memory=memory_budget["device_memory"], fits=run_verdict["status"] != "does not fit")
    return {**report, "eval_step": ev, "generation": gen, "steps": steps, "budget": memory_budget,
            "verdict": run_verdict}


def run(args) -> str:
    profile = DEVICE_PROFILES[args.device]
    per_host = devices_per_host(profile, args.devices_per_node or profile["devices_per_node"])
    target = compilers.choose(args.compiler, args.device, args.devices, per_host)
    fraction, source = memory_fraction(profile, args.mem_fraction)
    memory_budget = budget(args.device_memory or profile["memory"], fraction, args.headroom, source)
    if args.host_memory:
        memory_budget["host"] = host_budget(args.host_memory, args.devices, per_host, "--host-memory")
    elif "host_memory" in profile:
        memory_budget["host"] = host_budget(profile["host_memory"], args.devices, per_host,
                                            f"a {profile['name']} host's, meshtrain/core/metrics.py")
    overrides = list(args.set) + ([f"parallel.mesh={args.mesh}"] if args.mesh else [])
    cfg = load_config(args.config, overrides)
    cfg.devices = 0
    with target.compiling():
        return _run(args, cfg, overrides, target, profile, memory_budget)


def _run(args, cfg, overrides: list[str], target, profile: dict, memory_budget: dict) -> str:
    compiled_for, devices = target.describe(), target.devices
    if args.zero_table:  # the train step's memory per stage: its programs only (not eval or generation)
        rows = []
        for z in range(4):  # each stage's program dropped once its row is read
            report = train_step_plan(with_plan(cfg, zero=z), profile, args.devices_per_node, devices)
            report.pop("_program")
            rows.append({**report, "compiled_for": compiled_for})
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
            except JaxRuntimeError as e:  # one entry the GPU compiler refuses: said beside the others
                if not target.gpu:
                    raise
                skipped.append({"mesh": entry, "reason": str(compilers.refused(e))})
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
                           "fits": report["memory"]["total"] <= memory_budget["budget"] and
                           report["verdict"].get("host", {}).get("fits", True),
                           "mfu_ceiling": report["roofline"]["mfu_ceiling"],
                           "priced_by": report["roofline"]["priced_by"]}
        found = fit.search(cfg, starts, profile, memory_budget, args.search_budget, args.devices_per_node, known,
                           devices, measure=train_step_plan)
        report["search"] = {"best": found["best"] and search_row(found["best"], args, cfg),
                            "runner_up": found["runner_up"] and search_row(found["runner_up"], args, cfg),
                            "compiled": [search_row(r, args, cfg) for r in found["compiled"]],
                            "path": found["path"], "budget": args.search_budget}
    if args.json:
        return json.dumps(report)
    return format_plan(report) if "verdict" in report else format_layout_search(report, args.devices)


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


