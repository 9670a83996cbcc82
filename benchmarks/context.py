"""The planner's per-device memory for Llama 3 8B at long sequences over context-parallel sizes:
8 sequences on fsdp=8 x context=C devices (remat=full, zero 3, bf16, one microbatch; ring
attention for C > 1, the blockwise kernel at C = 1), each plan compiled ahead of time on simulated
CPU devices by `python -m meshtrain.plan` (one process per device count). Beside each: the
activations the formula says remat=full keeps (every layer's input, 2 bytes x s/C x b x h per
layer, Korthikanti et al. 2022 section 5), C's temporaries and total over C=1's, and the run's
verdict (train, eval and generation against 75% of 80 GB less 10%).

    python benchmarks/context.py                 # 8k, 32k, 128k x C = 1, 2, 4, 8 (about 10 minutes)
    python benchmarks/context.py --seq 8192 --context 1 2
"""
import argparse
import json
import subprocess
import sys

GB = 1e9


def plan(seq: int, context: int) -> dict:
    attention = "ring" if context > 1 else "blockwise"
    cmd = [sys.executable, "-m", "meshtrain.plan", "--config", "configs/llama3_8b.yaml", "--devices", str(8 * context),
           "--mesh", f"fsdp=8,context={context}", "--set", f"train.seq_len={seq}", "--set", "train.batch_size=8",
           "--set", "parallel.microbatches=1", "--set", f"parallel.attention={attention}", "--search-budget", "0",
           "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--context", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    print("| seq | C | devices | temporaries/device | total/device | temporaries, C over C=1 | total, C over C=1 | "
          "layer inputs kept (formula) | verdict (run peak) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        first = None
        for c in args.context:
            r = plan(seq, c)
            m, model, v = r["memory"], r["config"]["model"], r["verdict"]
            inputs = 2 * seq / c * 1 * model["d_model"] * model["num_layers"]  # b = 1 sequence per fsdp shard
            first = first or m
            print(f"| {seq:,} | {c} | {r['devices']} | {m['temporaries'] / GB:,.2f} GB | {m['total'] / GB:,.2f} GB | "
                  f"{m['temporaries'] / first['temporaries']:.2f}x | {m['total'] / first['total']:.2f}x | "
                  f"{inputs / GB:,.2f} GB | {v['status']} ({v['peak'] / GB:,.2f} GB) |", flush=True)


if __name__ == "__main__":
    main()
