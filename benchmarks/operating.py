"""What operating a long run costs (docs/operating.md), on CPU at a small size: the compiled step with
and without per-layer gradient norms (train.grad_norms_every > 0 adds them to every step), the
training loop with the step watchdog off and on (train.step_timeout), and the host work of one
grad_norms_every interval (reading the norms and timing the communication share's all-reduce).
Step figures are medians of interleaved repeats in one process; ratios are what to read, the
absolute times of a shared CPU machine are noise.

    python benchmarks/operating.py [--config configs/shakespeare_char.yaml] [--devices 8]
        [--mesh data=2,fsdp=2,tensor=2] [--steps 20] [--repeats 5]
"""
import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--config", default="configs/shakespeare_char.yaml")
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

from meshtrain.config.loader import load_config  # noqa: E402
from meshtrain.run.health import CollectiveTimer, grad_norm_fields  # noqa: E402
from meshtrain.run.loggers import MetricsLog  # noqa: E402
from meshtrain.run.trainer import Trainer  # noqa: E402


def trainer(*overrides):
    steps = args.steps * (args.repeats + 1)
    return Trainer(load_config(args.config, [
        f"parallel.mesh={args.mesh}", "data.kind=synthetic", f"train.steps={steps}", "train.eval_every=0",
        f"train.log_every={args.steps}", "checkpoint.every_minutes=0", "checkpoint.resume=never",
        f"out={tempfile.mkdtemp()}", *overrides]))


def compiled_facts(compiled) -> dict:
    """Deterministic figures of a compiled step: XLA's cost and memory analyses."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"bytes accessed": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0)),
            "temporaries": float(compiled.memory_analysis().temp_size_in_bytes)}


def timed_steps(t: Trainer, state, batch):
    started = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = t.compiled_step(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - started) / args.steps * 1e3


def main():
    plain, norms = trainer(), trainer(f"train.grad_norms_every={args.steps}")
    batch = plain.train_batches(0)
    states = {"plain": plain.state, "norms": norms.state}
    times = {"plain": [], "norms": []}
    with plain.program.context():
        for name, t in (("plain", plain), ("norms", norms)):  # warm up
            states[name], _ = timed_steps(t, states[name], batch)
        for _ in range(args.repeats):
            for name, t in (("plain", plain), ("norms", norms)):
                states[name], ms = timed_steps(t, states[name], batch)
                times[name].append(ms)
        # one interval's host work: the norms' fields and the timed all-reduce (first: with its compile)
        states["norms"], metrics = norms.compiled_step(states["norms"], batch)
        metrics = jax.device_get(metrics)
        timer = CollectiveTimer(norms.program.mesh, norms.program.num_params)
        interval = []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            fields = grad_norm_fields(metrics["grad_norms"], norms.program.layer_order) | timer.share(1.0)
            interval.append((time.perf_counter() - started) * 1e3)
    plain.state, norms.state = states["plain"], states["norms"]
    for t in (plain, norms):
        t.close()

    loop = {"off": [], "on": []}
    off, on = trainer("train.step_timeout=-1"), trainer("train.step_timeout=0")
    for t in (off, on):
        with contextlib.redirect_stdout(io.StringIO()):
            t.fit(args.steps, log=MetricsLog("/tmp/meshtrain-bench", primary=False))  # warm up
    for r in range(2, args.repeats + 2):
        for name, t in (("off", off), ("on", on)):
            with contextlib.redirect_stdout(io.StringIO()):
                last = t.fit(r * args.steps, log=MetricsLog("/tmp/meshtrain-bench", primary=False))[-1]
            loop[name].append(last["step_time_s"] * 1e3)

    facts = {name: compiled_facts(t.compiled_step) for name, t in (("plain", plain), ("norms", norms))}
    p, n = statistics.median(times["plain"]), statistics.median(times["norms"])
    lo, ln = statistics.median(loop["off"]), statistics.median(loop["on"])
    first, later = interval[0], statistics.median(interval[1:])
    print(f"{args.config}, mesh {args.mesh} on {args.devices} CPU devices, {plain.program.num_params / 1e6:.2f}M "
          f"params, {plain.cfg.model.num_layers} layers, batch {plain.cfg.train.batch_size} x "
          f"{plain.cfg.train.seq_len}; medians of {args.repeats} repeats of {args.steps} steps (jax {jax.__version__})")
    print("| what | without | with | with / without |\n|---|---|---|---|")
    print(f"| compiled step, per-layer gradient norms (train.grad_norms_every) | {p:.2f} ms | {n:.2f} ms | "
          f"{n / p:.3f}x |")
    for key, label in (("bytes accessed", "compiled step, bytes accessed per device (cost_analysis)"),
                       ("flops", "compiled step, FLOPs per device (cost_analysis)"),
                       ("temporaries", "compiled step, temporaries per device (memory_analysis)")):
        a, b = facts["plain"][key], facts["norms"][key]
        print(f"| {label} | {a:,.0f} | {b:,.0f} | {b / a:.4f}x |")
    print(f"| training loop per step, step watchdog (train.step_timeout) | {lo:.2f} ms | {ln:.2f} ms | "
          f"{ln / lo:.3f}x |")
    print(f"| one grad_norms_every interval's host work (fields + timed all-reduce) | | first {first:.1f} ms, then "
          f"{later:.1f} ms | {later / p:.2f} steps' time |")
    print(f"({len(fields)} fields; comm_s {fields.get('comm_s', 0) * 1e3:.2f} ms: the gradients' all-reduce over "
          f"{', '.join(timer.axes) or 'no data-parallel axis'})")


if __name__ == "__main__":
    sys.exit(main())
