"""`python -m meshtrain.plan`: know before you pay for the pod.

Plan a run on a target mesh, on any laptop (nothing materialised):

    python -m meshtrain.plan --config configs/llama3_8b.yaml --devices 64 --mesh fsdp=8,tensor=8

lowers and compiles the real train step for that mesh ahead of time, with XLA's GPU compiler for
`--device` (compile-only devices: no GPU needed; `pip install -e ".[plan-gpu]"`) or else XLA:CPU on
simulated devices (`--compiler`, meshtrain/planner/compilers.py), and reports, per device, the
bytes of parameters, optimizer state, gradients and temporaries against --device-memory, the
collective traffic by kind parsed from the compiled HLO, the FLOPs per step and a roofline
estimate, each next to its analytical formula. `--compare MESH ...` ranks meshes, `--zero-table`
sets ZeRO stages 0-3 side by side, `--json` prints one JSON object.

Look at a pipeline schedule:

    python -m meshtrain.plan --schedule 1f1b --stages 4 --microbatches 8 --draw docs/1f1b.png

prints the timetable (stages x ticks), the bubble fraction next to the formula (S-1)/(V*M+S-1),
the microbatches in flight per stage and the activation buffers the executor allocates, and
optionally draws the timeline as a PNG.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys

from meshtrain.core import compile_cache
from meshtrain.core.cli import Parser, arguments, check_platforms, command, compile_cache_flag, devices_flag, number
from meshtrain.core.errors import LayoutError, UserError
from meshtrain.core.folders import writing_file
from meshtrain.core.metrics import DEVICE_PROFILES
from meshtrain.parallel.schedules import SCHEDULES, lookup, timetable
from meshtrain.parallel.tick_tables import executor_tables
from meshtrain.planner.budget import HEADROOM
from meshtrain.planner.compilers import COMPILERS
from meshtrain.planner.drawing import figure_suffixes, save_timeline

MAX_SCHEDULE_CELLS = 2**16  # stages x microbatches x virtual stages: 64 x 512 simulates in ~4 s


def schedule_report(schedule: str, stages: int, micro: int, virtual: int, residuals: str = "save") -> dict:
    tt = timetable(schedule, stages, micro, virtual, residuals)
    buffers = executor_tables(tt)
    return {"schedule": schedule, "stages": stages, "microbatches": micro, "virtual_stages": virtual,
            "residuals": residuals, "costs": tt.costs, "ticks": len(tt.ticks), "time": tt.time,
            "bubble": tt.bubble, "bubble_formula": tt.bubble_formula, "in_flight": tt.in_flight(),
            "residual_slots": int(buffers["residual_slots"]), "input_slots": int(buffers["input_slots"]),
            "timeline": [["+".join(map(str, slot)) or "." for slot in row] for row in zip(*tt.ticks)], "_table": tt}


def format_schedule(r: dict) -> str:
    S, M, V = r["stages"], r["microbatches"], r["virtual_stages"]
    schedule = lookup(r["schedule"])
    idle, total = schedule.bubble_terms(S, M, V)
    costs = ", ".join(f"{k}={v}" for k, v in r["costs"].items() if v)
    lines = [f"schedule {r['schedule']}: {S} stages x {M} microbatches, {V} virtual stage(s) per device, "
             f"residuals {r['residuals']}",
             f"ticks: {r['ticks']}, lockstep time {r['time']} (action costs {costs}; a tick lasts as long as "
             f"its slowest stage)",
             f"bubble: {r['bubble']:.1%} of stage-time idle in lockstep; formula "
             f"{schedule.bubble_expression} = {idle}/{total} = {r['bubble_formula']:.1%}",
             f"in flight per stage (microbatch chunks): {' '.join(map(str, r['in_flight']))}; "
             f"buffer slots per chunk: residuals {r['residual_slots']}, received inputs {r['input_slots']}"]
    if r["ticks"] <= 80:
        width = max(len(c) for row in r["timeline"] for c in row) + 1
        lines += [f"stage {s}: " + "".join(c.rjust(width) for c in row) for s, row in enumerate(r["timeline"])]
    return "\n".join(lines)


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.plan", description=__doc__.split("\n\n")[0])
    run = p.add_argument_group("plan a training run on a target mesh")
    run.add_argument("--config", help="YAML config (see configs/)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    devices_flag(run, "target device count (simulated on this machine's CPU)")  # by planner/compilers.py `choose`
    run.add_argument("--mesh", help="target mesh, e.g. fsdp=8,tensor=8 or 8x8x4")
    compile_cache_flag(run)  # XLA:CPU plans only: the GPU compiler's compile-only devices cannot load one
    run.add_argument("--device", default="h100", choices=sorted(DEVICE_PROFILES),
                     help="the target device: the GPU compiler's target and the roofline's profile")
    run.add_argument("--compiler", default="auto", choices=COMPILERS,
                     help="gpu: XLA's GPU compiler for --device without a GPU (needs the plan-gpu extra); cpu: XLA:CPU "
                          "on simulated devices, corrected where it differs from a GPU; auto (default): gpu when "
                          "installed and --device is a GPU, else cpu, saying why")
    run.add_argument("--device-memory", type=parse_bytes, default=None, metavar="BYTES",
                     help="memory per device, e.g. 80GB (default: the profile's)")
    run.add_argument("--host-memory", type=parse_bytes, default=None, metavar="BYTES",
                     help="host (system) memory per host, shared by its devices' processes, which "
                          "parallel.offload keeps the optimizer state in, e.g. 1TB (default: the profile's, 2 TB "
                          "for a DGX node, 960 GB for a GB200 compute tray of 4 GPUs)")
    run.add_argument("--devices-per-node", type=number(int, min=1), default=None, metavar="N",
                     help="devices sharing the fast in-node links (NVLink; a TPU slice): collectives over axes that "
                          "span nodes run at the network's bandwidth (default: the profile's, 8 for GPUs)")
    run.add_argument("--mem-fraction", type=number(float, above=0.0, max=1.0), default=None, metavar="F",
                     help="share of the device's memory the runtime may use (default: XLA_CLIENT_MEM_FRACTION, or "
                          "JAX's 0.75 on GPUs)")
    run.add_argument("--headroom", type=number(float, min=0.0, below=1.0), default=HEADROOM, metavar="F",
                     help=f"share of the usable memory kept free for fragmentation and collective buffers "
                          f"(default {HEADROOM})")
    run.add_argument("--fit", action="store_true",
                     help="search microbatches, remat, ZeRO, attention and the mesh for the fastest layout that fits "
                          "(compiling each candidate) and print the command that trains it")
    run.add_argument("--search-budget", type=number(int, min=0), default=12, metavar="N",
                     help="at most N compiles for --fit and for the search a plan that does not fit runs "
                          "(default 12; 0: no search)")
    run.add_argument("--compare", nargs="+", metavar="MESH", help="rank these meshes for the same model and devices; "
                     "an entry may add its own settings after the mesh, e.g. 'context=4 "
                     "parallel.context_strategy=ulysses parallel.attention=blockwise'")
    run.add_argument("--zero-table", action="store_true", help="ZeRO stages 0-3 side by side, measured vs formula")
    sched = p.add_argument_group("look at a pipeline schedule")
    sched.add_argument("--schedule", choices=tuple(SCHEDULES))
    sched.add_argument("--stages", type=number(int, min=1))
    sched.add_argument("--microbatches", type=number(int, min=1))
    sched.add_argument("--virtual-stages", type=number(int, min=1), default=1)
    sched.add_argument("--residuals", default="save", choices=("save", "recompute"),
                       help="what a stage keeps for the backward (sets the backward's cost)")
    sched.add_argument("--draw", metavar="PNG", help="write the timeline (stages x ticks) as a PNG image (its "
                                                     "suffix picks the format)")
    sched.add_argument("--force", action="store_true", help="overwrite --draw if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


@command
def main(argv=None) -> int:
    args = arguments(parser(), argv)
    if args.schedule:
        return schedule_main(args)
    if not (args.config and args.devices):
        raise UserError("pass --config and --devices (and --mesh) to plan a run, or --schedule to see a schedule")
    check_platforms()
    compile_cache.use(args.compile_cache)
    from meshtrain.planner import aot as planner

    try:
        print(planner.run(args))
    except LayoutError as e:
        typed = sys.argv[1:] if argv is None else argv
        raise UserError(f"{e}; or search the layouts that divide: {fit_command(typed)}") from None
    return 0


def fit_command(argv: list[str]) -> str:
    """The plan command as typed, as a `--fit` search: without the layout it named (--mesh), the
    table flags and a --search-budget of 0, which would search nothing."""
    kept, i = [], 0
    while i < len(argv):
        flag, value = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if flag in ("--mesh", "--search-budget") and (flag == "--mesh" or value == "0"):
            i += 2
            continue
        if flag not in ("--fit", "--zero-table", "--search-budget=0") and not flag.startswith("--mesh="):
            kept.append(flag)
        i += 1
    return shlex.join(["python", "-m", "meshtrain.plan", *kept, "--fit"])


def schedule_main(args) -> int:
    if args.stages is None or args.microbatches is None:
        raise UserError("--schedule needs --stages and --microbatches")
    if args.stages * args.microbatches * args.virtual_stages > MAX_SCHEDULE_CELLS:
        raise UserError(f"--stages {args.stages} x --microbatches {args.microbatches} x --virtual-stages "
                        f"{args.virtual_stages} is over the {MAX_SCHEDULE_CELLS:,} the simulator takes in seconds; "
                        f"look at a smaller schedule (its bubble formula holds for any size)")
    with writing_file(args.draw, "--draw", args.force, figure_suffixes()) if args.draw else \
            contextlib.nullcontext() as drawing:  # checked before the simulation; written whole
        report = schedule_report(args.schedule, args.stages, args.microbatches, args.virtual_stages, args.residuals)
        table = report.pop("_table")
        print(json.dumps(report) if args.json else format_schedule(report))
        if args.draw:
            save_timeline(table, drawing)
    if args.draw and not args.json:
        print(f"timeline drawn to {args.draw}")
    return 0


def parse_bytes(text: str) -> float:
    """'80GB' -> 8e10: a size with an optional unit; an argparse `type` (finite, > 0)."""
    units = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    unit = next((u for u in units if text.upper().endswith(u)), "")
    size = number(float, above=0.0)(text[:len(text) - len(unit)])
    return size * units.get(unit, 1)


def command_line() -> int:
    """`python -m meshtrain.plan`: `main` in a process that never runs what it compiles, so its XLA
    compiles for analysis only (meshtrain/planner/aot.py ANALYSIS_ONLY_XLA_FLAGS)."""
    from meshtrain.planner.aot import compile_for_analysis_only

    compile_for_analysis_only(os.environ)
    return main()


if __name__ == "__main__":
    sys.exit(command_line())
