"""Pipeline evidence in one run, for the tiny config on 8 CPU devices:
1. lockstep idle of each schedule's timetable (a tick costs its slowest slot) vs its formula, and
   beside it the classic one-action-per-tick 1F1B order (what meshtrain ran before) under the
   same costs;
2. compiled temp bytes per device vs the number of microbatches (same microbatch size), per schedule;
3. parity: schedule x mesh -> max relative loss and grad-norm difference vs 1 device over 5 fp32 steps.

    python benchmarks/pipeline.py
"""
import contextlib
import io
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.parallel.schedules import SCHEDULES, timetable, zero_bubble_order  # noqa: E402
from meshtrain.run.trainer import Trainer  # noqa: E402
from meshtrain.testing import run_tiny, tiny_config  # noqa: E402

BUBBLES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("zb", 4, 8, 1), ("gpipe", 4, 32, 1), ("1f1b", 4, 32, 1),
           ("zb", 4, 32, 1), ("interleaved", 4, 8, 2), ("interleaved", 4, 8, 4), ("gpipe", 8, 16, 1),
           ("1f1b", 8, 16, 1), ("zb", 8, 16, 1), ("interleaved", 8, 16, 2)]
MEMORY = [("gpipe", 1, "save", "none"), ("1f1b", 1, "save", "none"), ("1f1b", 1, "recompute", "none"),
          ("1f1b", 1, "save", "full"), ("1f1b", 1, "save", "save_matmuls"), ("zb", 1, "save", "none"),
          ("interleaved", 2, "save", "none")]
PARITY = [("gpipe", "4x1x1x2", 1, 1), ("gpipe", "2x1x1x4", 1, 1), ("1f1b", "4x1x1x2", 1, 1),
          ("1f1b", "2x1x1x4", 1, 1), ("1f1b", "1x2x2x2", 1, 0), ("1f1b", "2x2x1x2", 1, 3),
          ("interleaved", "4x1x1x2", 2, 1), ("interleaved", "1x2x2x2", 2, 1), ("zb", "2x1x1x4", 1, 1),
          ("zb", "1x2x2x2", 1, 0)]


def trainer(*overrides, devices=None):
    return Trainer(tiny_config(*overrides), devices=devices)


def run(*overrides, devices=None):
    with contextlib.redirect_stdout(io.StringIO()):  # the run's banner
        t, losses, _ = run_tiny(*overrides, devices=devices)
    return losses, t.grad_norms


def main():
    print("## Idle in lockstep: a tick lasts as long as its slowest stage's slot\n")
    print("F = 1, B = 2 (+1 recompute); zb: B = W = 1. `classic 1F1B` is the one-action-per-tick order with "
          "S-1-s warm-up forwards that meshtrain ran before, timed the same way.\n")
    print("| schedule | S | M | V | residuals | ticks | lockstep idle | formula | classic 1F1B idle | "
          "peak in flight (stage 0) |\n|---|---|---|---|---|---|---|---|---|---|")
    for schedule, S, M, V in BUBBLES:
        for residuals in ("save",) if SCHEDULES[schedule].splits_weight_grad else ("save", "recompute"):
            tt = timetable(schedule, S, M, V, residuals)
            classic = ""
            if schedule == "1f1b":
                orders = [zero_bubble_order(S, M, s) for s in range(S)]  # zb's F/B order is the classic 1F1B
                classic = f"{timetable('1f1b', S, M, 1, residuals, orders).bubble:.4f}"
            print(f"| {schedule} | {S} | {M} | {V} | {residuals} | {len(tt.ticks)} | {tt.bubble:.4f} | "
                  f"{tt.bubble_formula:.4f} | {classic} | {tt.in_flight()[0]} |")

    print("\n## Memory: compiled temp bytes per device, 4 stages, microbatch 2 x 64 tokens, width 64\n")
    print("| schedule | residuals | parallel.remat | M=4 | M=8 | M=16 | M=16 / M=8 |\n|---|---|---|---|---|---|---|")
    for schedule, V, residuals, remat in MEMORY:
        row = {}
        for M in (4, 8, 16):
            t = trainer("parallel.mesh=2x1x1x4" if V == 1 else "parallel.mesh=4x1x1x2", f"parallel.schedule={schedule}",
                        f"parallel.microbatches={M}", f"parallel.virtual_stages={V}",
                        f"parallel.residuals={residuals}", f"parallel.remat={remat}",
                        f"train.batch_size={2 * M * (2 if V == 1 else 4)}", "model.d_model=64", "model.mlp_dim=256",
                        "train.seq_len=64")
            row[M] = t.compiled_step.memory_analysis().temp_size_in_bytes
        name = schedule if V == 1 else f"{schedule} (V={V}, 2 stages)"
        print(f"| {name} | {residuals} | {remat} | {row[4]:,} | {row[8]:,} | {row[16]:,} | {row[16] / row[8]:.3f} |")

    print("\n## Parity vs 1 device (fp32, 5 steps, 4 microbatches)\n")
    ref_losses, ref_norms = run("parallel.mesh=1", devices=jax.devices()[:1])
    print("| schedule | mesh (data x fsdp x tensor x pipeline) | V | zero | max rel loss diff "
          "| max rel grad-norm diff |\n|---|---|---|---|---|---|")
    for schedule, mesh, V, zero in PARITY:
        losses, norms = run(f"parallel.mesh={mesh}", f"parallel.zero={zero}", f"parallel.schedule={schedule}",
                            "parallel.microbatches=4", f"parallel.virtual_stages={V}")
        print(f"| {schedule} | {mesh} | {V} | {zero} | {np.max(np.abs(losses / ref_losses - 1)):.1e} | "
              f"{np.max(np.abs(norms / ref_norms - 1)):.1e} |")


if __name__ == "__main__":
    main()
