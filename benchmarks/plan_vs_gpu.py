"""The planner's claims for one device against the device itself: the train step's memory and the
roofline's step time, as `python -m meshtrain.plan` prints them from a CPU compile (JAX_PLATFORMS=cpu,
as on a laptop), beside the same step measured on this machine's first device (benchmarks/gpu.py:
`memory_analysis()` of the compiled step, the allocator's peak, the mean step over timed steps).
Runs on CPU at tiny size (the device's figures then come from the CPU backend, with no allocator
peak) and on a GPU at full size:

    python benchmarks/plan_vs_gpu.py --config configs/tiny.yaml --steps 2
    python benchmarks/plan_vs_gpu.py --config configs/llama3_8b.yaml --device h100 \
        --set model.num_layers=4 --set train.batch_size=2 --set parallel.microbatches=1 \
        --set parallel.attention=blockwise

The planner's memory claim is the train step's peak (parameters, optimizer state, gradients,
temporaries); the check is within 10% of the allocator's peak. Its step claim is the roofline's
lower bound (executed FLOPs at the datasheet peak, or HBM, or links); the check is within 25%.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GB = 1e9


def planned(config: str, overrides: list[str], device: str) -> dict:
    sets = [a for o in overrides for a in ("--set", o)]
    cmd = [sys.executable, "-m", "meshtrain.plan", "--config", config, *sets, "--devices", "1", "--mesh", "data=1",
           "--device", device, "--search-budget", "0", "--json"]
    done = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"plan: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)


def measured(config: str, overrides: list[str], steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "gpu.py"), "--config", config, "--steps", str(steps),
           "--one", json.dumps(overrides)]
    done = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True)
    found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise SystemExit(f"measure: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(found[0])


def row(name: str, claim: float | None, actual: float | None, unit: str, tolerance: float) -> str:
    if claim is None or actual is None:
        show = lambda v: "n/a" if v is None else f"{v:,.2f} {unit}"
        return f"| {name} | {show(claim)} | {show(actual)} | n/a | not measured on this backend |"
    ratio = actual / claim
    verdict = "within" if abs(ratio - 1) <= tolerance else "OUTSIDE"
    return f"| {name} | {claim:,.2f} {unit} | {actual:,.2f} {unit} | {ratio:.2f}x | {verdict} {tolerance:.0%} |"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], help="config override, for the plan and the device")
    p.add_argument("--device", default="h100", help="the planner's device profile")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    plan, device = planned(args.config, args.set, args.device), measured(args.config, args.set, args.steps)
    roof, mem = plan["roofline"], plan["memory"]
    print(f"{args.config} {' '.join(args.set)}: planned for {args.device}, measured on {device['device']}, "
          f"{args.steps} timed steps")
    print("| figure | planner (CPU compile) | measured on the device | measured / planned | check |")
    print("|---|---|---|---|---|")
    print(row("train step peak memory", mem["total"] / GB, device["peak_gb"], "GB", 0.10))
    print(row("temporaries (compiled)", mem["temporaries"] / GB, device["temp_gb"], "GB", 0.10))
    print(row("step time (roofline bound)", roof["step_s"] * 1e3, device["step_ms"], "ms", 0.25))
    print(f"roofline: {roof['bound']}-bound, compute {roof['compute_s'] * 1e3:,.1f} ms, "
          f"HBM {roof['memory_s'] * 1e3:,.1f} ms; "
          f"measured MFU {device['mfu'] or 0:.1%} (the roofline's MFU ceiling {roof['mfu_ceiling']:.1%})")


if __name__ == "__main__":
    main()
