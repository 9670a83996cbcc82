"""Where a train step's device time goes, measured against the planner's price of the same program: the
config's step on one device (as benchmarks/gpu.py builds it), a few steps traced by jax.profiler, the
GPU kernels of the trace summed by kind, beside the planner's walk of the very program that ran
(meshtrain/planner/kernel_time.py with the shipped KERNEL_CONSTANTS) by the same kinds:
- gemm: cuBLAS / cuBLASLt / CUTLASS matmuls (fp8 ones too) and meshtrain's Triton grouped matmuls;
- attention: cuDNN's fused attention;
- memory: every other kernel (XLA's fusions: elementwise, reductions, casts and fp8 scaling, copies).
Then the kernels that took the most time. On a CPU the trace holds no GPU kernels: the script runs
the same steps and trace and says so.

    python benchmarks/kernel_profile.py --config configs/tiny.yaml --steps 2
    python benchmarks/kernel_profile.py --config configs/llama_1b.yaml --set train.batch_size=8 \\
        --set parallel.attention=cudnn --set parallel.precision=fp8 --steps 3
"""
import argparse
import gzip
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path[0:1] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # the repo, then here
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KINDS = ("gemm", "attention", "memory")
GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|gmm", re.I)  # tgmm/gmm: the Triton grouped matmuls
ATTENTION = re.compile(r"cudnn|fmha|sdpa|flash", re.I)


def kind_of(kernel: str) -> str:
    return "attention" if ATTENTION.search(kernel) else "gemm" if GEMM.search(kernel) else "memory"


def gpu_kernels(trace_dir: Path) -> tuple[Counter, Counter, list[str]]:
    """({kernel name: microseconds}, {kernel name: launches}) of every GPU kernel in the perfetto trace
    jax.profiler wrote under `trace_dir` (events on the processes named after a GPU; host events left
    out), and the trace's process names."""
    found = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not found:
        raise SystemExit(f"error: jax.profiler wrote no perfetto_trace.json.gz under {trace_dir}")
    events = json.loads(gzip.decompress(found[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in processes.items() if "/device:" in name and "GPU" in name}
    spent, launches = Counter(), Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and not str(e.get("name", "")).startswith("Memcpy"):
            spent[e["name"]] += float(e.get("dur", 0.0))
            launches[e["name"]] += 1
    return spent, launches, sorted(set(processes.values()))


def run(config: str, overrides: list[str], steps: int, trace_dir: Path) -> tuple[str, object, float]:
    """(the compiled step's text, the device, ms per step untraced): two warm-up steps, `steps`
    timed, then `steps` traced."""
    import jax
    from gpu import timed_steps  # beside this file

    from meshtrain.config.loader import load_config
    from meshtrain.engine.program import TrainProgram

    cfg = load_config(config, ["parallel.mesh=1", "devices=0", *overrides])
    device = jax.devices()[0]
    program = TrainProgram.from_config(cfg, devices=[device])
    compiled = program.lower().compile()
    with program.context():
        step_s, state, tokens, _ = timed_steps(program, compiled, cfg.model.vocab_size, steps)
        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
        for _ in range(steps):
            state, _ = compiled(state, tokens)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
    return compiled.as_text(), device, step_s * 1e3


def predicted_ms(text: str) -> dict | None:
    """The walk's ms per step by kind for this GPU, or None off a GPU the planner knows."""
    from grouped_matmul import profile_here  # beside this file

    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.planner.kernel_time import step_time

    name = profile_here()
    if name is None:
        return None
    walked = step_time(text, DEVICE_PROFILES[name], {})
    return {**{k: walked["by_kind_s"][k] * 1e3 for k in KINDS}, "step": walked["step_s"] * 1e3}


def report(spent: Counter, launches: Counter, steps: int, predicted: dict | None, step_ms: float, top: int) -> str:
    per_step = {k: sum(us for name, us in spent.items() if kind_of(name) == k) / steps / 1e3 for k in KINDS}
    count = {k: sum(n for name, n in launches.items() if kind_of(name) == k) // steps for k in KINDS}
    lines = [f"step {step_ms:.1f} ms untraced; GPU kernels {sum(per_step.values()):.1f} ms a step traced",
             "| kind | measured ms/step | launches/step | predicted ms/step | predicted / measured |",
             "|---|---|---|---|---|"]
    for k in (*KINDS, "step"):
        measured = step_ms if k == "step" else per_step[k]
        guess = predicted[k] if predicted else None
        ratio = f"{guess / measured:.2f}" if guess is not None and measured else "n/a"
        launched = sum(count.values()) if k == "step" else count[k]
        guessed = "n/a" if guess is None else f"{guess:.2f}"
        lines.append(f"| {k} | {measured:.2f} | {launched:,} | {guessed} | {ratio} |")
    lines += [f"\nthe {top} kernels that took the most time:", "| kernel | kind | ms/step | launches/step |",
              "|---|---|---|---|"]
    for name, us in spent.most_common(top):
        lines.append(f"| {name[:90]} | {kind_of(name)} | {us / steps / 1e3:.3f} | {launches[name] // steps} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], help="config override")
    ap.add_argument("--steps", type=int, default=3, help="steps timed, then as many traced")
    ap.add_argument("--top", type=int, default=15, help="kernels listed")
    ap.add_argument("--trace-dir", type=Path, help="keep the trace here (default: a temporary folder)")
    ap.add_argument("--hlo-out", type=Path, help="write the compiled step's text here (the program that ran)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        trace_dir = args.trace_dir or Path(scratch)
        text, device, step_ms = run(args.config, args.set, args.steps, trace_dir)
        spent, launches, processes = gpu_kernels(trace_dir)
    if args.hlo_out:
        args.hlo_out.write_text(text)
    print(f"{args.config} {' '.join(args.set)}, {args.steps} steps traced on {device.device_kind}")
    if not spent:
        print(f"no GPU kernels in the trace ({device.platform}; its processes: {', '.join(processes)}): step "
              f"{step_ms:.1f} ms untraced, nothing to compare")
        return
    print(report(spent, launches, args.steps, predicted_ms(text), step_ms, args.top))


if __name__ == "__main__":
    main()
