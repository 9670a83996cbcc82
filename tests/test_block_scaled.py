"""precision=mxfp8 and nvfp4 (meshtrain/ops/block_scaled.py): each quantizer bitwise against NumPy's
(ml_dtypes' casts: block shapes, scale rounding, no saturation, zero blocks, 2D weight blocks),
stochastic rounding's mean, the Hadamard rotation's exactness, each einsum equal to the block-scaled GEMM
by its definition forward and backward, the tiny run tracking bf16, and the planner's peaks and refusals.
What only the GPU program shows (cuDNN's block-scaled GEMMs on the B200 target, the quantized FSDP
gather) is in tests/test_gpu_compile.py."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_tiny

from meshtrain.core.errors import UserError
from meshtrain.core.metrics import DEVICE_PROFILES, LOW_PEAK_NAMES, throughput_fields
from meshtrain.ops.block_scaled import (
    FP8_BLOCKWISE,
    MXFP8,
    NVFP4,
    Gemm,
    block_scaled_einsum,
    fp8_blockwise_einsum,
    gpu_layout_refusal,
    hadamard_16,
    mx_quantize,
    mxfp8_einsum,
    nv_quantize,
    nvfp4_einsum,
    rotated,
    round_to_fp4,
    swapped,
)
from meshtrain.ops.fp8 import transposed_specs
from meshtrain.ops.recipes import low_peak
from meshtrain.planner import kernel_time, roofline
from meshtrain.run import dashboards, loggers

pytestmark = pytest.mark.fast

F32 = np.float32


def numpy_mx(t, block=32, two_d=False):
    """MXFP8 by the spec: per 32 elements along the last axis, s = the least power of 2 >= amax / 448
    (1 for a zero block; 2^-126, fp32's least normal, at the least), q = t / s in e4m3; (q as fp32, s).
    fp8_blockwise's the same per 128 (`block`), and per 128 x 128 tile of the last two axes (`two_d`)."""
    b = t.reshape(*t.shape[:-1], -1, block).astype(np.float64)
    amax = np.abs(b).max(-1)
    if two_d:
        tiles = amax.reshape(*amax.shape[:-2], -1, block, amax.shape[-1])
        amax = np.broadcast_to(tiles.max(-2, keepdims=True), tiles.shape).reshape(amax.shape)
    s = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax / 448, 1.0))), 1.0)
    s = np.maximum(s, 2.0 ** -126)
    q = (b / s[..., None]).astype(F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    return q.reshape(t.shape), s


def e4m3_up(target):
    """The least e4m3 value >= target (fp32; at most 448)."""
    nearest = target.astype(ml_dtypes.float8_e4m3fn)
    up = (nearest.astype(F32) < target) & (nearest.astype(F32) < 448)
    return np.where(up, (nearest.view(np.uint8) + 1).view(ml_dtypes.float8_e4m3fn), nearest).astype(F32)


def tiled(x, reduce):
    """[..., N, J]: each 16 rows' reduction, repeated along them."""
    tiles = x.reshape(*x.shape[:-2], -1, 16, x.shape[-1])
    return np.broadcast_to(reduce(tiles, -2, keepdims=True), tiles.shape).reshape(x.shape)


def e2m1_times(b, s, g):
    """Blocks b [..., 16] quantized to e2m1 with scales s [...] x g (round to nearest even), as fp32."""
    d = s[..., None] * g
    scaled = (b * np.where(d > 0, F32(1) / np.where(d > 0, d, 1), 0)).clip(-6, 6)
    return scaled.astype(ml_dtypes.float4_e2m1fn).astype(F32)


def numpy_nv(t, two_d=False, four_over_six=False):
    """NVFP4 by the recipe: g = amax / 2688, per 16 elements (16 x 16 with `two_d`) the least e4m3 scale >=
    amax_block / 6 / g, q = t / (s g) in e2m1 (round to nearest even); (q as fp32, s as fp32, g).
    `four_over_six`: g = amax / 1536, and each block's scale from amax_block / 4 instead where the block's
    squared error (rounded to nearest; a 16 x 16 block's summed) is less."""
    t = t.astype(F32)
    amax = np.abs(t).max()
    g = F32(amax / F32(6 * 256 if four_over_six else 2688)) if amax > 0 else F32(1)
    b = t.reshape(*t.shape[:-1], -1, 16)
    bamax = np.abs(b).max(-1)
    if two_d:
        bamax = tiled(bamax, np.max)
    s = e4m3_up((bamax / F32(6) / g).astype(F32))
    if four_over_six:
        s4 = e4m3_up((bamax / F32(4) / g).astype(F32))

        def error(s):
            e = np.square(e2m1_times(b, s, g) * s[..., None] * g - b).sum(-1, dtype=F32)
            return tiled(e, np.sum) if two_d else e

        s = np.where(error(s4) < error(s), s4, s)
    return e2m1_times(b, s, g).reshape(t.shape), s, g


def data(shape, seed=0, scale=1.0):
    """Normal values with a few outliers (2^10 x) and one all-zero block of 32 at the start."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal(shape).astype(F32) * scale
    t.reshape(-1)[rng.integers(0, t.size, 3)] *= 2.0 ** 10
    t.reshape(-1, shape[-1])[0, :32] = 0
    return t


def test_mxfp8_is_the_ocp_block_format_bitwise():
    t = data((4, 8, 96))
    q, s = jax.jit(mx_quantize)(t)
    want_q, want_s = numpy_mx(t)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float8_e8m0fnu and s.shape == (4, 8, 3)
    np.testing.assert_array_equal(np.asarray(s, F32), want_s)
    np.testing.assert_array_equal(np.asarray(q, F32), want_q)
    assert np.abs(want_q).max() <= 448  # rounded up: no block saturates
    # a block of exact e4m3 values scaled by a power of 2 comes back bitwise
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    values = values[np.isfinite(values)][:224].reshape(7, 32) * 2.0 ** -3
    values[:, 0] = 448 * 2.0 ** -3  # each block's amax
    q, s = mx_quantize(jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(q, F32) * np.asarray(s, F32)[:, :, None].reshape(7, 1), values)


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_is_the_recipes_two_level_format_bitwise(two_d):
    t = data((2, 32, 48), seed=1)
    q, s, g = jax.jit(functools.partial(nv_quantize, two_d=two_d))(t)
    want_q, want_s, want_g = numpy_nv(t, two_d)
    assert q.dtype == jnp.float4_e2m1fn and s.dtype == jnp.float8_e4m3fn and s.shape == (2, 32, 3)
    assert float(g) == want_g
    np.testing.assert_array_equal(np.asarray(s, F32), want_s)
    np.testing.assert_array_equal(np.asarray(q, F32), want_q)
    # the block scales round up: no element beyond e2m1's 6 before the cast (nothing saturates: unbiased)
    with np.errstate(invalid="ignore"):  # the data's zero blocks: 0 / 0, left out by nanmax
        scaled = np.abs(t.reshape(2, 32, 3, 16)) / (want_s[..., None] * want_g)
    assert np.nanmax(scaled) <= 6 * (1 + 2 ** -20)
    # the largest block maps onto 6 x 448: its scale is e4m3's largest, its amax e2m1's
    assert np.asarray(s, F32).max() == 448 and np.abs(np.asarray(q, F32)).max() == 6
    zero = nv_quantize(jnp.zeros((16, 16)))
    assert float(zero[2]) == 1 and not np.asarray(zero[0], F32).any()  # no division by zero


@pytest.mark.parametrize("two_d", [False, True])
def test_four_over_six_takes_the_scale_with_less_error_per_block(two_d):
    """nvfp4's Four Over Six variant (benchmarks/precision.py `nvfp4-4over6`): bitwise NumPy's, some blocks
    scaled to 4 and some to 6, none quantized with more error than its largest mapped to 6 would give."""
    t = data((2, 32, 48), seed=2)
    t[:, :16] = np.random.default_rng(3).uniform(-1, 1, (2, 16, 48))  # tiles of uniform values take 4, normal 6
    q, s, g = jax.jit(functools.partial(nv_quantize, two_d=two_d, four_over_six=True))(t)
    want_q, want_s, want_g = numpy_nv(t, two_d, four_over_six=True)
    assert float(g) == want_g
    np.testing.assert_array_equal(np.asarray(s, F32), want_s)
    np.testing.assert_array_equal(np.asarray(q, F32), want_q)
    blocks = t.reshape(2, 32, 3, 16)
    bamax = np.abs(blocks).max(-1)
    six_s = e4m3_up((tiled(bamax, np.max) if two_d else bamax) / F32(6) / want_g)
    assert 0 < (want_s != six_s).mean() < 1
    per_block = lambda s: np.square(e2m1_times(blocks, s, want_g) * s[..., None] * want_g - blocks).sum(-1)
    err, six_err = per_block(want_s), per_block(six_s)
    if two_d:  # the choice is per 16 x 16 block
        err, six_err = err.reshape(2, 2, 16, 3).sum(2), six_err.reshape(2, 2, 16, 3).sum(2)
    assert (err <= six_err).all() and err.sum() < six_err.sum()


def test_nvfp4_weights_in_16x16_blocks_read_the_same_both_ways():
    """The forward contracts w along one axis, the data gradient along the other: with 16 x 16 blocks both
    read the same quantized weight (the transpose of each other), values and scales."""
    w = jnp.asarray(data((1, 64, 32), seed=2))
    q, s, g = nv_quantize(w, two_d=True)
    qt, st, gt = nv_quantize(jnp.swapaxes(w, 1, 2), two_d=True)
    dequantized = lambda q, s, g: np.asarray(q, F32) * np.repeat(np.asarray(s, F32), 16, axis=-1) * float(g)
    np.testing.assert_array_equal(np.asarray(qt, F32), np.swapaxes(np.asarray(q, F32), 1, 2))
    np.testing.assert_array_equal(dequantized(qt, st, gt), np.swapaxes(dequantized(q, s, g), 1, 2))


def test_stochastic_rounding_is_unbiased_and_lands_on_the_neighbours():
    x = jnp.asarray([0.3, 1.2, 2.6, -4.9, 5.99, 6.0, 0.0], F32)
    u = jax.random.uniform(jax.random.key(0), (20000, 7))
    r = np.asarray(round_to_fp4(jnp.broadcast_to(x, u.shape), u), F32)
    grid = {0.3: {0, 0.5}, 1.2: {1, 1.5}, 2.6: {2, 3}, -4.9: {-4, -6}, 5.99: {4, 6}, 6.0: {6}, 0.0: {0}}
    for i, (value, neighbours) in enumerate(grid.items()):
        assert set(np.unique(r[:, i])) <= neighbours
        assert r[:, i].mean() == pytest.approx(value, abs=0.02), value  # E[round(x)] = x
    assert np.asarray(round_to_fp4(x), F32).tolist() == [0.5, 1.0, 3.0, -4.0, 6.0, 6.0, 0.0]  # to nearest
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    dense = np.concatenate([np.linspace(-6, 6, 4801, dtype=F32), ties, -ties])
    np.testing.assert_array_equal(np.asarray(round_to_fp4(jnp.asarray(dense)), F32),
                                  dense.astype(ml_dtypes.float4_e2m1fn).astype(F32))  # ties to even, as ml_dtypes


def test_the_hadamard_rotation_is_orthogonal_and_leaves_the_contraction_unchanged():
    q = hadamard_16()
    np.testing.assert_allclose(q @ q.T, np.eye(16), atol=1e-7)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 5, 64)).astype(F32), rng.standard_normal((3, 7, 64)).astype(F32)
    np.testing.assert_allclose(np.einsum("bmk,bnk->bmn", np.asarray(rotated(a)), np.asarray(rotated(b))),
                               np.einsum("bmk,bnk->bmn", a, b), rtol=1e-5, atol=1e-4)


def numpy_gemm(spec, a, b, fmt, weight_b=False):
    """einsum(spec, a, b) of the operands quantized along its contraction (NumPy's quantizers above, b in
    block x block tiles with `weight_b`; zeros appended to whole blocks), the products summed in float64 and
    rounded to bf16 (nvfp4: times the two tensor scales, rounded again)."""
    gemm = Gemm.of(spec)
    a3, b3, shapes = gemm.operands(jnp.asarray(a, F32), jnp.asarray(b, F32))
    n, pad = b3.shape[1], lambda t, axis: np.pad(t, [(0, -t.shape[axis] % fmt.block if i == axis else 0)
                                                    for i in range(3)])  # zeros: documented
    a3, b3 = pad(np.asarray(a3), 2), pad(np.asarray(b3), 2)
    b3 = pad(b3, 1) if weight_b else b3
    if not fmt.tensor_scale:  # mxfp8, fp8_blockwise
        (qa, sa), (qb, sb) = numpy_mx(a3, fmt.block), numpy_mx(b3, fmt.block, weight_b)
        da, db = qa * np.repeat(sa, fmt.block, -1), qb * np.repeat(sb, fmt.block, -1)
        y = np.einsum("bmk,bnk->bmn", da.astype(np.float64), db)
        y = y.astype(F32).astype(ml_dtypes.bfloat16)
    else:
        (qa, sa, ga), (qb, sb, gb) = numpy_nv(a3), numpy_nv(b3, weight_b)
        da, db = qa * np.repeat(sa, 16, -1), qb * np.repeat(sb, 16, -1)
        y = np.einsum("bmk,bnk->bmn", da.astype(np.float64), db).astype(F32).astype(ml_dtypes.bfloat16)
        y = (y.astype(F32) * (ga * gb)).astype(ml_dtypes.bfloat16)
    return np.asarray(gemm.result(jnp.asarray(y.astype(F32)[:, :, :n]), shapes))


SPECS = {"bld,dhk->blhk": ((2, 16, 64), (64, 4, 16)), "blhk,hkd->bld": ((2, 16, 4, 16), (4, 16, 32)),
         "bneci,eio->bneco": ((2, 1, 3, 16, 32), (3, 32, 48))}  # q/k/v, the output projection, MoE experts
# fp8_blockwise's: contractions of several 128-blocks, and an output width (200) of no whole block
BLOCKWISE_SPECS = {"bld,df->blf": ((2, 64, 256), (256, 384)), "blhk,hkd->bld": ((2, 64, 4, 32), (4, 32, 200))}
EINSUMS = [(mxfp8_einsum, MXFP8, False, spec, SPECS[spec]) for spec in SPECS] + [
    (fp8_blockwise_einsum, FP8_BLOCKWISE, True, spec, shapes) for spec, shapes in BLOCKWISE_SPECS.items()]


@pytest.mark.parametrize("einsum, fmt, weight_2d, spec, shapes", EINSUMS, ids=lambda v: getattr(v, "name", None))
def test_the_einsum_is_the_block_scaled_gemm_forward_and_backward(einsum, fmt, weight_2d, spec, shapes):
    """y, dx and dw each the GEMM of its own einsum by definition (up to the order of the fp32 sum: within a
    bf16 unit), and near fp32's: mxfp8's blocks of 32; fp8_blockwise's x in 1 x 128 tiles along d, w in 128 x
    128 blocks (forward and dx alike, transposed), dw's x and g in tiles along the tokens."""
    xs, ws = shapes
    rng = np.random.default_rng(4)
    x, w = (jnp.asarray(rng.standard_normal(s) * c, jnp.bfloat16) for s, c in ((xs, 1.0), (ws, 0.1)))
    y, vjp = jax.vjp(functools.partial(einsum, spec), x, w)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    dx, dw = vjp(g)
    dx_spec, dw_spec = transposed_specs(spec)
    f32 = lambda t: np.asarray(t, F32)
    wants = (numpy_gemm(spec, f32(x), f32(w), fmt, weight_2d), numpy_gemm(dx_spec, f32(g), f32(w), fmt, weight_2d),
             numpy_gemm(dw_spec, f32(x), f32(g), fmt))
    for got, want in zip((y, dx, dw), wants):
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_allclose(f32(got), want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    exact = np.einsum(spec, f32(x), f32(w))
    assert np.linalg.norm(f32(y) - exact) / np.linalg.norm(exact) < 0.06  # e4m3's 3 mantissa bits


@pytest.mark.parametrize("spec", SPECS)
def test_the_nvfp4_einsum_is_the_block_scaled_gemm_and_its_gradients_track_fp32(spec):
    """y is the NVFP4 GEMM by definition (16 x 16 weight blocks); dx and dw (stochastic rounding, the
    rotation) within fp4's error of fp32's: 1 mantissa bit, rms error under 20%."""
    xs, ws = SPECS[spec]
    rng = np.random.default_rng(5)
    x, w = (jnp.asarray(rng.standard_normal(s) * c, jnp.bfloat16) for s, c in ((xs, 1.0), (ws, 0.1)))
    y, vjp = jax.vjp(functools.partial(nvfp4_einsum, spec), x, w)
    f32 = lambda t: np.asarray(t, F32)
    want = numpy_gemm(spec, f32(x), f32(w), NVFP4, weight_b=True)
    np.testing.assert_allclose(f32(y), want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    exact = jax.vjp(functools.partial(jnp.einsum, spec), f32(x), f32(w))[1](f32(g))
    for got, want in zip(vjp(g), exact):
        assert got.dtype == jnp.bfloat16
        assert np.linalg.norm(f32(got) - want) / np.linalg.norm(want) < 0.2


def test_rotating_every_gemms_operands_leaves_each_product_within_fp4s_error():
    """benchmarks/precision.py's nvfp4-rht_all: the forward's operands rotated along their contraction (x
    along d, w along d: both by the same orthogonal Q) before they are quantized, so y is the NVFP4 GEMM of
    the rotated operands by definition (not of the operands themselves), and y, dx and dw (whose operands
    are rotated along their own contractions) are the products within fp4's error."""
    spec = "bld,df->blf"
    rng = np.random.default_rng(6)
    x, w = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.bfloat16), jnp.asarray(rng.standard_normal((64, 48)),
                                                                                     jnp.bfloat16)
    einsum = block_scaled_einsum(NVFP4, weight_2d=True, stochastic=True, rotate=True, rotate_all=True)
    y, vjp = jax.vjp(functools.partial(einsum, spec), x, w)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    f32 = lambda t: np.asarray(t, F32)
    x_rotated, w_rotated = f32(rotated(x)), f32(rotated(w.T)).T  # each along its 16-blocks of d
    want = numpy_gemm(spec, x_rotated, w_rotated, NVFP4, weight_b=True)
    np.testing.assert_allclose(f32(y), want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    unrotated = numpy_gemm(spec, f32(x), f32(w), NVFP4, weight_b=True)
    assert np.abs(f32(y) - unrotated).max() > 0.1 * np.abs(unrotated).max()
    want_y, pullback = jax.vjp(functools.partial(jnp.einsum, spec), f32(x), f32(w))
    for got, want in zip((y, *vjp(g)), (want_y, *pullback(f32(g)))):
        assert np.linalg.norm(f32(got) - want) / np.linalg.norm(want) < 0.2


def test_operands_whose_contraction_is_no_whole_block_are_padded_with_zeros():
    """K = 40 (one block of 32 and 8 more for mxfp8; 16, 16 and 8 for nvfp4) and N = 24 (nvfp4's weight
    blocks 16 x 16: one and 8 rows more): the zeros add nothing."""
    rng = np.random.default_rng(6)
    x, w = jnp.asarray(rng.standard_normal((3, 40)), jnp.bfloat16), jnp.asarray(rng.standard_normal((40, 24)),
                                                                              jnp.bfloat16)
    for einsum, fmt, weight in ((mxfp8_einsum, MXFP8, False), (nvfp4_einsum, NVFP4, True)):
        want = numpy_gemm("ld,df->lf", np.asarray(x, F32), np.asarray(w, F32), fmt, weight)
        assert want.shape == (3, 24)
        np.testing.assert_allclose(np.asarray(einsum("ld,df->lf", x, w), F32), want, rtol=2 ** -7)
    assert swapped("ld,df->lf") == "df,ld->lf"


def test_the_planner_runs_each_recipes_gemms_at_its_peak_and_refuses_a_gpu_without_them():
    b200 = DEVICE_PROFILES["b200"]
    fp8 = roofline.times(1e12, 2e12, 0.0, 0.0, b200, fp8_flops=1e12)
    fp4 = roofline.times(1e12, 2e12, 0.0, 0.0, b200, fp8_flops=1e12, low_peak="peak_fp4_flops")
    assert fp8["compute_s"] == pytest.approx(1e12 / 2250e12 + 1e12 / 4500e12)
    assert fp4["compute_s"] == pytest.approx(1e12 / 2250e12 + 1e12 / 9000e12)
    assert fp4["mfu_fp8_ceiling"] == pytest.approx(fp4["mfu_ceiling"] * 2250 / 9000)
    # the GPU program's walk: a block-scaled GEMM at its values' peak (fp8's, fp4's), as XLA's GEMMs
    assert [kernel_time._peak(b200, t) for t in ("f8e4m3fn", "f4e2m1fn", "bf16")] == [4500e12, 9000e12, 2250e12]
    for recipe in ("mxfp8", "nvfp4"):
        roofline.refuse_on(b200, recipe)
        with pytest.raises(UserError, match=f"parallel.precision={recipe}: the H100 SXM has no {recipe} GEMMs "
                                            r"\(Blackwell: B200, GB200\); plan it on --device b200 or gb200, or set"):
            roofline.refuse_on(DEVICE_PROFILES["h100"], recipe)


def test_a_gpu_mesh_the_block_scaled_gemm_cannot_be_partitioned_on_is_refused_in_one_line():
    """On NVIDIA GPUs: inside the manual regions of data and pipeline (jax.nn.scaled_matmul's partitioner
    fails there), and mxfp8 over fsdp x tensor (an E8M0 all-reduce NCCL refuses); fsdp, tensor, expert
    and the CPU's emulation take every layout (the GPU compiles: tests/test_gpu_compile.py)."""
    sizes = lambda **given: {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, "expert": 1, **given}
    why = gpu_layout_refusal("nvfp4", sizes(data=2))
    assert why.startswith("parallel.precision=nvfp4 on NVIDIA GPUs with data > 1 (JAX's jax.nn.scaled_matmul")
    assert why.endswith("shard over fsdp, tensor or expert instead (fsdp=N in place of data=N), or set "
                        "parallel.precision=fp8")
    assert "data and pipeline > 1" in gpu_layout_refusal("mxfp8", sizes(data=2, pipeline=2))
    assert "E8M0" in gpu_layout_refusal("mxfp8", sizes(fsdp=2, tensor=2))
    for fine in (sizes(fsdp=8), sizes(tensor=4), sizes(expert=2, fsdp=2)):
        assert gpu_layout_refusal("mxfp8", fine) is None and gpu_layout_refusal("nvfp4", fine) is None
    assert gpu_layout_refusal("nvfp4", sizes(fsdp=2, tensor=2)) is None
    assert gpu_layout_refusal("fp8", sizes(data=2)) is None


@pytest.fixture(scope="module")
def runs():
    steps = ("parallel.precision={}", "parallel.mesh=1", "train.steps=24", "train.log_every=1")
    return {p: run_tiny(*(o.format(p) for o in steps), devices=jax.devices()[:1])
            for p in ("bf16", "mxfp8", "nvfp4", "fp8_blockwise")}


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_blockwise"])
def test_the_tiny_run_tracks_bf16(runs, recipe):
    (_, bf16, _), (_, low, _) = runs["bf16"], runs[recipe]
    assert len(low) == 24 and bf16[-1] < bf16[0] - 0.05  # it learned
    # measured: mxfp8 0.18%, nvfp4 0.45%, fp8_blockwise 0.19%
    print(f"{recipe} vs bf16: at most {np.max(np.abs(low - bf16) / bf16):.3%} apart over 24 steps")
    np.testing.assert_allclose(low, bf16, rtol=0.02)
    assert not np.array_equal(low, bf16)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_sharded_run_tracks_one_device(runs, recipe):
    """data=2 x tensor=2 against one device: the blocks lie along each GEMM's contraction, within a shard
    of a contraction tensor shards (the row-parallel projections' h x k, the MLP's f), so each block's
    scale is the whole tensor's block's; the data axis runs manual, so each data shard scales its own
    tokens' dw blocks and (nvfp4) its own tensor scales and stochastic draws, as each GPU would. The
    sharded sums run in another order, and fp4's neighbours lie far apart. Measured over 24 steps, the losses'
    largest relative difference: mxfp8 0.105%, nvfp4 0.40% (fp8's 0.13%: tests/test_fp8.py)."""
    _, one, _ = runs[recipe]
    _, sharded, _ = run_tiny(f"parallel.precision={recipe}", "parallel.mesh=data=2,tensor=2", "train.steps=24",
                             "train.log_every=1", devices=jax.devices()[:4])
    print(f"sharded {recipe} vs one device: at most {np.max(np.abs(sharded - one) / one):.3%} apart")
    np.testing.assert_allclose(sharded, one, rtol=5e-3 if recipe == "mxfp8" else 1e-2)  # fp4's neighbours: 2x the room


def test_an_nvfp4_run_logs_its_mfu_against_the_fp4_peak():
    """The trainer's record keeps MFU against the bf16 peak and adds `mfu_fp4` (the recipe's GEMM peak,
    meshtrain/ops/recipes.py low_peak) beside it: in the log line and under perf/ on the dashboards."""
    assert LOW_PEAK_NAMES[low_peak("nvfp4")] == "fp4" and LOW_PEAK_NAMES[low_peak("mxfp8")] == "fp8"
    fields = throughput_fields(1e9, 1e6, 1, 2250e12, 9000e12, "fp4")
    assert fields["mfu_fp4"] == pytest.approx(fields["mfu"] / 4) and "mfu_fp8" not in fields
    line = loggers.format_record({"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1e9,
                                  "step_time_s": 1.0, "data_wait_s": 0.0, "skipped_steps": 0, **fields})
    assert f"; {fields['mfu_fp4']:.1%} of the fp4 peak)" in line and dashboards.tag("mfu_fp4") == "perf/mfu_fp4"

