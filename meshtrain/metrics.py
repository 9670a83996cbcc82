"""FLOPs model, device peak table, MFU, and the console / metrics.jsonl writers.

Model FLOPs per token (training, forward + backward = 3 x forward), the PaLM-paper convention:
    6 * N  +  12 * layers * width * seq
where N counts the parameters used in matmuls (the embedding table only when it doubles as the
tied output head) and the second term is attention's QK^T and AV. MFU = achieved model FLOP/s
divided by the device's dense bf16 peak (not the 2x "sparse" figure).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

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


class MetricsLog:
    """Progress lines on stdout and one JSON object per record in <out>/metrics.jsonl.
    Only the primary process (process 0) writes.

    A run that resumes from step k (or starts fresh: k = 0) first drops the file's records past k,
    written by the attempt it replaces, so the file holds each step once."""

    def __init__(self, out_dir: str | Path, primary: bool = True, keep_through: int | None = None):
        self.primary = primary
        self.path = Path(out_dir) / "metrics.jsonl"
        self.history: list[dict] = []
        self._file = None
        if primary:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if keep_through is not None and self.path.exists():
                self._drop_records_after(keep_through)
            self._file = open(self.path, "a")

    def _drop_records_after(self, step: int) -> None:
        kept = [line for line in self.path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    def rewind(self, step: int) -> None:
        """Forget the records past `step` (a guard rollback is about to train those steps again)."""
        self.history = [r for r in self.history if r.get("step", 0) <= step]
        if self._file:
            self._file.close()
            self._drop_records_after(step)
            self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        self.history.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self.primary:
            print(format_record(record), flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def format_record(r: dict) -> str:
    if "eval_loss" in r:
        return f"step {r['step']:>6}  eval_loss {r['eval_loss']:.4f}"
    if "checkpoint_blocking_s" in r:
        return f"step {r['step']:>6}  checkpoint started (blocked the loop {r['checkpoint_blocking_s'] * 1e3:.1f}ms)"
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}",
             f"lr {r['lr']:.2e}", f"tokens/s {r['tokens_per_sec']:,.0f}", f"step_time {r['step_time_s'] * 1e3:.1f}ms"]
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    if "router_aux_loss" in r:
        parts.append(f"router aux {r['router_aux_loss']:.3f} z {r['router_z_loss']:.3f} dropped {r['dropped']:.1%} "
                     f"load max/mean {r['expert_load_max']:.2f}")
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu']:.1%} ({r['tflops_per_device']:.0f} TFLOP/s/device)")
    return "  ".join(parts)
