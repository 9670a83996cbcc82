"""Parity tables against one device, on 8 CPU devices (fp32, 5 steps of the tiny configs): layout x
ZeRO stage with the compiled step's per-device state bytes against the ZeRO formula; expert
layouts of the moe family (losses, router statistics, parameters; dropless and with drops);
context and sequence parallel layouts; the compiled temporaries with and without sequence
parallelism.

    python benchmarks/layouts.py
"""
import contextlib
import io
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.core.formulas import zero_bytes  # noqa: E402
from meshtrain.testing import MOE_TINY, TINY, max_param_diff, run_tiny  # noqa: E402

LAYOUTS = [("data=8", z) for z in range(4)] + [("fsdp=8", 1), ("data=2,tensor=4", 1), ("2x2x2", 0), ("2x2x2", 3),
                                               ("data=4,fsdp=2", 2)]
MOE_LAYOUTS = [("data=2,expert=4", 0.0), ("expert=2,data=2,fsdp=2", 0.0), ("data=2,pipeline=2,expert=2", 0.0),
               ("expert=2,tensor=2,data=2", 0.0), ("data=2,expert=4", 0.5)]
CONTEXT_LAYOUTS = [("data=4,context=2", False), ("data=2,context=4", False), ("fsdp=2,tensor=2,context=2", False),
                   ("data=2,context=2,pipeline=2", False), ("data=4,tensor=2", True),
                   ("tensor=2,context=2,data=2", True)]
MOE_STATS = ("router_aux_loss", "dropped", "expert_load_max")


def run(mesh, *overrides, config=TINY):
    devices = jax.devices()[:1] if mesh == "1" else None
    with contextlib.redirect_stdout(io.StringIO()):  # the run's banner
        return run_tiny(f"parallel.mesh={mesh}", *overrides, devices=devices, config=config)


def rel_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.maximum(np.abs(np.asarray(b)), 1e-12)))


def zero_table():
    _, ref_losses, ref_params = run("1")
    print("| mesh | zero | max rel loss diff | max abs param diff | state bytes/device measured | ZeRO formula "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for mesh, zero in LAYOUTS:
        trainer, losses, params = run(mesh, f"parallel.zero={zero}")
        p, t = trainer.program, trainer.cfg.train
        batch_bytes = t.batch_size * (t.seq_len + 1) * 4 / (p.sizes["data"] * p.sizes["fsdp"])
        measured = trainer.compiled_step.memory_analysis().argument_size_in_bytes - batch_bytes
        formula = zero_bytes(p.num_params, p.sizes, zero)
        formula = formula["parameters"] + formula["optimizer_state"]
        print(f"| {mesh} | {zero} | {rel_diff(losses, ref_losses):.1e} | {max_param_diff(params, ref_params):.1e} | "
              f"{measured:,.0f} | {formula:,.0f} | {measured / formula:.3f} |")


def moe_table():
    print("| mesh | capacity factor | max rel loss diff | max rel diff " + " / ".join(MOE_STATS) +
          " | max abs param diff | dropped (mean) |")
    print("|---|---|---|---|---|---|")
    for mesh, factor in MOE_LAYOUTS:
        ref, ref_losses, ref_params = run("1", f"model.capacity_factor={factor}", config=MOE_TINY)
        trainer, losses, params = run(mesh, f"model.capacity_factor={factor}", config=MOE_TINY)
        stat = lambda t, k: [r[k] for r in t.history if "loss" in r]
        stats = " / ".join(f"{rel_diff(stat(trainer, k), stat(ref, k)):.1e}" for k in MOE_STATS)
        print(f"| {mesh} | {factor} | {rel_diff(losses, ref_losses):.1e} | {stats} | "
              f"{max_param_diff(params, ref_params):.1e} | {np.mean(stat(trainer, 'dropped')):.1%} |")


def context_table():
    _, ref_losses, ref_params = run("1")
    print("| mesh | sequence parallel | max rel loss diff | max abs param diff |")
    print("|---|---|---|---|")
    for mesh, sp in CONTEXT_LAYOUTS:
        _, losses, params = run(mesh, "parallel.attention=ring", f"parallel.sequence_parallel={sp}")
        print(f"| {mesh} | {sp} | {rel_diff(losses, ref_losses):.1e} | {max_param_diff(params, ref_params):.1e} |")


def sequence_parallel_memory():
    """Compiled temporaries per device of the tiny step on data=4 x tensor=2, without and with
    sequence parallelism, and the all-gathers it adds."""
    from meshtrain.engine.program import TrainProgram
    from meshtrain.planner import hlo
    from meshtrain.testing import tiny_config

    print("| sequence parallel | temporaries/device | all-gathers | all-reduce payload |")
    print("|---|---|---|---|")
    for sp in (False, True):
        cfg = tiny_config("parallel.mesh=data=4,tensor=2", f"parallel.sequence_parallel={sp}")
        compiled = TrainProgram.from_config(cfg).lower().compile()
        found = hlo.collectives(compiled.as_text(), 8)
        print(f"| {sp} | {compiled.memory_analysis().temp_size_in_bytes:,} | {found['all-gather']['count']:.0f} | "
              f"{found['all-reduce']['payload_bytes']:,.0f} |")


def main():
    """Each table against the single-device run of the same config."""
    for table in (zero_table, moe_table, context_table, sequence_parallel_memory):
        table()
        print()


if __name__ == "__main__":
    main()
