"""FLOPs model, device peak table, MFU. (The metric writers: meshtrain/run/loggers.py.)

Model FLOPs per token (training, forward + backward = 3 x forward), the PaLM convention (Chowdhery
et al. 2022, appendix B):
    6 * N  +  12 * L * H * K * S
N counts the parameters used in matmuls (the embedding table only when it doubles as the tied
output head; a MoE token's active experts only); the second term is attention's QK^T and AV over
L layers, H query heads of width K (the attention width H x K, which need not be d_model), S the
sequence length: 2 x 2HKS forward per token and layer, x3 with the backward, causal masking not
halved; a sliding-window layer's S is min(S, window) (its keys per query, as MaxText counts Gemma's).
Recomputed work (remat, a pipeline's recompute) is not model FLOPs: MFU counts the model's
work once, whatever the run spends (hardware FLOPs, HFU: meshtrain/planner/roofline.py). MFU = achieved
model FLOP/s divided by the device's dense bf16 peak (not the 2x "sparse" figure), under
precision=fp8 too (the convention: NVIDIA's and torchao's fp8 MFUs are against bf16), with the MFU
against the dense fp8 peak beside it where the device has one.
"""
from __future__ import annotations

# Dense bf16 peak FLOP/s per device, matched by substring of jax's device_kind (`named_in`: the longest).
PEAK_BF16_FLOPS = {
    "GB200": 2500e12,
    "B200": 2250e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v4": 275e12,
}
# Dense fp8 (e4m3/e5m2) tensor-core peak FLOP/s, 2x bf16 on Hopper; devices without fp8 matmuls absent.
PEAK_FP8_FLOPS = {
    "GB200": 5000e12,
    "B200": 4500e12,
    "H200": 1979e12,
    "H100 PCIe": 1513e12,
    "H100": 1979e12,
}
# Dense fp4 (NVFP4, block-scaled e2m1) tensor-core peak FLOP/s: Blackwell's (HGX B200 datasheet: 144 PFLOP/s
# sparse for 8 GPUs -> 9 dense per GPU; GB200 NVL72's 1,440 for 72 -> 10).
PEAK_FP4_FLOPS = {
    "GB200": 10000e12,
    "B200": 9000e12,
}
LOW_PRECISION_PEAKS = {"peak_fp8_flops": PEAK_FP8_FLOPS, "peak_fp4_flops": PEAK_FP4_FLOPS}
LOW_PEAK_NAMES = {"peak_fp8_flops": "fp8", "peak_fp4_flops": "fp4"}

# The planner's device profiles (meshtrain/planner/roofline.py): dense bf16 (and fp8, where the device
# has fp8 matmuls: `peak_fp8_flops`) peak FLOP/s, HBM bytes and
# bytes/s, and the two links a device's collectives run on, in bytes/s per device and direction:
# `in_node_bw` among the `devices_per_node` devices of one node (NVLink through NVSwitch; a TPU
# slice's ICI), `cross_node_bw` between nodes (the node's NICs / the data-center network, DCN).
# `capability`: an NVIDIA GPU's compute capability (CUDA's table), which kernels it has.
# `preallocates`: JAX's GPU allocator takes a fraction of the memory (meshtrain/planner/budget.py); TPUs use it all.
# Sources (vendor datasheets and user guides):
# - H100 SXM5 80GB: HBM3 3.35 TB/s; NVLink 4 900 GB/s per GPU, both directions together (18 links
#   x 50 GB/s) -> 450 GB/s each way. DGX/HGX H100: 8 GPUs on NVSwitch, one 400 Gb/s ConnectX-7
#   (InfiniBand NDR) per GPU for the compute fabric -> 50 GB/s each way.
# - H200 SXM 141GB: HBM3e 4.8 TB/s; NVLink 4 and the DGX/HGX H200 network as the H100's.
# - B200 (NVIDIA HGX B200 and DGX B200 datasheets, per GPU of 8, dense = half the sparse figures): bf16
#   2.25 PFLOP/s, fp8 (and MXFP8) 4.5, fp4 (NVFP4) 9, tf32 1.125; 180 GB HBM3e at 8 TB/s; NVLink 5 1.8
#   TB/s per GPU both directions -> 900 GB/s each way; DGX B200: one 400 Gb/s ConnectX-7 per GPU -> 50 GB/s.
# - GB200 (NVIDIA GB200 NVL72 datasheet: 72 GPUs and 36 Grace CPUs, rack figures / 72, dense = half the
#   sparse): bf16 2.5 PFLOP/s, fp8 5, fp4 10, tf32 1.25; 13.4 TB HBM3e at 576 TB/s -> 186 GB at 8 TB/s;
#   NVLink 5 1.8 TB/s per GPU both directions -> 900 GB/s each way, among all 72 GPUs of the rack (one
#   NVLink domain: a "node" of 72); one 400 Gb/s ConnectX-7 per GPU between racks -> 50 GB/s.
# - A100 SXM4 80GB: HBM2e 2,039 GB/s; NVLink 3 600 GB/s per GPU both ways (12 x 50) -> 300 GB/s.
#   DGX A100: 8 GPUs, one 200 Gb/s ConnectX-6 (InfiniBand HDR) per GPU -> 25 GB/s.
# Host memory (parallel.offload, meshtrain/ops/offload.py): `host_bw`, the GPU's host link in bytes/s
# each way, and `host_memory`, one node's system memory (DGX datasheets): H100 and H200 SXM, PCIe Gen5
# x16 "128 GB/s" both ways -> 64 GB/s each way, DGX H100/H200 2 TB; B200 PCIe Gen5 x16 -> 64 GB/s, DGX
# B200 2 TB (4 TB optional); A100 SXM4 PCIe Gen4 x16 "64 GB/s" -> 32 GB/s, DGX A100 2 TB; GB200, the
# Grace's NVLink-C2C, 900 GB/s both ways for the superchip's two GPUs -> 225 GB/s each way per GPU when
# both move (as every GPU of a step does). `host_memory` is a host's: a DGX/HGX node is one host; a GB200
# NVL72 rack is 18 compute trays, each a host of 4 GPUs (`devices_per_host`) and two Graces' 480 GB of
# LPDDR5X (the rack's 17 TB / 18 -> 960 GB).
# - TPU v5p (cloud.google.com/tpu/docs/v5p): 95 GiB HBM2e at 2,765 GB/s; ICI 1,200 GB/s per chip
#   bidirectional -> 600 GB/s each way; DCN 50 Gb/s per chip -> 6.25 GB/s. A "node" is a slice (one
#   ICI domain): 6,144 chips is the largest slice a job can have (16x16x24), so any mesh up to that
#   is one node unless --devices-per-node says otherwise.
#
# The GPU program's step time (meshtrain/planner/kernel_time.py) adds `peak_tf32_flops` (f32 GEMMs run
# as TF32 on tensor cores, XLA's default precision: dense 494.7 TFLOP/s on H100/H200 SXM, 156 on A100,
# the datasheets' figures without sparsity) and `kernels`, KERNEL_CONSTANTS: what share of those peaks
# the kernels reach, and the shortest launch. They are fitted (`python benchmarks/step_time.py --fit`:
# the worst |log(predicted / measured)| of the calibration rows, a grid refined twice) on three steps
# measured with JAX 0.11.2 (benchmarks/RESULTS.md): H200 llama_1b batch 8 with cuDNN attention (272.3
# ms) and with XLA's attention (674.2 ms), and H100 llama3-8b's shape with 4 layers, batch 2, remat
# full, blockwise attention (1,131.6 ms). Held out, each within 3.2% of its prediction: H200 llama_1b
# batch 16 cuDNN (530.9 ms), batch 8 blockwise (654.7 ms), H100 llama3-8b batch 4 in 2 microbatches
# save_matmuls (1,991.1 ms). One set serves the H100 and H200 (one GH100 die); the A100, B200 and GB200 take the
# same shares, not calibrated on any of them (`kernels_calibrated` False: the plan says so).
# - gemm_peak: a large GEMM's share of the dense peak of its operand type (fitted);
# - gemm_half_size: a GEMM side of this many rows or columns runs at half that share (the 128-wide
#   tensor-core tile edge: not fitted);
# - attention_efficiency: cuDNN's fused attention, its share of the bf16 peak (fitted as gemm_peak:
#   the three rows cannot tell the two apart);
# - hbm_efficiency: a memory-bound kernel's share of the HBM bandwidth (fitted);
# - launch_s: the shortest a kernel takes, launch and issue (fitted);
# - grouped_gemm_peak: meshtrain's Triton grouped-matmul kernels' share of the peak, in gemm_peak's place
#   (fitted, `python benchmarks/grouped_matmul.py --fit`, on two full buffers measured on an H200 with the
#   shipped tiles, 2026-12-04: 131,072 rows into 128 experts 4.156 ms, 262,144 into 16 6.257 ms, forward
#   and both backward products of D 2048 x F 768; each within 1%. Held out, a buffer 1/8 filled, 2.009 ms,
#   was predicted at 0.60x: the grid's programs over empty tiles are not priced).
KERNEL_CONSTANTS = {"gemm_peak": 0.75, "gemm_half_size": 128, "attention_efficiency": 0.75, "hbm_efficiency": 0.681,
                    "launch_s": 0.75e-6, "grouped_gemm_peak": 0.530}
# A grouped matmul on a partly filled buffer measured on an H200 over its prediction (held out from
# grouped_gemm_peak's fit, above: a buffer `filled` 1/8, 2.009 ms predicted 1.206): the plan says so.
# Measured on the kernels of 2026-12-04, which wrote zeros into the padding rows (priced); the kernels
# since write none, and that buffer's program is priced at 1.119 ms, not measured.
GROUPED_PARTLY_FILLED = {"filled": 1 / 8, "measured_over_predicted": 1.67}
# The fp8 recipes' steps measured on an H200 over the walk's prediction with these constants (held out, not
# fitted: llama_1b batch 8, cuDNN, 232.1 ms predicted 211.2 for fp8, 241.9 predicted 216.0 for fp8_rowwise,
# against bf16's 264.1 predicted 263.3; benchmarks/step_time.py's (12-04) rows): the plan says so.
FP8_MEASURED_OVER_PREDICTED = {"fp8": 1.10, "fp8_rowwise": 1.12}
DEVICE_PROFILES = {
    "h100": {"name": "H100 SXM", "peak_flops": PEAK_BF16_FLOPS["H100"], "peak_fp8_flops": PEAK_FP8_FLOPS["H100"],
             "peak_tf32_flops": 494.7e12, "hbm_bw": 3.35e12, "memory": 80e9,
             "in_node_bw": 450e9, "cross_node_bw": 50e9, "host_bw": 64e9, "host_memory": 2e12,
             "devices_per_node": 8, "kernels": KERNEL_CONSTANTS, "capability": (9, 0)},
    "h200": {"name": "H200 SXM", "peak_flops": PEAK_BF16_FLOPS["H200"], "peak_fp8_flops": PEAK_FP8_FLOPS["H200"],
             "peak_tf32_flops": 494.7e12, "hbm_bw": 4.8e12, "memory": 141e9,
             "in_node_bw": 450e9, "cross_node_bw": 50e9, "host_bw": 64e9, "host_memory": 2e12,
             "devices_per_node": 8, "kernels": KERNEL_CONSTANTS, "capability": (9, 0)},
    "b200": {"name": "B200", "peak_flops": PEAK_BF16_FLOPS["B200"], "peak_fp8_flops": PEAK_FP8_FLOPS["B200"],
             "peak_fp4_flops": PEAK_FP4_FLOPS["B200"],
             "peak_tf32_flops": 1125e12, "hbm_bw": 8e12, "memory": 180e9,
             "in_node_bw": 900e9, "cross_node_bw": 50e9, "host_bw": 64e9, "host_memory": 2e12,
             "devices_per_node": 8, "kernels": KERNEL_CONSTANTS, "capability": (10, 0),
             "kernels_calibrated": False},
    "gb200": {"name": "GB200", "peak_flops": PEAK_BF16_FLOPS["GB200"], "peak_fp8_flops": PEAK_FP8_FLOPS["GB200"],
              "peak_fp4_flops": PEAK_FP4_FLOPS["GB200"],
              "peak_tf32_flops": 1250e12, "hbm_bw": 8e12, "memory": 186e9,
              "in_node_bw": 900e9, "cross_node_bw": 50e9, "host_bw": 225e9, "host_memory": 960e9,
              "devices_per_node": 72, "devices_per_host": 4, "kernels": KERNEL_CONSTANTS, "capability": (10, 0),
              "kernels_calibrated": False},
    "a100": {"name": "A100 SXM 80GB", "peak_flops": PEAK_BF16_FLOPS["A100"], "peak_tf32_flops": 156e12,
             "hbm_bw": 2.039e12, "memory": 80e9,
             "in_node_bw": 300e9, "cross_node_bw": 25e9, "host_bw": 32e9, "host_memory": 2e12,
             "devices_per_node": 8, "kernels": KERNEL_CONSTANTS, "capability": (8, 0),
             "kernels_calibrated": False},
    "tpu-v5p": {"name": "TPU v5p", "peak_flops": PEAK_BF16_FLOPS["TPU v5p"], "hbm_bw": 2.765e12,
                "memory": 95 * 2**30, "in_node_bw": 600e9, "cross_node_bw": 6.25e9, "devices_per_node": 6144,
                "preallocates": False},
}


def devices_per_host(profile: dict, devices_per_node: int) -> int:
    """GPUs a host holds (its processes, its system memory): the profile's `devices_per_host` (a GB200 NVL72
    rack's compute tray: 4 of the NVLink domain's 72), else a node's (a DGX/HGX node is one host)."""
    return min(profile.get("devices_per_host", devices_per_node), devices_per_node)


def named_in(device_kind: str, names) -> str | None:
    """The longest of `names` that jax's `device_kind` contains, case aside ("NVIDIA GB200" is a GB200,
    not the B200 its name also holds; "NVIDIA H100 PCIe" the PCIe card), or None."""
    kind = device_kind.casefold()
    return next((n for n in sorted(names, key=len, reverse=True) if n.casefold() in kind), None)


def peak_flops(device_kind: str, peak: str = "peak_flops") -> float | None:
    """The device's dense bf16 peak FLOP/s (`peak` "peak_fp8_flops" or "peak_fp4_flops": that one), None
    when unknown or absent."""
    table = LOW_PRECISION_PEAKS.get(peak, PEAK_BF16_FLOPS)
    name = named_in(device_kind, table)
    return None if name is None else table[name]


def run_peaks(device_kind: str, low_peak: str | None) -> tuple[float | None, float | None]:
    """A run's MFU denominators: the bf16 peak (MFU's convention, under the low-precision recipes too) and,
    under a recipe (`low_peak`: its GEMMs' peak, meshtrain/ops/recipes.py), that peak beside it (None where
    unknown or absent)."""
    return peak_flops(device_kind), peak_flops(device_kind, low_peak) if low_peak else None


def flops_per_token(matmul_params: int, num_layers: int, attention_width: int, seq_len: int,
                    windows: tuple[int, ...] = ()) -> float:
    """6N + 12 L (H K) S: `attention_width` is num_heads x head_dim (see the module docstring).
    `windows`: each layer's sliding window (0: none), when some has one: a layer attends over
    min(S, window) keys, so the second term is 12 (H K) sum_layers min(S, window)."""
    attended = sum(min(w, seq_len) if w else seq_len for w in windows) if windows else num_layers * seq_len
    return 6.0 * matmul_params + 12.0 * attention_width * attended


def mfu(tokens_per_sec: float, flops_token: float, num_devices: int, peak: float | None) -> float | None:
    if not peak:
        return None
    return tokens_per_sec * flops_token / (num_devices * peak)


def throughput_fields(tokens_per_sec: float, flops_per_token: float, devices: int, peak, peak_fp8,
                      low: str = "fp8") -> dict:
    """MFU and TFLOP/s per device where the device's peak is known (the table above); under a recipe
    (`peak_fp8`: its GEMMs' peak, `low` its name, "fp8" or "fp4"), `mfu_<low>` against it beside."""
    util = mfu(tokens_per_sec, flops_per_token, devices, peak)
    if util is None:
        return {}
    fields = {"mfu": util, "tflops_per_device": tokens_per_sec * flops_per_token / devices / 1e12}
    if peak_fp8:
        fields[f"mfu_{low}"] = mfu(tokens_per_sec, flops_per_token, devices, peak_fp8)
    return fields
