"""`parallel.precision`'s low-precision recipes: bf16 whose transformer projections and MLP run as
low-precision GEMMs, one entry each (the einsum, what its backward saves, the peak its GEMMs run at, the
GPUs that have them).

- fp8, fp8_rowwise (meshtrain/ops/fp8.py): per-tensor and per-row scaled fp8; Ada, Hopper, Blackwell.
- mxfp8, nvfp4 (meshtrain/ops/block_scaled.py): block-scaled fp8 and fp4; Blackwell's block-scaled tensor
  cores only (XLA's GPU compiler expands them to a dequantization and a bf16 GEMM before compute
  capability 10.0: slower than bf16).
- fp8_blockwise (meshtrain/ops/block_scaled.py): DeepSeek-V3's 1 x 128 and 128 x 128 blocks with fp32
  scales, on meshtrain's Pallas Triton fp8 GEMM; Hopper and Blackwell.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax.numpy as jnp

from meshtrain.ops.block_scaled import FP8_BLOCKWISE, fp8_blockwise_einsum, mxfp8_einsum, nvfp4_einsum
from meshtrain.ops.fp8 import fp8_einsum, fp8_rowwise_einsum
from meshtrain.ops.platform import installed_cudnn


@dataclasses.dataclass(frozen=True)
class Recipe:
    """`einsum`: what the projections run; `saved_bytes`: per element a matmul saves for its backward (an
    fp8 copy, or the bf16 operand requantized there); `peak`: the device profile's key for its GEMMs'
    dense peak (meshtrain/core/metrics.py); `capability`: the least NVIDIA compute capability with
    those GEMMs; `gpus`: who has them, for the error; `gathered_bytes`: per element of a weight the recipe
    quantizes, what FSDP's all-gather moves on XLA's GPU compiler, which quantizes before the gather (the
    values and their block scales: e4m3 + an E8M0 per 32, e2m1 + an e4m3 per 16, e4m3 + an fp32 per 128 of a
    128 x 128 block's row; meshtrain/planner/traffic.py;
    checked by tests/test_gpu_compile.py); `cudnn`: the least cuDNN XLA makes the GEMMs with (its block-scaled
    GEMM is cuDNN's from 9.10: before, a dequantization and a bf16 GEMM; tests/test_gpu_compile.py), or None."""
    einsum: object
    saved_bytes: int
    peak: str
    capability: tuple[int, int]
    gpus: str
    gathered_bytes: float
    cudnn: tuple[int, int] | None = None


_FP8_GPUS = "Ada, Hopper, Blackwell: L40S, H100, H200, B200, GB200"
RECIPES = {
    "fp8": Recipe(fp8_einsum, 1, "peak_fp8_flops", (8, 9), _FP8_GPUS, 1.0),
    "fp8_rowwise": Recipe(fp8_rowwise_einsum, 2, "peak_fp8_flops", (8, 9), _FP8_GPUS, 1.0),
    # Triton's fp8 tensor-core GEMMs: Hopper's wgmma and Blackwell's
    "fp8_blockwise": Recipe(fp8_blockwise_einsum, 2, "peak_fp8_flops", (9, 0),
                            "Hopper, Blackwell: H100, H200, B200, GB200", 1 + 4 / FP8_BLOCKWISE.block),
    "mxfp8": Recipe(mxfp8_einsum, 2, "peak_fp8_flops", (10, 0), "Blackwell: B200, GB200", 1 + 1 / 32, (9, 10)),
    "nvfp4": Recipe(nvfp4_einsum, 2, "peak_fp4_flops", (10, 0), "Blackwell: B200, GB200", 0.5 + 1 / 16, (9, 10)),
}


def is_low_precision(precision: str) -> bool:
    """Whether `precision` is one of the recipes (its projections' GEMMs below bf16)."""
    return precision in RECIPES


def recipe_refusal(precision: str, device, cudnn: tuple[int, int] | None = None) -> str | None:
    """Why a recipe cannot run its GEMMs on `device` (a GPU before the recipe's compute capability, or with
    a cuDNN before the recipe's: `cudnn`, else the one a run of this install uses, platform.py
    `installed_cudnn`, which the planner's GPU target names too; XLA would run them upcast, slower than
    bf16), or None (any other precision, device or platform: a CPU computes the recipe's numbers exactly)."""
    capability = getattr(device, "compute_capability", None)
    if not is_low_precision(precision) or device.platform != "gpu" or not capability:
        return None
    recipe = RECIPES[precision]
    found = tuple(int(x) for x in str(capability).split("."))
    if found >= recipe.capability:
        cudnn = (cudnn or installed_cudnn()) if recipe.cudnn else None
        if cudnn and cudnn < recipe.cudnn:
            least, found = ".".join(map(str, recipe.cudnn)), ".".join(map(str, cudnn))
            return (f"parallel.precision={precision}: its block-scaled GEMMs need cuDNN {least} or newer and this "
                    f"install has cuDNN {found}, with which XLA would dequantize them to bf16 GEMMs, slower than "
                    f"bf16: upgrade cuDNN (pip install -U nvidia-cudnn-cu12), or set parallel.precision=fp8 or bf16")
        return None
    runs_here = [name for name, r in RECIPES.items() if found >= r.capability]
    least = ".".join(map(str, recipe.capability))
    return (f"parallel.precision={precision}: the {device.device_kind} (compute capability {capability}) has no "
            f"{precision} GEMMs, which need {least} or newer ({recipe.gpus}); XLA would run the recipe upcast, slower "
            f"than bf16: set parallel.precision={' or '.join(runs_here + ['bf16'])}")


def low_peak(precision: str) -> str | None:
    """The device profile's key for a recipe's GEMM peak ("peak_fp8_flops", "peak_fp4_flops"), None for
    bf16, fp16 and fp32."""
    return RECIPES[precision].peak if is_low_precision(precision) else None


def matmul_for(precision: str):
    """The einsum the transformer's projections and MLP run under a precision: its recipe's, else
    jnp.einsum."""
    return RECIPES[precision].einsum if is_low_precision(precision) else jnp.einsum


# parallel.bf16_layers: while a layer kept in bf16 is traced (models/base.py `scan_blocks`), its projections
# run jnp.einsum whatever the model's recipe
_IN_BF16: contextvars.ContextVar = contextvars.ContextVar("meshtrain_bf16_layers", default=False)


@contextlib.contextmanager
def bf16_projections():
    """Trace the blocks inside with their projections and MLP in bf16 (the layers a recipe leaves out)."""
    token = _IN_BF16.set(True)
    try:
        yield
    finally:
        _IN_BF16.reset(token)


def in_bf16() -> bool:
    """Whether the blocks traced now are ones a recipe leaves in bf16 (inside `bf16_projections`)."""
    return _IN_BF16.get()


def projection_einsum(matmul):
    """The einsum a block's projections run: the model's `matmul` (its recipe's), jnp.einsum inside
    `bf16_projections`."""
    return jnp.einsum if in_bf16() else matmul
