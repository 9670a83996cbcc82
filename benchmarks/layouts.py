"""Parity table (layout x ZeRO stage -> max loss / parameter difference vs 1 device) and per-device
bytes of the compiled train step against the ZeRO formulas, for the tiny config on 8 CPU devices.

    python benchmarks/layouts.py
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.config import load_config  # noqa: E402
from meshtrain.metrics import MetricsLog  # noqa: E402
from meshtrain.trainer import Trainer  # noqa: E402

LAYOUTS = [("data=8", z) for z in range(4)] + [("fsdp=8", 1), ("data=2,tensor=4", 1), ("2x2x2", 0), ("2x2x2", 3),
                                               ("data=4,fsdp=2", 2)]


def run(mesh, zero, devices=None):
    cfg = load_config("configs/tiny.yaml", [f"mesh={mesh}", f"zero={zero}", f"out={tempfile.mkdtemp()}",
                                            "checkpoint.resume=never"])
    trainer = Trainer(cfg, devices=devices)
    history = trainer.fit(log=MetricsLog("/tmp/meshtrain-bench", primary=False))
    return trainer, np.array([r["loss"] for r in history]), jax.device_get(trainer.state["params"])


def zero_formula(psi, sizes, zero):
    """fp32 Adam: params 4Psi, moments 8Psi; fsdp x tensor always divide, data by stage."""
    n, shard = sizes["data"], sizes["fsdp"] * sizes["tensor"]
    return (4 * psi / (n if zero >= 3 else 1) + 8 * psi / (n if zero >= 1 else 1)) / shard


def main():
    _, ref_losses, ref_params = run("1", 1, jax.devices()[:1])
    print("| mesh | zero | max rel loss diff | max abs param diff | state bytes/device measured | ZeRO formula | ratio |")
    print("|---|---|---|---|---|---|---|")
    for mesh, zero in LAYOUTS:
        trainer, losses, params = run(mesh, zero)
        loss_diff = float(np.max(np.abs(losses - ref_losses) / ref_losses))
        param_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))
        t = trainer.cfg.train
        batch_bytes = t.batch_size * (t.seq_len + 1) * 4 / (trainer.sizes["data"] * trainer.sizes["fsdp"])
        measured = trainer.compiled_step.memory_analysis().argument_size_in_bytes - batch_bytes
        formula = zero_formula(trainer.num_params, trainer.sizes, zero)
        print(f"| {mesh} | {zero} | {loss_diff:.1e} | {param_diff:.1e} | {measured:,.0f} | {formula:,.0f} | "
              f"{measured / formula:.3f} |")


if __name__ == "__main__":
    main()
