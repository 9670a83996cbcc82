"""Every shipped config planned on the pod its `# pod:` comment documents: the run's peak per step
(train, eval, generation), the usable memory and budget, the verdict with its margin, and the
worst measured/formula traffic ratio over the collective kinds (meshtrain/traffic.py), one
`python -m meshtrain.plan` process per config (what tests/test_shipped_configs.py asserts).

    python benchmarks/shipped_configs.py            # all of configs/*.yaml (about 2 minutes)
    python benchmarks/shipped_configs.py configs/llama3_8b.yaml
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

from meshtrain.config import documented_pod

GB = 1e9
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
    """The kind whose measured traffic is furthest from its formula, as measured/formula."""
    rows = [(k, row) for k, row in report.get("traffic_check", {}).items() if row.get("measured")]
    if not rows:
        return "-"
    kind, row = max(rows, key=lambda kr: abs(kr[1]["ratio"] - 1) if kr[1]["ratio"] is not None else float("inf"))
    ratio = "no formula" if row["ratio"] is None else f"{row['ratio']:.2f}x"
    return f"{kind} {ratio}{' (flagged)' if row.get('flagged') else ''}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="*", type=Path, default=sorted((ROOT / "configs").glob("*.yaml")))
    args = p.parse_args()
    print("| config | pod | train | eval | generation | usable | budget | verdict | margin | worst traffic, measured/formula |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        flags, r = plan(config.resolve())
        s, b, v = r["steps"], r["budget"], r["verdict"]
        print(f"| {config.stem} | {' '.join(flags)} | {s['train'] / GB:.2f} GB | {s['eval'] / GB:.2f} GB | "
              f"{s['generation'] / GB:.2f} GB | {b['usable'] / GB:.2f} GB | {b['budget'] / GB:.2f} GB | "
              f"{v['status']} | {v['margin'] / GB:.2f} GB | {worst_traffic(r)} |", flush=True)


if __name__ == "__main__":
    main()
