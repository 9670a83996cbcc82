"""fp32 vs bf16 vs fp16 (dynamic loss scaling) vs the low-precision recipes (meshtrain/ops/recipes.py: fp8
tensorwise, fp8_rowwise, fp8_blockwise, mxfp8, nvfp4) on the Shakespeare model:
the eval-loss curves of one run each, same seed, data and batches, and the fp16 run's loss scale and
overflows; fp16 and bf16 are compared with fp32, each recipe with bf16 (the precision it replaces).

    python benchmarks/precision.py [--data ../shared/data/tinyshakespeare.txt] [--steps 1000] [--eval-every 100]
        [--precisions fp32,bf16,fp16,fp8,fp8_rowwise,fp8_blockwise,mxfp8,nvfp4]
    python benchmarks/precision.py --precisions bf16,nvfp4,nvfp4-no_sr,nvfp4-no_rht,nvfp4-1d_weights --steps 600
        # nvfp4 without one part of its recipe each: stochastic rounding, the rotation, 16 x 16 weight blocks
    python benchmarks/precision.py --precisions bf16,nvfp4-4over6 --steps 600
        # nvfp4 with Four Over Six's block scales (meshtrain/ops/block_scaled.py nv_quantize's four_over_six)
    python benchmarks/precision.py --precisions bf16,nvfp4,nvfp4-bf16_last --steps 600
        # <recipe>-bf16_last: the recipe with the model's last layer kept in bf16 (parallel.bf16_layers=[-1])
    python benchmarks/precision.py --precisions bf16,nvfp4-rht_all --steps 600
        # nvfp4 with every GEMM's operands rotated along its contraction, not dw's alone (Quartet's forward)
    python benchmarks/precision.py --precisions bf16,nvfp4 --steps 600 --set model.d_model=256 --set model.mlp_dim=768
        # the same comparison on a wider model (--set: config overrides for every run)

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
from meshtrain.ops.recipes import RECIPES  # noqa: E402 (after the path above)

PRECISIONS = ("fp32", "bf16", "fp16", *RECIPES)
# nvfp4 less one part of its recipe, or with Four Over Six's scales (meshtrain/ops/block_scaled.py
# block_scaled_einsum's arguments)
RECIPE = {"weight_2d": True, "stochastic": True, "rotate": True}
ABLATIONS = {"nvfp4-no_sr": {**RECIPE, "stochastic": False}, "nvfp4-no_rht": {**RECIPE, "rotate": False},
             "nvfp4-1d_weights": {**RECIPE, "weight_2d": False}, "nvfp4-4over6": {**RECIPE, "four_over_six": True},
             "nvfp4-rht_all": {**RECIPE, "rotate_all": True},
             "nvfp4-no_sr_rht": {**RECIPE, "stochastic": False, "rotate": False},
             "nvfp4-no_sr_rht-4over6": {**RECIPE, "stochastic": False, "rotate": False, "four_over_six": True}}
# a recipe with its last layer kept in bf16 (parallel.bf16_layers), as the published recipes keep the last ones
KEPT = {f"{recipe}-bf16_last": ("parallel.bf16_layers=[-1]",) for recipe in RECIPES}
AGAINST = {"fp16": "fp32", "bf16": "fp32", **{name: "bf16" for name in (*RECIPES, *ABLATIONS, *KEPT)}}  # each against


def run(name: str, args):
    import dataclasses

    from meshtrain.config.loader import load_config
    from meshtrain.ops import block_scaled, recipes
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    precision, shipped = name.split("-")[0], recipes.RECIPES["nvfp4"]
    if name in ABLATIONS:  # the nvfp4 recipe less one part (or with Four Over Six), for this run
        ablated = block_scaled.block_scaled_einsum(block_scaled.NVFP4, **ABLATIONS[name])
        recipes.RECIPES["nvfp4"] = dataclasses.replace(shipped, einsum=ablated)
    overrides = [f"parallel.precision={precision}", "parallel.mesh=1", f"train.steps={args.steps}",
                 f"train.eval_every={args.eval_every}", f"train.log_every={args.eval_every}",
                 f"data.path={args.data}", f"out={tempfile.mkdtemp(prefix=f'precision-{precision}-')}",
                 "checkpoint.every_minutes=0", f"devices={args.devices}", *KEPT.get(name, ()), *args.set]
    try:
        trainer = Trainer(load_config(str(ROOT / "configs" / "shakespeare_char.yaml"), overrides))
        history = trainer.fit(log=MetricsLog(trainer.out, primary=False))
    finally:
        recipes.RECIPES["nvfp4"] = shipped
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
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="which to run, comma-separated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (configs/shakespeare_char.yaml's model, say), repeatable")
    args = p.parse_args(argv)
    chosen = args.precisions.split(",")
    print(f"data: {args.data or 'the Python standard library'}", flush=True)
    results = {prec: run(prec, args) for prec in chosen}
    pairs = [(p, AGAINST[p]) for p in chosen if AGAINST.get(p) in results]
    steps = sorted(results[chosen[0]][0])
    print("| step | " + " | ".join(f"eval {p}" for p in chosen) + "".join(f" | {p} vs {q}" for p, q in pairs)
          + (" | fp16 loss scale |" if "fp16" in results else " |"))
    print("|---|" + "---|" * (len(chosen) + len(pairs) + ("fp16" in results)))
    for s in steps:
        e = {p: results[p][0][s] for p in chosen}
        row = f"| {s} | " + " | ".join(f"{e[p]:.4f}" for p in chosen)
        row += "".join(f" | {(e[p] - e[q]) / e[q]:+.2%}" for p, q in pairs)
        if "fp16" in results:
            row += f" | {results['fp16'][1].get(s, {}).get('loss_scale', float('nan')):,.0f}"
        print(row + " |")
    for p, q in pairs:  # the training loss at every logged step, not only the evaluations
        train = [(r["loss"], results[q][1][s]["loss"]) for s, r in results[p][1].items()]
        print(f"{p} vs {q}: largest train-loss difference over the {len(train)} logged steps "
              f"{max(abs(a - b) / b for a, b in train):.2%}")
    if "fp16" in results:
        last = results["fp16"][1][max(results["fp16"][1])]
        print(f"fp16: {int(last['overflows'])} overflow steps skipped of {args.steps}; final loss scale "
              f"{last['loss_scale']:,.0f}")

if __name__ == "__main__":
    main()
