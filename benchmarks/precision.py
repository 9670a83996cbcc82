"""fp32 vs bf16 vs fp16 (dynamic loss scaling) on the Shakespeare model: the eval-loss curves of
one run each, same seed, data and batches, and the fp16 run's loss scale and overflows.

    python benchmarks/precision.py [--data ../shared/data/tinyshakespeare.txt] [--steps 1000] [--eval-every 100]

On a CPU the three run one after the other (bf16/fp16 are emulated there: the point is the
numerics, not the speed); on a GPU pass --devices 0 to use it.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's modules before any namesakes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "fp16")


def run(precision: str, args):
    from meshtrain.config.loader import load_config
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    overrides = [f"parallel.precision={precision}", "parallel.mesh=1", f"train.steps={args.steps}",
                 f"train.eval_every={args.eval_every}", f"train.log_every={args.eval_every}",
                 f"data.path={args.data}", f"out={tempfile.mkdtemp(prefix=f'precision-{precision}-')}",
                 "checkpoint.every_minutes=0", f"devices={args.devices}"]
    trainer = Trainer(load_config(str(ROOT / "configs" / "shakespeare_char.yaml"), overrides))
    history = trainer.fit(log=MetricsLog(trainer.out, primary=False))
    evals = {r["step"]: r["eval_loss"] for r in history if "eval_loss" in r}
    train = {r["step"]: r for r in history if "loss" in r}
    return evals, train


def main(argv=None):
    from meshtrain.testing import benchmark_text

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=benchmark_text(),
                   help="a text file (default: ../shared/data/tinyshakespeare.txt where it exists, else the Python "
                        "standard library)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--devices", type=int, default=1, help="simulated CPU devices; 0 = the machine's own")
    args = p.parse_args(argv)
    print(f"data: {args.data or 'the Python standard library'}", flush=True)
    results = {prec: run(prec, args) for prec in PRECISIONS}
    steps = sorted(results["fp32"][0])
    print("| step | " + " | ".join(f"eval {p}" for p in PRECISIONS)
          + " | fp16 vs fp32 | bf16 vs fp32 | fp16 loss scale |")
    print("|---|" + "---|" * (len(PRECISIONS) + 3))
    for s in steps:
        e = {p: results[p][0][s] for p in PRECISIONS}
        scale = results["fp16"][1].get(s, {}).get("loss_scale", float("nan"))
        print(f"| {s} | " + " | ".join(f"{e[p]:.4f}" for p in PRECISIONS)
              + f" | {(e['fp16'] - e['fp32']) / e['fp32']:+.2%} | {(e['bf16'] - e['fp32']) / e['fp32']:+.2%}"
              + f" | {scale:,.0f} |")
    last = results["fp16"][1][max(results["fp16"][1])]
    print(f"fp16: {int(last['overflows'])} overflow steps skipped of {args.steps}; final loss scale "
          f"{last['loss_scale']:,.0f}")


if __name__ == "__main__":
    main()
