"""The memory a run can really use on one device, and the planner's verdict against it.

A GPU's memory is not all the runtime's: JAX preallocates a fraction of it for XLA's allocator,
0.75 unless `XLA_CLIENT_MEM_FRACTION` (or its older name `XLA_PYTHON_CLIENT_MEM_FRACTION`) says
otherwise (docs.jax.dev, "GPU memory allocation"); a TPU's runtime uses the whole HBM. Of that
usable memory the planner keeps a headroom free (`HEADROOM`, 10% unless --headroom): the
allocator's fragmentation and the collective libraries' buffers (NCCL's per-communicator channels
and staging), which no compiled program reports. So, per device:

    usable = memory x fraction        budget = usable x (1 - headroom)

A peak within the budget FITS, with its margin (budget - peak); one within the usable memory but not
the budget fits with less margin than the headroom (TIGHT); one above the usable memory DOES NOT FIT.

Host memory (parallel.offload keeps the optimizer state there): a host's system memory (--host-memory,
default the device profile's; a host is a DGX/HGX node, a GB200 NVL72 rack's compute tray of 4 GPUs:
meshtrain/core/metrics.py `devices_per_host`) is shared by the processes of its devices, one per GPU, so
a device's share is host_memory / (devices on the host), of which HOST_RESERVE is kept for the operating
system, the data pipeline and the runtime's own pinned staging buffers.
"""
from __future__ import annotations

import os

from meshtrain.core.errors import UserError

GPU_PREALLOCATED = 0.75  # JAX's default XLA_CLIENT_MEM_FRACTION
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
HEADROOM = 0.10
HOST_RESERVE = 0.10


def memory_fraction(profile: dict, override: float | None = None, env=None) -> tuple[float, str]:
    """(fraction of the device's memory the runtime may use, where it came from)."""
    env = os.environ if env is None else env
    if override is not None:
        return _fraction(override, "--mem-fraction"), "--mem-fraction"
    if profile.get("preallocates", True):
        for name in FRACTION_VARIABLES:
            if env.get(name):
                return _fraction(env[name], name), name
        return GPU_PREALLOCATED, "JAX's default preallocation on GPUs; XLA_CLIENT_MEM_FRACTION sets it"
    return 1.0, f"{profile['name']}: the runtime's whole memory"


def _fraction(value, source: str) -> float:
    try:
        fraction = float(value)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise UserError(f"{source}={value!r} is not a fraction of the device's memory; use a number in (0, 1], "
                        f"e.g. 0.9")
    return fraction


def budget(device_memory: float, fraction: float, headroom: float = HEADROOM, source: str = "") -> dict:
    usable = device_memory * fraction
    return {"device_memory": device_memory, "fraction": fraction, "fraction_source": source, "usable": usable,
            "headroom": headroom, "budget": usable * (1 - headroom)}


def verdict(peak: float, b: dict) -> dict:
    """'fits', 'tight' (within the usable memory, not the headroom) or 'does not fit', and the
    margin: budget - peak (negative when it does not fit within the budget)."""
    status = "fits" if peak <= b["budget"] else "tight" if peak <= b["usable"] else "does not fit"
    return {"status": status, "peak": peak, "margin": b["budget"] - peak}


def host_budget(host_memory: float, devices: int, devices_per_host: int, source: str) -> dict:
    """One device's share of its host's memory (module doc) and the budget within it."""
    sharing = min(devices, devices_per_host)
    share = host_memory / sharing
    return {"host_memory": host_memory, "source": source, "sharing": sharing, "share": share,
            "reserve": HOST_RESERVE, "budget": share * (1 - HOST_RESERVE)}
