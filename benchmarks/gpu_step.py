"""Where a pod's predicted step goes, and what an XLA:GPU compiler option changes in it: the config's
train step compiled by XLA's GPU compiler for its pod (compile-only devices, no GPU) and walked as the
planner prices it (meshtrain/planner/kernel_time.py, the calibrated KERNEL_CONSTANTS; the same step
`python -m meshtrain.plan --compiler gpu` prints), first with the options every GPU step takes
(meshtrain/engine/compiler_options.py), then with each `--option` set on top of them: the step, its GEMMs /
memory-bound kernels / collectives (and how much of them no kernel hides), then the memory-bound
kernels' largest sources by the JAX operation that made them (copies by shape and what they copy).

    python benchmarks/gpu_step.py --config configs/moe_tiny.yaml --devices 8 --set parallel.mesh=data=2,expert=4 \\
        --option xla_gpu_enable_latency_hiding_scheduler=false                # about a minute
    python benchmarks/gpu_step.py --config configs/qwen3_30b_a3b.yaml --devices 64 \\
        --option xla_gpu_enable_pipelined_all_gather=true --option xla_gpu_enable_pipelined_reduce_scatter=true
    python benchmarks/gpu_step.py --config configs/qwen3_30b_a3b.yaml --devices 64 --set parallel.mesh=fsdp=32,expert=2
"""
import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's modules before any namesakes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def walk(cfg, devices: int, device: str, options: dict) -> dict:
    """The walked step of `cfg` on `devices` compile-only `device`s, compiled with `options` on top of the
    program's own."""
    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.engine.program import TrainProgram
    from meshtrain.planner import compilers, hlo, kernel_time, ticks

    target = compilers.choose("gpu", device, devices, 8)
    profile = DEVICE_PROFILES[device]
    with target.compiling():
        program = TrainProgram.from_config(cfg, devices=target.devices)
        text = program.lower().compile(compiler_options=options or None).as_text()
    tick_plan = ticks.tick_plan(program)  # a pipeline's: each stage's branches, each tick its slowest stage
    records = hlo.read(text, devices, correct=False, tick_plan=tick_plan)
    link_s = kernel_time.link_seconds(records, program.sizes, profile, profile["devices_per_node"])

    class BySource(kernel_time.StepTime):
        sources = Counter()

        def kernel(self, comp, ins, times):
            seconds = super().kernel(comp, ins, times)
            found = self.work(comp, ins)
            if found and found[0] == "memory":
                if ins.op == "copy":
                    source = self.module.comps[comp].get(ins.operands[0]) if ins.operands else None
                    name = f"copy {ins.shape.split('{')[0]} of a {source.op if source else '?'}"
                else:
                    op_name = re.search(r'op_name="([^"]*)"', ins.line)
                    name = "/".join(op_name.group(1).split("/")[-3:]) if op_name else ins.op
                self.sources[name] += times * seconds
            return seconds

    w = BySource(text, profile, link_s, tick_plan)
    step = w.run(w.module.entry)
    busy = sum(w.parts[k] for k in ("gemm", "attention", "memory", "pipeline_wait"))
    return {"step": step, "parts": dict(w.parts), "exposed": max(0.0, step - busy), "sources": w.sources}


def main():
    from meshtrain.planner.compilers import GPU_TARGETS

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--devices", type=int, required=True, help="the pod's GPUs (the config's `# pod:` comment)")
    p.add_argument("--device", default="h100", choices=sorted(GPU_TARGETS))
    p.add_argument("--set", action="append", default=[], help="config overrides, key=value")
    p.add_argument("--option", action="append", default=[],
                   help="an XLA:GPU compiler option, name=true|false|number, compared with the program's own")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    from meshtrain.config.loader import load_config

    value = lambda v: {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    options = dict((k, value(v)) for k, v in (o.split("=", 1) for o in args.option))
    cfg = load_config(args.config, args.set)
    runs = [("the program's options", {})] + ([(", ".join(args.option), options)] if options else [])
    for label, opts in runs:
        r = walk(cfg, args.devices, args.device, opts)
        parts = r["parts"]
        print(f"{label}: step {r['step'] * 1e3:,.2f} ms; GEMMs {parts.get('gemm', 0) * 1e3:,.2f}, attention "
              f"{parts.get('attention', 0) * 1e3:,.2f}, memory-bound {parts.get('memory', 0) * 1e3:,.2f}, collectives "
              f"{parts.get('collectives', 0) * 1e3:,.2f} ms on their links, {r['exposed'] * 1e3:,.2f} ms not hidden"
              + (f"; pipeline ticks waiting for their slowest stage {parts['pipeline_wait'] * 1e3:,.2f} ms"
                 if parts.get("pipeline_wait") else ""))
        for name, seconds in r["sources"].most_common(args.top):
            print(f"  {seconds * 1e3:10.2f} ms  {name}")


if __name__ == "__main__":
    main()
