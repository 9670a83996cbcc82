"""Every shipped config planned on the pod its `# pod:` comment documents: the run's peak per step
(train, eval, generation), the usable memory and budget, the verdict with its margin, and the
worst measured/formula traffic ratio over the collective kinds (meshtrain/planner/traffic.py), one
`python -m meshtrain.plan` process per config (what tests/test_shipped_configs.py asserts).

    python benchmarks/shipped_configs.py            # all of configs/*.yaml (about 2 minutes)
    python benchmarks/shipped_configs.py configs/llama3_8b.yaml
"""
import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from meshtrain.config.loader import documented_pod
from meshtrain.planner.aot import human_bytes

ROOT = Path(__file__).resolve().parent.parent


def plan(config: Path) -> tuple[list[str], dict]:
    flags = documented_pod(config)
    cmd = [sys.executable, "-m", "meshtrain.plan", "--config", str(config.relative_to(ROOT)), *flags,
           "--search-budget", "0", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{config.name}: {done.stderr.strip().splitlines()[-1]}")
    return flags, json.loads(done.stdout)


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
    args = p.parse_args()
    print("| config | pod | train | eval | generation | usable | budget | verdict | margin "
          "| worst traffic, measured/formula |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        flags, r = plan(config.resolve())
        s, b, v = r["steps"], r["budget"], r["verdict"]
        gb = human_bytes
        print(f"| {config.stem} | {' '.join(flags)} | {gb(s['train'])} | {gb(s['eval'])} | {gb(s['generation'])} | "
              f"{gb(b['usable'])} | {gb(b['budget'])} | {v['status']} | {gb(v['margin'])} | {worst_traffic(r)} |",
              flush=True)


if __name__ == "__main__":
    main()
