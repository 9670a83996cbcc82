"""Time to first step: where a training process's start goes, with the compilation cache empty (cold)
and holding the run's programs (warm). Each run is a new process that trains 2 steps:
- import: the interpreter's start and `import meshtrain.train` (what the command loads first);
- set-up: the Trainer's construction and fit()'s start, less the compile (run.json's goodput
  `startup`: model, data, initial state, run folder, loggers);
- compile: the train step's compile or its load from the cache (goodput `compile`);
- first step: step 1's time (metrics.jsonl `step_time`);
- to first step: their sum; total: the process's wall time (2 steps, the end-of-run checkpoint, exit).
The README's main job (the default config on 8 devices, 2x2x2) runs its first step in at most 6 s warm.

    python benchmarks/startup.py [--only tiny] [--gpus]

The runs use simulated CPU devices (1 or 8, as the case needs); with --gpus, the machine's own.
Figures in benchmarks/RESULTS.md.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name -> (config, None: the default one; overrides; devices it needs)
    "README main job": (None, ["parallel.mesh=2x2x2"], 8),
    "tiny": ("configs/tiny.yaml", ["parallel.mesh=1"], 1),
    "gpt2_124m": ("configs/gpt2_124m.yaml", ["parallel.mesh=1", "train.batch_size=2", "train.seq_len=256"], 1),
    "tiny 1f1b 4 stages": ("configs/tiny.yaml", ["parallel.mesh=2x1x1x4", "parallel.schedule=1f1b",
                                                 "parallel.microbatches=8"], 8),
}
# The child: its own clock from the process's start (/proc), then the command's main in-process.
CHILD = """
import sys, time
from meshtrain.run.goodput import process_age
begun = time.perf_counter() - (process_age() or 0.0)
import meshtrain.train
imported = time.perf_counter() - begun
status = meshtrain.train.main(sys.argv[1:])
print(f"IMPORT_S {imported:.3f}")
sys.exit(status)
"""


def one_run(config: str, overrides: list[str], devices: int, cache: str) -> dict:
    out = tempfile.mkdtemp(prefix="meshtrain-startup-")
    argv = (["--config", config] if config else []) + ["--steps", "2", "--out", out, "--compile-cache", cache,
            "--set", "train.log_every=1", "--set", "train.eval_every=0"]
    argv += ["--devices", str(devices)] if devices else []
    for item in overrides:
        argv += ["--set", item]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"error: {config} {overrides} failed:\n{done.stderr[-2000:]}")
    imported = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("IMPORT_S")))
    seconds = json.loads((Path(out) / "run.json").read_text())["starts"][-1]["goodput"]["seconds"]
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    first_step = next(r["step_time_s"] for r in records if r.get("step") == 1)
    loaded = "loaded the train step from the compilation cache" in done.stdout + done.stderr
    row = {"import": imported, "set-up": seconds["startup"], "compile": seconds["compile"], "first step": first_step,
           "total": wall, "loaded": loaded}
    row["to first step"] = row["import"] + row["set-up"] + row["compile"] + row["first step"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", action="store_true", help="the machine's own devices, not simulated CPU devices")
    p.add_argument("--only", choices=sorted(CASES), help="one case")
    args = p.parse_args()
    columns = ["import", "set-up", "compile", "first step", "to first step", "total"]
    print(f"| case | cache | {' | '.join(columns)} |\n|---|---|{'---|' * len(columns)}")
    for name, (config, overrides, needs) in CASES.items():
        if args.only and name != args.only:
            continue
        cache = tempfile.mkdtemp(prefix="meshtrain-startup-cache-")  # empty: the first run is cold
        for state in ("cold", "warm"):
            row = one_run(config, overrides, 0 if args.gpus else needs, cache)
            if (state == "warm") != row["loaded"]:
                raise SystemExit(f"error: the {state} run of {name} {'loaded' if row['loaded'] else 'compiled'} "
                                 f"its train step")
            print(f"| {name} | {state} | {' | '.join(f'{row[c]:.2f} s' for c in columns)} |", flush=True)


if __name__ == "__main__":
    main()
