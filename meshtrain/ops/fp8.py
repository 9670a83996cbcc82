"""FP8 matmuls with per-tensor current scaling (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"): the forward's operands in float8_e4m3fn (largest finite 448, 3 mantissa bits), the
backward's output cotangent in float8_e5m2 (57344, 2 mantissa bits: range for gradients).

Each tensor t gets its own scale from itself, every call ("current" scaling: torchao's tensorwise
float8 recipe, Transformer Engine's Float8CurrentScaling):
    s = amax(|t|) / fmax   (s = 1 when amax = 0),    q = clip(t / s, -fmax, fmax) -> fp8,    dq = q x s.
The matmul takes the fp8 operands themselves, as the GEMM does: an einsum of the fp8 tensors
accumulated in fp32 and written in the compute dtype (where XLA reduces a sharded contraction's
partial sums, as for a bf16 einsum), times the two scales in fp32, rounded to the compute dtype:
    y = (sx x sw) . einsum(qx, qw)    (an fp8 GEMM with the scales as its alpha).
On a GPU, XLA's compiler keeps that form's fp8 operands (a Triton or cuBLASLt fp8 GEMM with the
scaling fused: `python -m meshtrain.plan` counts its GEMMs by operand type), where a quantize-dequantize
(QDQ) einsum of bf16 values loses them: the GPU pipeline, allowed excess precision by default, folds
the bf16 -> fp8 -> bf16 round trip away and runs bf16 GEMMs. On a CPU the same graph computes the
numbers as written exactly (products of fp8 values are exact in fp32; a GPU GEMM that takes the
scales as its alpha may round once where this rounds twice, tensorwise). `fp8_einsum` keeps the fp8
operands and their scales as its residuals (1 byte per saved element) and differentiates with the
cotangent quantized to e5m2, each gradient one more fp8 GEMM:
    dx = (sg x sw) . einsum^T(qg, qw),    dw = (sx x sg) . einsum^T(qx, qg).
`parallel.precision=fp8_rowwise` (torchao's "rowwise" recipe) scales each GEMM's operands per row
instead: one fp32 scale per slice along the axes that GEMM contracts (x's per token, w's per output
column), rounded up to a power of 2 so the scaling itself is exact:
    s_a[i] = 2^ceil(log2(amax_k |a[i, k]| / fmax)),    y[i, j] = s_a[i] s_b[j] . sum_k q_a[i, k] q_b[k, j].
The scales are constant along the contraction, so they leave the sum: `einsum(spec, s_a, s_b)` of the
scales (size 1 on the contracted axes) is their outer product on y's axes. A gradient GEMM contracts
other axes (dx over w's outputs, dw over the tokens), so the backward quantizes the saved operands
again along its own: it keeps x and w in bf16 (2 bytes per saved element, not 1), and one outlier
costs only its own row's precision, not the whole tensor's.
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


def scaled_gemm(spec: str, qa, qb, scales, dtype):
    """einsum(spec, qa, qb) x `scales` in `dtype` (bf16, or fp32; fp16's 65,504 would not hold an
    unscaled sum of e4m3 products): fp8 operands straight into the dot, summed in fp32
    and written in `dtype` (the compute dtype), then scaled in fp32 and rounded to `dtype` again. The
    dot's output type is where XLA reduces a sharded contraction's partial sums (dw's over the batch
    under fsdp, a row-parallel projection's over tensor): in `dtype`, as a bf16 einsum's, not in fp32
    (twice the bytes: the gradient reduce-scatter read 1.77x its formula on llama3_8b's pod)."""
    y = jnp.einsum(spec, qa, qb, preferred_element_type=dtype)
    return (y.astype(jnp.float32) * scales).astype(dtype)


def scaled_einsum(spec: str, qa, sa, qb, sb):
    """(sa x sb) . einsum(spec, qa, qb) (`scaled_gemm`), the two per-tensor scales' product its fp32
    alpha, in the scales' dtype. The sum rounded to that dtype, then scaled: two roundings (sa x sb is
    no power of 2), up to about one unit in the last place more than one rounding's half."""
    alpha = sa.astype(jnp.float32) * sb.astype(jnp.float32)
    return scaled_gemm(spec, qa, qb, alpha, jnp.result_type(sa, sb))


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


def contracted_axes(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes of each operand of `spec` ("a,b->y") that its einsum sums over (in the other operand,
    not in the output)."""
    a, rest = spec.replace(" ", "").split(",")
    b, y = rest.split("->")
    return tuple(i for i, c in enumerate(a) if c not in y), tuple(i for i, c in enumerate(b) if c not in y)


def quantize_rows(t, dtype, axes: tuple[int, ...]):
    """(q, s): one fp32 scale per slice of t along `axes` (kept as size-1 axes), s = amax / fmax rounded
    up to a power of 2 (1 where the slice is 0), q = t / s in fp8 `dtype` (|t / s| <= fmax: no clip
    needed, kept against rounding)."""
    fmax = fp8_max(dtype)
    amax = jnp.max(jnp.abs(t), axis=axes, keepdims=True).astype(jnp.float32)
    s = jnp.where(amax > 0, power_of_two_above(amax / fmax), 1.0)
    return jnp.clip(t.astype(jnp.float32) / s, -fmax, fmax).astype(dtype), s


def power_of_two_above(ratio):
    """2^ceil(log2(ratio)) of positive fp32 values, exactly (frexp, where exp2(ceil(log2())) is approximated);
    1 where the ratio is 0 (a zero slice, or an amax / fmax flushed to 0: a scale that divides nothing)."""
    mantissa, exponent = jnp.frexp(ratio)
    return jnp.ldexp(jnp.ones_like(ratio), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def rowwise_gemm(spec: str, a, b, a_dtype, b_dtype):
    """einsum(spec, a, b) as an fp8 GEMM with row-wise scales (module doc), in a's dtype."""
    a_axes, b_axes = contracted_axes(spec)
    (qa, sa), (qb, sb) = quantize_rows(a, a_dtype, a_axes), quantize_rows(b, b_dtype, b_axes)
    return scaled_gemm(spec, qa, qb, jnp.einsum(spec, sa, sb), a.dtype)  # powers of 2: one rounding


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_rowwise_einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) as fp8 GEMMs with row-wise scales: e4m3 operands forward, the cotangent in
    e5m2 backward, each gradient GEMM scaled along its own contraction."""
    return rowwise_gemm(spec, x, w, E4M3, E4M3)


def _rowwise_fwd(spec, x, w):
    return rowwise_gemm(spec, x, w, E4M3, E4M3), (x, w)


def _rowwise_bwd(spec, residuals, g):
    x, w = residuals
    dx_spec, dw_spec = transposed_specs(spec)
    return rowwise_gemm(dx_spec, g, w, E5M2, E4M3), rowwise_gemm(dw_spec, x, g, E4M3, E5M2).astype(w.dtype)


fp8_rowwise_einsum.defvjp(_rowwise_fwd, _rowwise_bwd)
