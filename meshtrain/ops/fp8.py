"""FP8 matmuls with per-tensor current scaling (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"): the forward's operands in float8_e4m3fn (largest finite 448, 3 mantissa bits), the
backward's output cotangent in float8_e5m2 (57344, 2 mantissa bits: range for gradients).

Each tensor t gets its own scale from itself, every call ("current" scaling: torchao's tensorwise
float8 recipe, Transformer Engine's Float8CurrentScaling):
    s = amax(|t|) / fmax   (s = 1 when amax = 0),    q = clip(t / s, -fmax, fmax) -> fp8,    dq = q x s.
The matmul is a quantize-dequantize (QDQ) pattern around an ordinary einsum of dq's in the compute
dtype (bf16; fp32 accumulation, as XLA's dots do): XLA's GPU GemmRewriter fuses convert -> multiply
-> dot into one cuBLASLt FP8 GEMM with the scales as its alpha, and on a CPU the same graph
computes the fp8 numerics exactly. `fp8_einsum` keeps the fp8 operands and their scales as its
residuals (1 byte per saved element) and differentiates with the cotangent quantized to e5m2:
    dx = einsum^T(dq(g), dq(w)),    dw = einsum^T(dq(x), dq(g)).
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) with both operands through e4m3 (current scaling) and the cotangent
    through e5m2 in the backward; output in the operands' dtype. A drop-in for the model's einsums."""
    return _fwd(spec, x, w)[0]


def _fwd(spec, x, w):
    (qx, sx), (qw, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return jnp.einsum(spec, dequantize(qx, sx), dequantize(qw, sw)), (qx, sx, qw, sw)


def _bwd(spec, residuals, g):
    qx, sx, qw, sw = residuals
    _, transpose = jax.vjp(functools.partial(jnp.einsum, spec), dequantize(qx, sx), dequantize(qw, sw))
    return transpose(dequantize(*quantize(g, E5M2)))


fp8_einsum.defvjp(_fwd, _bwd)


def matmul_for(precision: str):
    """The einsum the transformer's projections and MLP run under a precision: `fp8_einsum` under
    fp8, jnp.einsum otherwise."""
    return fp8_einsum if precision == "fp8" else jnp.einsum
