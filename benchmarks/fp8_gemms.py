"""Which GEMMs an fp8 recipe speeds up and which it slows, priced by the planner's kernel walk
(meshtrain/planner/kernel_time.py, the calibrated KERNEL_CONSTANTS) on XLA's GPU compiler without a
GPU: a config's train step compiled for one GPU under bf16 and each recipe; its GEMMs grouped by
shape (m x n rows and columns, k contracted: a projection's forward, dx and dw are three shapes),
their milliseconds per step under each precision (and per launch: the programs may merge GEMMs that
share an input differently), then the step's other kernels. A GEMM gains the
fp8 peak's factor where it is large and loses where its shape keeps it from the tensor cores' rate
(`gemm_efficiency`) or its bytes bound it; the quantization's amaxes, scalings and casts are
memory-bound kernels of their own.

    python benchmarks/fp8_gemms.py                   # Llama 3 8B's layers, 2 of them, 2 x 4096 tokens, one H100
    python benchmarks/fp8_gemms.py --config configs/tiny.yaml --layers 4 --batch 16 --seq 16   # tiny, seconds
"""
import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's modules before any namesakes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]


def walk(cfg, device: str) -> dict:
    """The train step of `cfg` on one compile-only `device`, walked: GEMM ms per step by shape, and
    the step's ms by kind of kernel."""
    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.engine.program import TrainProgram
    from meshtrain.planner import compilers, kernel_time

    target = compilers.choose("gpu", device, 1, 8)
    profile = DEVICE_PROFILES[device]

    class BySite(kernel_time.StepTime):
        def __init__(self, *a):
            super().__init__(*a)
            self.gemms = defaultdict(lambda: [0.0, 0.0, ""])  # (k, rows x cols) -> [ms per step, launches, lhs type]

        def kernel(self, comp, ins, times):
            seconds = super().kernel(comp, ins, times)
            if (gemm := kernel_time.gemm_shape(self.module, comp, ins)) is not None:
                dtype, m, n, k = gemm
                site = self.gemms[(k, tuple(sorted((m, n), reverse=True)))]
                site[0] += times * seconds * 1e3
                site[1] += times
                site[2] = dtype
            return seconds

    with target.compiling():
        text = TrainProgram.from_config(cfg, devices=target.devices).lower().compile().as_text()
    w = BySite(text, profile, {})
    step = w.run(w.module.entry)
    return {"gemms": dict(w.gemms), "step_ms": step * 1e3, "by_kind_ms": {k: v * 1e3 for k, v in w.parts.items()}}


def main():
    from meshtrain.planner.compilers import GPU_TARGETS

    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "configs" / "llama3_8b.yaml"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--device", default="h100", choices=sorted(GPU_TARGETS))
    p.add_argument("--precisions", default="fp8,fp8_rowwise")
    args = p.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    from meshtrain.config.loader import load_config

    recipes = args.precisions.split(",")
    runs = {}
    for precision in ["bf16", *recipes]:
        cfg = load_config(args.config, [f"model.num_layers={args.layers}", f"train.batch_size={args.batch}",
                                        f"train.seq_len={args.seq}", "parallel.mesh=1", "parallel.microbatches=1",
                                        f"parallel.precision={precision}"])
        cfg.devices = 0
        runs[precision] = walk(cfg, args.device)
        print(f"compiled {precision}", file=sys.stderr, flush=True)
    shapes = sorted({s for r in runs.values() for s in r["gemms"]}, key=lambda s: -max(
        r["gemms"].get(s, [0])[0] for r in runs.values()))
    head = " | ".join(f"{p} ms" for p in runs)
    gains = " | ".join(f"bf16 / {p}" for p in recipes)
    print(f"GEMMs of the train step per shape ({args.layers} layers of {Path(args.config).stem}, {args.batch} x "
          f"{args.seq} tokens, one {args.device.upper()}; each precision's own program)\n")
    print(f"| k | rows x cols | {head} | {gains} |")
    print("|---|---|" + "---|" * (len(runs) + len(recipes)))
    cell = lambda s, p: runs[p]["gemms"].get(s)
    per_launch = lambda c: c[0] / c[1]  # a shape's GEMMs may merge or split differently in each program
    for s in shapes:
        k, (m, n) = s
        times = " | ".join(f"{c[0]:.3f} ({int(c[1])} x {c[2]})" if (c := cell(s, p)) else "-" for p in runs)
        base = cell(s, "bf16")
        ratio = " | ".join(f"{per_launch(base) / per_launch(c):.2f}x" if base and (c := cell(s, p)) else "-"
                           for p in recipes)
        print(f"| {k:,} | {m:,} x {n:,} | {times} | {ratio} |")
    print("\n(ms per step (launches x the lhs's type); the ratios are per launch)")
    print(f"\n| kernels per step | {head} |\n|---|" + "---|" * len(runs))
    for kind in ("gemm", "attention", "memory"):
        print(f"| {kind} | " + " | ".join(f"{r['by_kind_ms'].get(kind, 0.0):.3f}" for r in runs.values()) + " |")
    print("| step | " + " | ".join(f"{r['step_ms']:.3f}" for r in runs.values()) + " |")


if __name__ == "__main__":
    main()
