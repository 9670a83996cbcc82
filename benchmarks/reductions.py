"""Data-parallel collectives per step vs gradient-accumulation microbatches, read from the compiled
train step (tiny config, 8 CPU devices, data=8, global batch 32): count and payload bytes of the
all-reduces, all-gathers and reduce-scatters per step, for each ZeRO stage at 1, 2 and 4
microbatches. Each data shard accumulates locally and reduces once per step
(meshtrain/parallel/data_parallel.py), so the figures must not grow with the microbatches.

    python benchmarks/reductions.py
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from meshtrain.config.loader import load_config  # noqa: E402
from meshtrain.engine.program import TrainProgram  # noqa: E402
from meshtrain.planner import hlo  # noqa: E402

MICROBATCHES = (1, 2, 4)


def reductions(zero: int, microbatches: int) -> tuple[float, float]:
    cfg = load_config("configs/tiny.yaml", ["parallel.mesh=data=8", f"parallel.zero={zero}",
                                            f"parallel.microbatches={microbatches}", "train.batch_size=32",
                                            f"out={tempfile.mkdtemp()}"])
    return hlo.reduction_totals(hlo.collectives(TrainProgram.from_config(cfg).lower().compile().as_text(), 8))


def main():
    head = " | ".join(f"M={m} count | M={m} bytes" for m in MICROBATCHES)
    print(f"| zero | {head} | bytes M={MICROBATCHES[-1]} / M=1 |\n|---|" + "---|" * (2 * len(MICROBATCHES) + 1))
    for zero in range(4):
        rows = [reductions(zero, m) for m in MICROBATCHES]
        cells = " | ".join(f"{count:.0f} | {payload:,.0f}" for count, payload in rows)
        print(f"| {zero} | {cells} | {rows[-1][1] / rows[0][1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
