"""One device's training speed and memory for a config: tokens/s, TFLOP/s and MFU (the PaLM
convention of meshtrain/core/metrics.py), compiled temporaries and peak device memory of the real
train step, for several variants side by side from one run. Each variant runs in its own process,
so its peak memory is its own. Runs on CPU at tiny size and on a GPU at full size:

    python benchmarks/gpu.py --config configs/tiny.yaml --steps 3
    python benchmarks/gpu.py --config configs/llama_1b.yaml --set train.batch_size=8 --steps 10 \
        --variant xla:parallel.attention=xla --variant cudnn:parallel.attention=cudnn

A variant is `name:key=value,key=value` (config overrides on top of --set). The batch is a fixed
random token array already on the device, so the figures are the step's, not the data loader's
(benchmarks/overhead.py measures the loop around it). `--torch` adds a row for the same model and
step in plain PyTorch (`torch.compile`, SDPA FlashAttention, bf16 autocast: benchmarks/torch_baseline.py)
with the --set overrides, in its own process. MFU is against the device's dense bf16 peak for every
row; a precision=fp8 row also shows it against the dense fp8 peak ("MFU fp8").

fp8 against bf16 and torch.compile, each row its own process on the same device (issue 26 §2):
llama_1b, and Llama 3 8B's layer shape cut to 4 layers to fit one 80 GB device (as
benchmarks/plan_vs_gpu.py's run in RESULTS.md):

    python benchmarks/gpu.py --config configs/llama_1b.yaml --set train.batch_size=8 --set parallel.attention=cudnn \
        --steps 10 --variant bf16:parallel.precision=bf16 --variant fp8:parallel.precision=fp8 --torch
    python benchmarks/gpu.py --config configs/llama3_8b.yaml --set model.num_layers=4 --set train.batch_size=2 \
        --set parallel.microbatches=1 --set parallel.attention=cudnn --set parallel.remat=full --steps 5 \
        --variant bf16:parallel.precision=bf16 --variant fp8:parallel.precision=fp8 --torch
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def timed_steps(program, compiled, vocab_size: int, steps: int):
    """Inside `program.context()`: its state and a fixed random batch on its devices, two warm-up steps
    (first-touch allocations, autotuning), then `steps` timed. (seconds a step, state, batch, metrics)."""
    import jax
    import jax.numpy as jnp

    state = jax.jit(program.init_state, out_shardings=program.state_shardings)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), program.batch_shape, 0, vocab_size, jnp.int32)
    tokens = jax.device_put(tokens, program.batch_sharding)
    for _ in range(2):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready(state)
    started = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready(state)
    return (time.perf_counter() - started) / steps, state, tokens, metrics


def measure(config: str, overrides: list[str], steps: int) -> dict:
    import jax

    from meshtrain.config.loader import load_config
    from meshtrain.core.metrics import mfu, run_peaks
    from meshtrain.engine.program import TrainProgram
    from meshtrain.ops.recipes import low_peak

    cfg = load_config(config, ["parallel.mesh=1", "devices=0", *overrides])
    device = jax.devices()[0]
    program = TrainProgram.from_config(cfg, devices=[device])
    started = time.perf_counter()
    compiled = program.lower().compile()
    compile_s = time.perf_counter() - started
    memory = compiled.memory_analysis()
    with program.context():
        step_s, state, tokens, metrics = timed_steps(program, compiled, cfg.model.vocab_size, steps)
    tokens_per_s = cfg.train.batch_size * cfg.train.seq_len / step_s
    peak, fp8_peak = run_peaks(device.device_kind, low_peak(cfg.parallel.precision))
    stats = device.memory_stats() or {}
    return {"device": device.device_kind, "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_s,
            "tflops": tokens_per_s * program.flops_per_token / 1e12,
            "mfu": mfu(tokens_per_s, program.flops_per_token, 1, peak),
            "mfu_fp8": mfu(tokens_per_s, program.flops_per_token, 1, fp8_peak),
            "temp_gb": memory.temp_size_in_bytes / 1e9, "args_gb": memory.argument_size_in_bytes / 1e9,
            "peak_gb": stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None,
            "loss": float(metrics["loss"]), "compile_s": compile_s, "params_m": program.num_params / 1e6}


def table(rows: list[tuple[str, dict]]) -> str:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    lines = ["| variant | step ms | tokens/s | TFLOP/s | MFU | MFU fp8 | temp GB | peak GB | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} ||||||||")
            continue
        lines.append(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
                     f"{fmt(r['mfu'], '.1%')} | {fmt(r.get('mfu_fp8'), '.1%')} | {fmt(r['temp_gb'], '.2f')} | "
                     f"{fmt(r['peak_gb'], '.2f')} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], help="config override for every variant")
    ap.add_argument("--variant", action="append", default=[], help="name:key=value,key=value")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--torch", action="store_true", help="also measure the PyTorch baseline")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant, print JSON
    ap.add_argument("--engine", default="meshtrain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        if args.engine == "torch":
            from torch_baseline import measure as measure_torch  # beside this file

            from meshtrain.config.loader import load_config

            result = measure_torch(load_config(args.config, ["parallel.mesh=1", *json.loads(args.one)]), args.steps)
        else:
            result = measure(args.config, json.loads(args.one), args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return
    rows = []
    variants = [("meshtrain", v) for v in args.variant or ["default:"]] + [("torch", "pytorch:")] * args.torch
    for engine, variant in variants:
        name, _, extra = variant.partition(":")
        overrides = args.set + [kv for kv in extra.split(",") if kv]
        run = subprocess.run([sys.executable, __file__, "--config", args.config, "--steps", str(args.steps),
                              "--one", json.dumps(overrides), "--engine", engine], capture_output=True, text=True)
        found = [line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if found:
            result = json.loads(found[0])
        else:
            result = {"error": (run.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        rows.append((name, result))
        print(f"{name}: {json.dumps(result)}", flush=True)
    print(f"\n{args.config}, {' '.join(args.set)}, {args.steps} timed steps, "
          f"{rows[0][1].get('device', '?')}\n{table(rows)}")


if __name__ == "__main__":
    main()
