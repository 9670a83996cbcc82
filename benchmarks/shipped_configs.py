"""Every shipped config planned on the pod its `# pod:` comment documents (its device count; the
mesh is the config's parallel.mesh, or the comment's --mesh for the CPU-scale configs): the run's
peak per step (train, eval, generation), the usable memory and budget, the verdict with its margin,
and the worst measured/formula traffic ratio over the collective kinds (meshtrain/planner/traffic.py),
one `python -m meshtrain.plan` process per config (what tests/test_shipped_configs.py asserts).

    python benchmarks/shipped_configs.py            # all of configs/*.yaml by XLA:CPU (about 2 minutes)
    python benchmarks/shipped_configs.py configs/llama3_8b.yaml
    python benchmarks/shipped_configs.py --compiler gpu   # by XLA's GPU compiler (plan-gpu extra; ~15 minutes)

`--compile-speed`: each pod config planned twice, at XLA's default LLVM -O2 and at the -O0 the plan
command asks for (meshtrain/planner/aot.py ANALYSIS_ONLY_XLA_FLAGS): the wall time of each command and
whether the two plans' bytes and collectives are equal (docs/planner.md's table).

`--gpu-vs-cpu`: each config planned by XLA's GPU compiler (compile-only devices, the plan-gpu extra) and
by XLA:CPU (meshtrain/planner/compilers.py): train, eval and generation peaks from both, the GPU plan's
worst traffic ratio and step as its kernels price it (meshtrain/planner/kernel_time.py), and each plan's
wall time (docs/planner.md's two-compiler table).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from meshtrain.config.loader import documented_pod
from meshtrain.planner.text import human_bytes

ROOT = Path(__file__).resolve().parent.parent


def plan(config: Path, xla_flags: str | None = None, compiler: str = "cpu") -> dict:
    """The plan's JSON on the config's pod, in its own process (`xla_flags`: its XLA_FLAGS instead of
    this environment's); the JSON gets the command's wall time as `_seconds`."""
    cmd = [sys.executable, "-m", "meshtrain.plan", "--config", str(config.relative_to(ROOT)), *documented_pod(config),
           "--search-budget", "0", "--json", "--compiler", compiler]
    env = os.environ if xla_flags is None else {**os.environ, "XLA_FLAGS": xla_flags}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{config.name}: {done.stderr.strip().splitlines()[-1]}")
    return {**json.loads(done.stdout), "_seconds": time.perf_counter() - started}


def compile_speed(configs):
    """-O2 (XLA's default, set by hand) against the plan command's own -O0, per pod config."""
    print("| config | pod | -O2 (XLA's default) | -O0 | speed-up | bytes and collectives |")
    print("|---|---|---|---|---|---|")
    for config in configs:
        o2, o0 = plan(config, "--xla_backend_optimization_level=2"), plan(config, "")
        same = all(o2[k] == o0[k] for k in ("steps", "memory", "collectives", "eval_step", "generation"))
        print(f"| {config.stem} | {o2['devices']} | {o2['_seconds']:.1f} s | "
              f"{o0['_seconds']:.1f} s | {o2['_seconds'] / o0['_seconds']:.2f}x | {'equal' if same else 'DIFFER'} |",
              flush=True)


def gpu_vs_cpu(configs):
    """Each config's plan by the GPU compiler beside XLA:CPU's (benchmarks/RESULTS.md's table)."""
    gb = human_bytes
    print("| config | pod | train GPU / CPU | eval GPU / CPU | generation GPU / CPU | verdict (GPU) | "
          "worst traffic (GPU) | step predicted (GEMMs / memory-bound / collectives not hidden) | formula bound "
          "| plan time GPU / CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        g, c = plan(config, compiler="gpu"), plan(config, compiler="cpu")
        peaks = " | ".join(f"{gb(g['steps'][k])} / {gb(c['steps'][k])}" for k in ("train", "eval", "generation"))
        print(f"| {config.stem} | {pod(g)} | {peaks} | {g['verdict']['status']} | {worst_traffic(g)} | "
              f"{predicted_step(g['roofline'])} | {g['roofline'].get('formula_step_s', g['roofline']['step_s']):.2f} s "
              f"| {g['_seconds']:.0f} s / {c['_seconds']:.0f} s |", flush=True)


def predicted_step(roof: dict) -> str:
    """'34.1 s, MFU 11.2% (12.9 / 17.7 / 3.6 s)': the step as the GPU program's kernels price it
    (meshtrain/planner/kernel_time.py), its MFU, and its GEMM, memory-bound and exposed collective seconds."""
    if roof["priced_by"] != "kernels":
        return f"not priced by kernels ({roof['priced_by']})"
    k = roof["kernel_time"]
    return (f"{roof['step_s']:.1f} s, MFU {roof['mfu_ceiling']:.1%} ({k['by_kind_s']['gemm']:.1f} / "
            f"{k['by_kind_s']['memory']:.1f} / {k['exposed_comm_s']:.1f} s)")


def pod(report: dict) -> str:
    """'64 x fsdp=8,tensor=8': the pod's devices and the plan's mesh, its axes of size 1 left out."""
    mesh = ",".join(a for a in report["mesh"].split(",") if not a.endswith("=1")) or "data=1"
    return f"{report['devices']} x {mesh}"


def worst_traffic(report: dict) -> str:
    """The collective kind furthest from its formula, as measured/formula (meshtrain/planner/traffic.py's
    compare; a flagged kind with bytes but no formula counts as furthest; scalars with no formula,
    which compare does not flag, are left out), and whether the plan flags it."""
    rows = [(kind, c) for kind, c in report["collectives"].items() if c["ratio"] is not None or c["flag"]]
    if not rows:
        return "-"
    kind, c = max(rows, key=lambda kc: math.inf if kc[1]["ratio"] is None else abs(kc[1]["ratio"] - 1))
    ratio = "bytes, no formula" if c["ratio"] is None else f"{c['ratio']:.2f}x"
    return f"{kind} {ratio}{' (flagged)' if c['flag'] else ''}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="*", type=Path, default=sorted((ROOT / "configs").glob("*.yaml")))
    p.add_argument("--compile-speed", action="store_true", help="time each pod config's plan at -O2 and -O0")
    p.add_argument("--gpu-vs-cpu", action="store_true", help="each config planned by the GPU compiler and by XLA:CPU")
    p.add_argument("--compiler", default="cpu", choices=("cpu", "gpu"), help="the compiler of the main table")
    args = p.parse_args()
    if args.gpu_vs_cpu:
        return gpu_vs_cpu([c.resolve() for c in args.configs])
    if args.compile_speed:
        return compile_speed([c.resolve() for c in args.configs if "# pod:" in c.read_text()])
    print("| config | pod | train | eval | generation | usable | budget | verdict | margin "
          "| worst traffic, measured/formula |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        r = plan(config.resolve(), compiler=args.compiler)
        s, b, v = r["steps"], r["budget"], r["verdict"]
        gb = human_bytes
        print(f"| {config.stem} | {pod(r)} | {gb(s['train'])} | {gb(s['eval'])} | {gb(s['generation'])} | "
              f"{gb(b['usable'])} | {gb(b['budget'])} | {v['status']} | {gb(v['margin'])} | {worst_traffic(r)} |",
              flush=True)


if __name__ == "__main__":
    main()
