"""Devices: one slot per concurrent trial (--parallel K), each 1/K of the visible GPUs (through
CUDA_VISIBLE_DEVICES) or of --devices simulated CPU devices."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from meshtrain.core.errors import UserError


@dataclass
class Slot:
    env: dict
    args: list
    label: str


def visible_gpus() -> list[str]:
    """The GPUs a trial could use, found without starting JAX (which would take their memory)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return found.stdout.split() if found.returncode == 0 else []


def device_slots(parallel: int, devices: int | None, gpus: list[str]) -> list[Slot]:
    if gpus and len(gpus) % parallel:
        raise UserError(f"--parallel {parallel} does not divide the {len(gpus)} visible GPUs; "
                        f"pick a divisor of {len(gpus)}")
    if devices and devices % parallel:
        raise UserError(f"--parallel {parallel} does not divide --devices {devices}; each trial gets devices/K")
    slots = []
    for s in range(parallel):
        env, args, label = {}, [], []
        if gpus:
            share = gpus[s * len(gpus) // parallel:(s + 1) * len(gpus) // parallel]
            if parallel > 1:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(share)
            label.append(f"GPU {','.join(share)}")
        if devices:
            args = ["--devices", str(devices // parallel)]
            if not gpus:
                label.append(f"{devices // parallel} CPU device(s)")
        slots.append(Slot(env, args, " ".join(label) or "the machine's devices"))
    return slots

