"""What meshtrain/planner/hlo.py's corrections of the CPU backend change in a plan: link traffic per device
per step by collective kind, read from the same compiled step as XLA's CPU program runs it and as
a GPU would (bf16 not widened, all-reduce + slice as reduce-scatter, summed all-reduces once),
beside the formula (meshtrain/planner/traffic.py). Compiles on simulated CPU devices, like the planner.

    python benchmarks/hlo_corrections.py                      # llama2-70b on fsdp=16,tensor=8
    python benchmarks/hlo_corrections.py --config configs/llama3_8b.yaml --devices 64 --mesh fsdp=8,tensor=8
"""
import argparse

import jax

from meshtrain.config.loader import load_config
from meshtrain.engine.program import TrainProgram
from meshtrain.parallel.mesh import simulate_cpu_devices
from meshtrain.planner import hlo, ticks, traffic


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/llama2_70b.yaml")
    p.add_argument("--devices", type=int, default=128)
    p.add_argument("--mesh", default="fsdp=16,tensor=8")
    args = p.parse_args()
    jax.config.update("jax_platforms", "cpu")
    simulate_cpu_devices(args.devices)
    cfg = load_config(args.config, [f"parallel.mesh={args.mesh}"])
    cfg.devices = 0
    program = TrainProgram.from_config(cfg)
    text = program.lower().compile().as_text()
    records = hlo.read(text, args.devices, tick_plan=ticks.tick_plan(program))  # a pipeline's: its stages' mean
    raw, fixed = hlo.collectives(text, args.devices, correct=False), hlo.by_kind(records)
    formula = traffic.expected_traffic(program)
    print(f"{args.config} on {args.mesh}: GB per device per step")
    print("| kind | CPU program | as a GPU runs it | formula | GPU / formula |\n|---|---|---|---|---|")
    for kind in hlo.KINDS:
        a, b, f = raw[kind]["traffic_bytes"], fixed[kind]["traffic_bytes"], formula[kind]["traffic_bytes"]
        if a or b or f:
            print(f"| {kind} | {a / 1e9:,.1f} | {b / 1e9:,.1f} | {f / 1e9:,.1f} | {b / f if f else float('nan'):.2f} |")
    print("corrections:", {k: round(v, 1) for k, v in hlo.corrections(records).items()})


if __name__ == "__main__":
    main()
