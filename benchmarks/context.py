"""The planner's per-device memory for Llama 3 8B at long sequences over context-parallel sizes:
8 sequences on fsdp=8 x context=C devices (ring attention, remat=full, zero 3, bf16), each plan
compiled ahead of time on simulated CPU devices by `python -m meshtrain.plan` (one process per
device count). Beside each: the activations the formula says remat=full keeps (every layer's
input, 2 bytes x s/C x b x h per layer, Korthikanti et al. 2022 section 5) and C=1's temporaries
over C's.

    python benchmarks/context.py                 # 8k, 32k, 128k x C = 1, 2, 4, 8 (minutes)
    python benchmarks/context.py --seq 8192 --context 1 2
"""
import argparse
import json
import subprocess
import sys

GB = 1e9


def plan(seq: int, context: int) -> dict:
    cmd = [sys.executable, "-m", "meshtrain.plan", "--config", "configs/llama3_8b.yaml", "--devices", str(8 * context),
           "--mesh", f"fsdp=8,context={context}", "--set", f"train.seq_len={seq}", "--set", "train.batch_size=8",
           "--set", "parallel.microbatches=1", "--set", "parallel.attention=ring", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--context", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    print("| seq | context | devices | temporaries/device | total/device | fits 80 GB | layer inputs (formula) | "
          "temporaries vs C=1 |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        first = None
        for c in args.context:
            r = plan(seq, c)
            m, model = r["memory"], r["config"]["model"]
            inputs = 2 * seq / c * 1 * model["d_model"] * model["num_layers"]  # b = 1 sequence per fsdp shard
            first = first or m["temporaries"]
            print(f"| {seq:,} | {c} | {r['devices']} | {m['temporaries'] / GB:,.2f} GB | {m['total'] / GB:,.2f} GB | "
                  f"{'yes' if m['fits'] else 'no'} | {inputs / GB:,.2f} GB | {first / m['temporaries']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
