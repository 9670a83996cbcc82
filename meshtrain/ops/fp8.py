"""FP8 matmuls with per-tensor current scaling (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"): the forward's operands in float8_e4m3fn (largest finite 448, 3 mantissa bits), the
backward's output cotangent in float8_e5m2 (57344, 2 mantissa bits: range for gradients).

Each tensor t gets its own scale from itself, every call ("current" scaling: torchao's tensorwise
float8 recipe, Transformer Engine's Float8CurrentScaling):
    s = amax(|t|) / fmax   (s = 1 when amax = 0),    q = clip(t / s, -fmax, fmax) -> fp8,    dq = q x s.
The matmul takes the fp8 operands themselves, as the GEMM does: an einsum of the fp8 tensors
accumulated in fp32, times the two scales in fp32, rounded to the output dtype once:
    y = (sx x sw) . einsum(qx, qw)    (an fp8 GEMM with the scales as its alpha).
On a GPU, XLA's compiler keeps that form's fp8 operands (a Triton or cuBLASLt fp8 GEMM with the
scaling fused: `python -m meshtrain.plan` counts its GEMMs by operand type), where a quantize-dequantize
(QDQ) einsum of bf16 values loses them: the GPU pipeline, allowed excess precision by default, folds
the bf16 -> fp8 -> bf16 round trip away and runs bf16 GEMMs. On a CPU the same graph computes the
fp8 GEMM's numbers exactly (products of fp8 values are exact in fp32). `fp8_einsum` keeps the fp8
operands and their scales as its residuals (1 byte per saved element) and differentiates with the
cotangent quantized to e5m2, each gradient one more fp8 GEMM:
    dx = (sg x sw) . einsum^T(qg, qw),    dw = (sx x sg) . einsum^T(qx, qg).
Delayed scaling (a scale from an amax history of earlier steps) is left out: it needs per-matmul
state through the layer scan, the pipeline stages and microbatch accumulation, and torchao removed
it once current scaling ran as fast. So fp8 adds no train state and nothing to checkpoint, and
nothing overflows: the scale maps each tensor's own amax onto fmax. Under jit a sharded tensor's amax
is the whole tensor's; inside a shard_map (the manual data axis, the MoE row shards) it is the
device's part's, each device's scale for its own GEMM.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(jnp.finfo(dtype).max)


def quantize(t, dtype):
    """(q, s): t / s clipped to +-fmax in fp8 `dtype`, with s = amax(|t|) / fmax (1 when t is 0)
    computed in fp32 and held in t's dtype, the dtype the division and the GEMM's scaling run in."""
    fmax = fp8_max(dtype)
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    s = jnp.where(amax > 0, amax / fmax, 1.0).astype(t.dtype)
    return jnp.clip(t / s, -fmax, fmax).astype(dtype), s


def dequantize(q, s):
    """q x s, in the scale's dtype."""
    return q.astype(s.dtype) * s


def scaled_einsum(spec: str, qa, sa, qb, sb):
    """(sa x sb) . einsum(spec, qa, qb): fp8 operands straight into the dot, fp32 accumulation, the
    scales applied in fp32 and one rounding to the scales' dtype (the GEMM's alpha and output type)."""
    y = jnp.einsum(spec, qa, qb, preferred_element_type=jnp.float32)
    alpha = sa.astype(jnp.float32) * sb.astype(jnp.float32)
    return (y * alpha).astype(jnp.result_type(sa, sb))


def transposed_specs(spec: str) -> tuple[str, str]:
    """The einsums of the two gradients of `spec` ("x,w->y"): "y,w->x" and "x,y->w". Each index of an
    operand must be in the other operand or the output (no index summed within one operand alone)."""
    x, rest = spec.replace(" ", "").split(",")
    w, y = rest.split("->")
    if set(x) - set(w + y) or set(w) - set(x + y):
        raise ValueError(f"fp8_einsum: {spec!r} sums an index within one operand; reduce it first")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) as an fp8 GEMM: both operands through e4m3 (current scaling), the
    cotangent through e5m2 in the backward; output in the operands' dtype. A drop-in for the model's
    einsums."""
    return _fwd(spec, x, w)[0]


def _fwd(spec, x, w):
    (qx, sx), (qw, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return scaled_einsum(spec, qx, sx, qw, sw), (qx, sx, qw, sw)


def _bwd(spec, residuals, g):
    qx, sx, qw, sw = residuals
    qg, sg = quantize(g, E5M2)
    dx_spec, dw_spec = transposed_specs(spec)
    return scaled_einsum(dx_spec, qg, sg, qw, sw), scaled_einsum(dw_spec, qx, sx, qg, sg)


fp8_einsum.defvjp(_fwd, _bwd)


def matmul_for(precision: str):
    """The einsum the transformer's projections and MLP run under a precision: `fp8_einsum` under
    fp8, jnp.einsum otherwise."""
    return fp8_einsum if precision == "fp8" else jnp.einsum
