"""parallel.precision=fp8_blockwise (meshtrain/ops/block_scaled.py, meshtrain/ops/fp8_blockwise_triton.py):
DeepSeek-V3's 1 x 128 and 128 x 128 blocks against a NumPy reference, the einsum and its gradients by
definition, the GPU's Triton kernel in Pallas' interpreter, and the layouts a GPU refuses. A short run
against bf16: tests/test_block_scaled.py; what the GPU compiler makes of it: tests/test_gpu_compile.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from meshtrain.ops import fp8_blockwise_triton as triton
from meshtrain.ops.block_scaled import (
    FP8_BLOCKWISE,
    Gemm,
    _emulated_gemm,
    fp8_blockwise_einsum,
    gpu_layout_refusal,
    mx_quantize,
    swapped,
)
from meshtrain.ops.fp8 import transposed_specs
from meshtrain.ops.recipes import recipe_refusal

pytestmark = pytest.mark.fast

F32 = np.float32


def numpy_blockwise(t, two_d=False):
    """Per 128 elements along the last axis (128 x 128 tiles of the last two with `two_d`): s = the least power
    of 2 >= amax / 448 (1 for a zero block; 2^-126 at the least), in fp32; q = t / s in e4m3; (q as fp32, s)."""
    b = t.reshape(*t.shape[:-1], -1, 128).astype(np.float64)
    amax = np.abs(b).max(-1)
    if two_d:
        tiles = amax.reshape(*amax.shape[:-2], -1, 128, amax.shape[-1])
        amax = np.broadcast_to(tiles.max(-2, keepdims=True), tiles.shape).reshape(amax.shape)
    s = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax / 448, 1.0))), 1.0)
    s = np.maximum(s, 2.0 ** -126)
    q = (b / s[..., None]).astype(F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    return q.reshape(t.shape), s.astype(F32)


def data(shape, seed=0):
    """Normal values with a few outliers (2^10 x) and one all-zero block of 128 at the start."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal(shape).astype(F32)
    t.reshape(-1)[rng.integers(0, t.size, 3)] *= 2.0 ** 10
    t.reshape(-1, shape[-1])[0, :128] = 0
    return t


@pytest.mark.parametrize("two_d", [False, True])
def test_the_blocks_are_deepseeks_1x128_tiles_and_128x128_weight_blocks_bitwise(two_d):
    t = data((2, 256, 384), seed=int(two_d))
    q, s = jax.jit(functools.partial(mx_quantize, fmt=FP8_BLOCKWISE, two_d=two_d))(t)
    want_q, want_s = numpy_blockwise(t, two_d)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32 and s.shape == (2, 256, 3)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    np.testing.assert_array_equal(np.asarray(q, F32), want_q)
    assert np.abs(want_q).max() <= 448  # rounded up: no block saturates
    assert (want_s[0, 0, 0] == 1.0) != two_d  # the zero block's scale: 1 alone, its tile's in a weight block
    if two_d:  # one scale per 128 x 128 tile: 128 rows alike, the next tile its own
        assert (want_s[:, :128] == want_s[:, :1]).all() and (want_s[:, 128:] == want_s[:, 128:129]).all()
    # power-of-2 scales: q x s is exact in bf16, so the GEMM's dequantized form is exact
    np.testing.assert_array_equal(np.asarray(q, F32) * np.repeat(np.asarray(s), 128, -1),
                                  np.asarray((q.astype(jnp.bfloat16) * jnp.repeat(s, 128, -1).astype(jnp.bfloat16)),
                                             F32))


def numpy_gemm(spec, a, b, weight_b=False):
    """einsum(spec, a, b) of the operands quantized along its contraction by `numpy_blockwise` (b in 128 x 128
    blocks with `weight_b`; zeros appended to whole blocks), summed in float64, rounded to bf16."""
    gemm = Gemm.of(spec)
    a3, b3, shapes = gemm.operands(jnp.asarray(a, F32), jnp.asarray(b, F32))
    n, pad = b3.shape[1], lambda t, axis: np.pad(t, [(0, -t.shape[axis] % 128 if i == axis else 0) for i in range(3)])
    a3, b3 = pad(np.asarray(a3), 2), pad(np.asarray(b3), 2)
    b3 = pad(b3, 1) if weight_b else b3
    (qa, sa), (qb, sb) = numpy_blockwise(a3), numpy_blockwise(b3, weight_b)
    da, db = qa * np.repeat(sa, 128, -1), qb * np.repeat(sb, 128, -1)
    y = np.einsum("bmk,bnk->bmn", da.astype(np.float64), db).astype(F32).astype(ml_dtypes.bfloat16)
    return np.asarray(gemm.result(jnp.asarray(y.astype(F32)[:, :, :n]), shapes))


SPECS = {"bld,df->blf": ((2, 64, 256), (256, 384)), "blhk,hkd->bld": ((2, 64, 4, 32), (4, 32, 200))}


@pytest.mark.parametrize("spec", SPECS)
def test_the_einsum_and_both_gradients_are_the_blockwise_gemms_by_definition(spec):
    """y = x w with x in 1 x 128 tiles along d and w in 128 x 128 blocks; dx = g w^T with g in tiles along w's
    outputs and w in the same blocks (transposed); dw = x^T g with both in tiles along the tokens. Each the
    GEMM of its own einsum (up to the order of the fp32 sum: within a bf16 unit), near fp32's. The second
    spec's output width, 200, is no whole block: zeros appended."""
    xs, ws = SPECS[spec]
    rng = np.random.default_rng(4)
    x, w = (jnp.asarray(rng.standard_normal(s) * c, jnp.bfloat16) for s, c in ((xs, 1.0), (ws, 0.1)))
    y, vjp = jax.vjp(functools.partial(fp8_blockwise_einsum, spec), x, w)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    dx, dw = vjp(g)
    dx_spec, dw_spec = transposed_specs(spec)
    f32 = lambda t: np.asarray(t, F32)
    wants = (numpy_gemm(spec, f32(x), f32(w), weight_b=True), numpy_gemm(dx_spec, f32(g), f32(w), weight_b=True),
             numpy_gemm(swapped(dw_spec), f32(g), f32(x)))
    for got, want in zip((y, dx, dw), wants):
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_allclose(f32(got), want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    exact = jax.vjp(functools.partial(jnp.einsum, spec), f32(x), f32(w))
    for got, want in zip((y, *exact[1](f32(g))), (exact[0], *exact[1](f32(g)))):
        assert np.linalg.norm(f32(got) - want) / np.linalg.norm(want) < 0.06  # e4m3's 3 mantissa bits


@pytest.mark.parametrize("shape", [(1, 256, 384, 256), (2, 40, 24, 128)])
def test_the_gpus_triton_kernel_is_the_blockwise_gemm_in_pallas_interpreter(shape):
    """The kernel's fp32 sum of each 128-wide block's fp8 product times its two scales, against the
    dequantized GEMM: within fp32's rounding. [B, M, N, K]: whole tiles; and M, N no tile of 16 divides (zeros
    appended, sliced off), two batches."""
    B, M, N, K = shape
    (qa, sa), (qb, sb) = (mx_quantize(jnp.asarray(data((B, r, K), seed=r)), FP8_BLOCKWISE) for r in (M, N))
    got = triton.local_gemm(qa, qb, jnp.swapaxes(sa, 1, 2), jnp.swapaxes(sb, 1, 2), jnp.float32, interpret=True)
    want = _emulated_gemm(qa, qb, sa, sb, jnp.float32)
    assert got.shape == (B, M, N)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_gpu_refuses_a_manual_axis_beside_a_sharded_one_and_a_gpu_before_hopper():
    """Inside data's and the pipeline's manual regions the kernel would gather a sharded contraction (module
    doc of fp8_blockwise_triton.py): refused beside any other axis, taken alone; an A100 has no fp8 GEMMs."""
    sizes = lambda **given: {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, "expert": 1, "context": 1, **given}
    for fine in (sizes(data=8), sizes(data=2, pipeline=2), sizes(fsdp=4, tensor=2), sizes(expert=2, fsdp=2)):
        assert gpu_layout_refusal("fp8_blockwise", fine) is None
    why = gpu_layout_refusal("fp8_blockwise", sizes(data=2, fsdp=4))
    assert why.startswith("parallel.precision=fp8_blockwise on NVIDIA GPUs with data > 1 beside fsdp > 1 (its GEMM "
                          "would gather the fsdp-sharded sums inside the manual regions data run)")
    assert "pipeline > 1 beside tensor > 1" in gpu_layout_refusal("fp8_blockwise", sizes(pipeline=2, tensor=2))
    a100 = type("Device", (), {"platform": "gpu", "compute_capability": "8.0", "device_kind": "NVIDIA A100"})()
    assert recipe_refusal("fp8_blockwise", a100).startswith(
        "parallel.precision=fp8_blockwise: the NVIDIA A100 (compute capability 8.0) has no fp8_blockwise GEMMs, "
        "which need 9.0 or newer (Hopper, Blackwell: H100, H200, B200)")
