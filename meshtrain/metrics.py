"""FLOPs model, device peak table, MFU. (The metric writers: meshtrain/loggers.py.)

Model FLOPs per token (training, forward + backward = 3 x forward), the PaLM-paper convention:
    6 * N  +  12 * layers * width * seq
where N counts the parameters used in matmuls (the embedding table only when it doubles as the
tied output head) and the second term is attention's QK^T and AV. MFU = achieved model FLOP/s
divided by the device's dense bf16 peak (not the 2x "sparse" figure).
"""
from __future__ import annotations

from meshtrain.loggers import MetricsLog  # noqa: F401  (its earlier home; callers import it here)

# Dense bf16 peak FLOP/s per device, matched by substring of jax's device_kind (first match wins).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v4": 275e12,
}

# The planner's device profiles: peak, HBM bytes/s, interconnect bytes/s per device (one direction),
# memory.
DEVICE_PROFILES = {
    "h100": {"name": "H100 SXM", "peak_flops": PEAK_BF16_FLOPS["H100"], "hbm_bw": 3.35e12, "link_bw": 450e9,
             "memory": 80e9},
    "h200": {"name": "H200 SXM", "peak_flops": PEAK_BF16_FLOPS["H200"], "hbm_bw": 4.8e12, "link_bw": 450e9,
             "memory": 141e9},
    "a100": {"name": "A100 SXM 80GB", "peak_flops": PEAK_BF16_FLOPS["A100"], "hbm_bw": 2.04e12, "link_bw": 300e9,
             "memory": 80e9},
    "tpu-v5p": {"name": "TPU v5p", "peak_flops": PEAK_BF16_FLOPS["TPU v5p"], "hbm_bw": 2.76e12, "link_bw": 600e9,
                "memory": 95e9},
}


def peak_flops(device_kind: str) -> float | None:
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device_kind:
            return flops
    return None


def flops_per_token(matmul_params: int, num_layers: int, d_model: int, seq_len: int) -> float:
    return 6.0 * matmul_params + 12.0 * num_layers * d_model * seq_len


def mfu(tokens_per_sec: float, flops_token: float, num_devices: int, peak: float | None) -> float | None:
    if not peak:
        return None
    return tokens_per_sec * flops_token / (num_devices * peak)
