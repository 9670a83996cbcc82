"""int8 vs fp32 data-parallel gradient reduction on the Shakespeare model: bytes over `data` per
step from the compiled HLO, and the eval loss of one run each (same seed, data and batches).

    python benchmarks/compression.py [--data ../shared/data/tinyshakespeare.txt] [--steps 300]
        [--eval-every 100] [--zero 1]

Trains configs/shakespeare_char.yaml on data=8 simulated CPU devices (pass --devices 0 to use a
machine's own accelerators) with parallel.grad_compression=none and int8. The bytes are the
link traffic per device of every collective in the compiled step (meshtrain/planner/hlo.py); on data=8
alone they are all over `data`: the gradient reduction, and at zero 1/2 the gather of the updated
parameter shards, which compression leaves in fp32 (the "gradient reduction" column leaves it out).
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's modules before any namesakes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "int8")


def run(mode: str, args):
    from meshtrain.config.loader import load_config
    from meshtrain.planner import hlo
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    overrides = [f"parallel.grad_compression={mode}", f"parallel.mesh=data={args.data_size}",
                 f"parallel.zero={args.zero}", f"train.steps={args.steps}", f"train.eval_every={args.eval_every}",
                 f"train.log_every={args.eval_every}", f"data.path={args.data}",
                 f"out={tempfile.mkdtemp(prefix=f'compression-{mode}-')}", "checkpoint.every_minutes=0",
                 f"devices={args.devices}"]
    trainer = Trainer(load_config(str(ROOT / "configs" / "shakespeare_char.yaml"), overrides))
    found = hlo.collectives(trainer.compiled_step.as_text(), trainer.program.mesh.size)
    history = trainer.fit(log=MetricsLog(trainer.out, primary=False))
    evals = {r["step"]: r["eval_loss"] for r in history if "eval_loss" in r}
    return found, evals


def gradient_bytes(found, mode: str) -> float:
    """The gradient reduction's traffic: fp32 all-reduce / reduce-scatter, or int8's all-to-all plus
    the s8 share (and its scales) of the all-gathers."""
    if mode == "none":
        return found["all-reduce"]["traffic_bytes"] + found["reduce-scatter"]["traffic_bytes"]
    gather = found["all-gather"]
    s8 = gather["dtypes"].get("s8", 0.0)
    int8_share = s8 * (1 + 4 / 256) / gather["payload_bytes"] if gather["payload_bytes"] else 0.0
    return found["all-to-all"]["traffic_bytes"] + int8_share * gather["traffic_bytes"]


def main(argv=None):
    from meshtrain.testing import benchmark_text

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=benchmark_text(),
                   help="a text file (default: ../shared/data/tinyshakespeare.txt where it exists, else the Python "
                        "standard library)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--data-size", type=int, default=8, help="the data axis (the mesh is data=N)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices; 0 = the machine's own")
    args = p.parse_args(argv)
    print(f"data: {args.data or 'the Python standard library'}", flush=True)
    results = {mode: run(mode, args) for mode in MODES}
    total = {m: sum(k["traffic_bytes"] for k in results[m][0].values()) for m in MODES}
    grads = {m: gradient_bytes(results[m][0], m) for m in MODES}
    print(f"Shakespeare model, data={args.data_size}, zero={args.zero}, {args.steps} steps; bytes per device per "
          f"step from the compiled HLO")
    print("| | fp32 | int8 | int8 / fp32 |\n|---|---|---|---|")
    print(f"| gradient reduction | {grads['none']:,.0f} | {grads['int8']:,.0f} | {grads['int8'] / grads['none']:.3f} |")
    print(f"| all collectives over data | {total['none']:,.0f} | {total['int8']:,.0f} | "
          f"{total['int8'] / total['none']:.3f} |")
    dtypes = {k: v["dtypes"] for k, v in results["int8"][0].items() if v["count"]}
    print(f"int8 step's collectives, payload bytes by element type: {dtypes}")
    print("\n| step | eval fp32 | eval int8 | int8 vs fp32 |\n|---|---|---|---|")
    for s in sorted(results["none"][1]):
        a, b = results["none"][1][s], results["int8"][1][s]
        print(f"| {s} | {a:.4f} | {b:.4f} | {(b - a) / a:+.2%} |")


if __name__ == "__main__":
    main()
