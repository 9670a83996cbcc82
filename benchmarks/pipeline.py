"""Pipeline evidence in one run, for the tiny config on 8 CPU devices:
1. bubble fraction of each schedule's timetable vs the formula (S-1)/(V*M+S-1);
2. compiled temp bytes per device vs the number of microbatches (same microbatch size), per schedule;
3. parity: schedule x mesh -> max relative loss and grad-norm difference vs 1 device over 5 fp32 steps.

    python benchmarks/pipeline.py
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.config import load_config  # noqa: E402
from meshtrain.metrics import MetricsLog  # noqa: E402
from meshtrain.schedules import timetable  # noqa: E402
from meshtrain.trainer import Trainer  # noqa: E402

BUBBLES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 32, 1), ("interleaved", 4, 8, 2),
           ("interleaved", 4, 8, 4), ("1f1b", 8, 16, 1), ("interleaved", 8, 16, 2)]
MEMORY = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]
PARITY = [("gpipe", "4x1x1x2", 1, 1), ("gpipe", "2x1x1x4", 1, 1), ("1f1b", "4x1x1x2", 1, 1),
          ("1f1b", "2x1x1x4", 1, 1), ("1f1b", "1x2x2x2", 1, 0), ("1f1b", "2x2x1x2", 1, 3),
          ("interleaved", "4x1x1x2", 2, 1), ("interleaved", "1x2x2x2", 2, 1)]


def trainer(*overrides, devices=None):
    cfg = load_config("configs/tiny.yaml", [f"out={tempfile.mkdtemp()}", "checkpoint.resume=never", *overrides])
    return Trainer(cfg, devices=devices)


def run(*overrides, devices=None):
    t = trainer(*overrides, devices=devices)
    history = [r for r in t.fit(log=MetricsLog("/tmp/meshtrain-bench", primary=False)) if "loss" in r]
    return np.array([r["loss"] for r in history]), np.array([r["grad_norm"] for r in history])


def main():
    print("## Bubble: idle stage-ticks of the timetable vs (S-1)/(V*M+S-1)\n")
    print("| schedule | S | M | V | ticks | measured | formula | peak in flight (stage 0) |\n|---|---|---|---|---|---|---|---|")
    for schedule, S, M, V in BUBBLES:
        tt = timetable(schedule, S, M, V)
        print(f"| {schedule} | {S} | {M} | {V} | {len(tt.ticks)} | {tt.bubble:.4f} | {tt.bubble_formula:.4f} | "
              f"{tt.in_flight()[0]} |")

    print("\n## Memory: compiled temp bytes per device, 4 stages, microbatch 2 x 64 tokens, width 64\n")
    print("| schedule | M=4 | M=8 | M=16 | M=16 / M=4 |\n|---|---|---|---|---|")
    for schedule, V in MEMORY:
        row = {}
        for M in (4, 8, 16):
            t = trainer("mesh=2x1x1x4" if V == 1 else "mesh=4x1x1x2", f"pipeline.schedule={schedule}",
                        f"pipeline.microbatches={M}", f"pipeline.virtual_stages={V}",
                        f"train.batch_size={2 * M * (2 if V == 1 else 4)}", "model.d_model=64", "model.mlp_dim=256",
                        "train.seq_len=64")
            row[M] = t.compiled_step.memory_analysis().temp_size_in_bytes
        name = schedule if V == 1 else f"{schedule} (V={V}, 2 stages)"
        print(f"| {name} | {row[4]:,} | {row[8]:,} | {row[16]:,} | {row[16] / row[4]:.3f} |")

    print("\n## Parity vs 1 device (fp32, 5 steps, 4 microbatches)\n")
    ref_losses, ref_norms = run("mesh=1", devices=jax.devices()[:1])
    print("| schedule | mesh (data x fsdp x tensor x pipeline) | V | zero | max rel loss diff | max rel grad-norm diff |\n"
          "|---|---|---|---|---|---|")
    for schedule, mesh, V, zero in PARITY:
        losses, norms = run(f"mesh={mesh}", f"zero={zero}", f"pipeline.schedule={schedule}",
                            "pipeline.microbatches=4", f"pipeline.virtual_stages={V}")
        print(f"| {schedule} | {mesh} | {V} | {zero} | {np.max(np.abs(losses / ref_losses - 1)):.1e} | "
              f"{np.max(np.abs(norms / ref_norms - 1)):.1e} |")


if __name__ == "__main__":
    main()
