"""The GPU program's step time (meshtrain/planner/kernel_time.py) against every step measured on a GPU
(benchmarks/RESULTS.md), without a GPU: each measured train step compiled by XLA's GPU compiler for its
device (meshtrain/planner/compilers.py), its kernels walked and costed with the calibrated constants
(meshtrain/core/metrics.py, KERNEL_CONSTANTS), the prediction beside the measurement; `--fit` fits the
constants again on the calibration rows (the others are held out) and prints them.

    python benchmarks/step_time.py                  # the table, with the shipped constants
    python benchmarks/step_time.py --fit            # refit on the calibration rows, then the table
    python benchmarks/step_time.py --hlo-dir /tmp/x # keep each compiled program there (and reuse it)
"""
import argparse
import itertools
import math
import time
from collections import Counter
from pathlib import Path

# (row, device, config, overrides, measured ms, calibrates): benchmarks/RESULTS.md, "One GPU: llama_1b in bf16"
# (H200, batch 8 unless noted, save_matmuls) and "The planner's claims against one H100" (llama3-8b's shape
# with 4 layers, seq 8,192, blockwise attention); the rows marked (12-04) "Measured on one H200 (2026-12-04)".
ROWS = [
    ("H200 llama_1b b8 cudnn", "h200", "configs/llama_1b.yaml", ["train.batch_size=8", "parallel.attention=cudnn"],
     272.3, True),
    ("H200 llama_1b b8 xla", "h200", "configs/llama_1b.yaml", ["train.batch_size=8", "parallel.attention=xla"],
     674.2, True),
    ("H100 llama3-8b L4 b2 full", "h100", "configs/llama3_8b.yaml",
     ["model.num_layers=4", "parallel.attention=blockwise", "train.batch_size=2", "parallel.remat=full"], 1131.6, True),
    ("H200 llama_1b b16 cudnn", "h200", "configs/llama_1b.yaml", ["train.batch_size=16", "parallel.attention=cudnn"],
     530.9, False),
    ("H200 llama_1b b8 blockwise", "h200", "configs/llama_1b.yaml",
     ["train.batch_size=8", "parallel.attention=blockwise"], 654.7, False),
    ("H100 llama3-8b L4 b4 mb2 save_matmuls", "h100", "configs/llama3_8b.yaml",
     ["model.num_layers=4", "parallel.attention=blockwise", "train.batch_size=4", "parallel.microbatches=2",
      "parallel.remat=save_matmuls"], 1991.1, False),
    # measured 2026-12-04 on an H200 (RESULTS.md, "Measured on one H200"), on the programs of that day (2,048-token
    # loss chunks, XLA's latency-hiding scheduler): cuDNN with the shipped remat, and the fp8 recipes
    ("H200 llama_1b b8 cudnn (12-04)", "h200", "configs/llama_1b.yaml",
     ["train.batch_size=8", "parallel.attention=cudnn"], 264.1, False),
    ("H200 llama_1b b8 cudnn fp8 (12-04)", "h200", "configs/llama_1b.yaml",
     ["train.batch_size=8", "parallel.attention=cudnn", "parallel.precision=fp8"], 232.1, False),
    ("H200 llama_1b b8 cudnn fp8_rowwise (12-04)", "h200", "configs/llama_1b.yaml",
     ["train.batch_size=8", "parallel.attention=cudnn", "parallel.precision=fp8_rowwise"], 241.9, False),
    ("H200 llama3-8b L4 b4 mb2 save_matmuls cudnn (12-04)", "h200", "configs/llama3_8b.yaml",
     ["model.num_layers=4", "parallel.attention=cudnn", "train.batch_size=4", "parallel.microbatches=2",
      "parallel.remat=save_matmuls"], 571.1, False),
    # the first measured MoE steps (12-04, after the grouped kernels' tiles): dropless routing of 4 x 4,096 random
    # tokens through the Triton grouped GEMMs, the shipped remat full, 4 layers to fit one device
    ("H200 qwen3_30b_a3b L4 b4 (12-04)", "h200", "configs/qwen3_30b_a3b.yaml",
     ["model.num_layers=4", "train.batch_size=4"], 221.8, False),
    ("H200 deepseek_v3_16b L4 b4 (12-04)", "h200", "configs/deepseek_v3_16b.yaml",
     ["model.num_layers=4", "train.batch_size=4"], 224.8, False),
]


def compiled_hlo(device: str, config: str, overrides: list[str], cache: Path | None, name: str) -> str:
    path = cache / (name.replace(" ", "_") + ".hlo") if cache else None
    if path and path.exists():
        return path.read_text()
    from meshtrain.config.loader import load_config
    from meshtrain.engine.program import TrainProgram
    from meshtrain.planner import compilers

    target = compilers.choose("gpu", device, 1, 8)
    cfg = load_config(config, ["parallel.mesh=1", "devices=0", "parallel.microbatches=1", *overrides])
    with target.compiling():  # as the planner compiles: JAX's cuDNN checks answer for the target GPU
        text = TrainProgram.from_config(cfg, devices=target.devices).lower().compile().as_text()
    if path:
        path.write_text(text)
    return text


def kernels_of(text: str, profile: dict) -> list[tuple[str, float, float, float]]:
    """(kind, arithmetic s, bytes, launches per step) of the program's kernels, alike ones summed."""
    from meshtrain.planner.kernel_time import StepTime

    walk = StepTime(text, profile, {})
    walk.run(walk.module.entry)
    summed = Counter()
    for kind, arithmetic_s, nbytes, times in walk.launched:
        summed[(kind, arithmetic_s, nbytes)] += times
    return [(*key, times) for key, times in summed.items()]


def predicted(kernels, profile: dict) -> float:
    from meshtrain.planner.kernel_time import kernel_seconds

    return sum(times * kernel_seconds(kind, a, b, profile) for kind, a, b, times in kernels)


def fit(rows, profiles) -> dict:
    """The constants that minimise the calibration rows' worst |log(predicted / measured)|, on a grid refined
    twice around its best point (fused attention at the GEMMs' efficiency: one tensor-core efficiency)."""
    def worst(c):
        out = 0.0
        for (name, _), kernels in rows:
            profile = {**profiles[name], "kernels": {**profiles[name]["kernels"], **c}}
            out = max(out, abs(math.log(predicted(kernels, profile) * 1e3 / measured[name])))
        return out

    measured = {r[0]: r[4] for r in ROWS}
    best = {"gemm_peak": 0.7, "hbm_efficiency": 0.7, "launch_s": 3e-6}
    steps = {"gemm_peak": 0.1, "hbm_efficiency": 0.1, "launch_s": 2e-6}
    for _ in range(3):
        grid = {k: [max(v + i * steps[k], steps[k] / 4) for i in range(-3, 4)] for k, v in best.items()}
        candidates = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        best = min(candidates, key=lambda c: worst({**c, "attention_efficiency": c["gemm_peak"]}))
        steps = {k: v / 4 for k, v in steps.items()}
    return {**best, "attention_efficiency": best["gemm_peak"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fit", action="store_true", help="fit the constants again on the calibration rows")
    p.add_argument("--hlo-dir", type=Path, help="keep each compiled program here, and read it back when present")
    args = p.parse_args()
    from meshtrain.core.metrics import DEVICE_PROFILES

    profiles, rows, started = {}, [], time.perf_counter()
    for name, device, config, overrides, _, _ in ROWS:
        profiles[name] = DEVICE_PROFILES[device]
        rows.append(((name, device), kernels_of(compiled_hlo(device, config, overrides, args.hlo_dir, name),
                                                profiles[name])))
    constants = {}
    if args.fit:
        calibration = [r for r, row in zip(rows, ROWS) if row[5]]
        constants = fit(calibration, profiles)
        print("fitted on the calibration rows: " + ", ".join(f"{k} {v:.4g}" for k, v in constants.items()))
    print("| row | measured | predicted | predicted / measured | role |\n|---|---|---|---|---|")
    for ((name, _), kernels), row in zip(rows, ROWS):
        profile = {**profiles[name], "kernels": {**profiles[name]["kernels"], **constants}}
        ms = predicted(kernels, profile) * 1e3
        print(f"| {name} | {row[4]:,.1f} ms | {ms:,.1f} ms | {ms / row[4]:.3f} | "
              f"{'calibration' if row[5] else 'held out'} |")
    print(f"({len(ROWS)} programs compiled and walked in {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
