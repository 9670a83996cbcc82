"""parallel.precision=fp8_blockwise (meshtrain/ops/block_scaled.py, meshtrain/ops/fp8_blockwise_triton.py):
DeepSeek-V3's 1 x 128 and 128 x 128 blocks against a NumPy reference, the GPU's Triton kernel in Pallas'
interpreter, its partition on 8 CPU devices, and the layouts a GPU refuses. The einsum and its gradients by
definition, and a short run against bf16: tests/test_block_scaled.py; what the GPU compiler makes of it:
tests/test_gpu_compile.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_block_scaled import numpy_mx

from meshtrain.ops import fp8_blockwise_triton as triton
from meshtrain.ops.block_scaled import (
    FP8_BLOCKWISE,
    _emulated_gemm,
    gpu_layout_refusal,
    mx_quantize,
)
from meshtrain.ops.recipes import recipe_refusal

pytestmark = pytest.mark.fast

F32 = np.float32


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
    want_q, want_s = numpy_mx(t, 128, two_d)
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
    doc of fp8_blockwise_triton.py): refused beside any other axis, taken alone; so is tensor beside
    capacity-routed experts (their region manual over the rows); an A100 has no fp8 GEMMs."""
    sizes = lambda **given: {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, "expert": 1, "context": 1, **given}
    for fine in (sizes(data=8), sizes(data=2, pipeline=2), sizes(fsdp=4, tensor=2), sizes(expert=2, fsdp=2)):
        assert gpu_layout_refusal("fp8_blockwise", fine) is None
    why = gpu_layout_refusal("fp8_blockwise", sizes(data=2, fsdp=4))
    assert why == ("parallel.precision=fp8_blockwise on NVIDIA GPUs with data > 1 beside fsdp > 1 (its GEMM would "
                   "gather the contractions sharded over fsdp inside the manual regions of data); shard over one of "
                   "data and pipeline alone or over the others alone (fsdp=N in place of data=N), or set "
                   "parallel.precision=fp8")
    assert "pipeline > 1 beside tensor > 1" in gpu_layout_refusal("fp8_blockwise", sizes(pipeline=2, tensor=2))
    assert "capacity-routed experts" in gpu_layout_refusal("fp8_blockwise", sizes(tensor=2), capacity_experts=True)
    assert gpu_layout_refusal("fp8_blockwise", sizes(fsdp=2, expert=4), capacity_experts=True) is None
    a100 = type("Device", (), {"platform": "gpu", "compute_capability": "8.0", "device_kind": "NVIDIA A100"})()
    assert recipe_refusal("fp8_blockwise", a100).startswith(
        "parallel.precision=fp8_blockwise: the NVIDIA A100 (compute capability 8.0) has no fp8_blockwise GEMMs, "
        "which need 9.0 or newer (Hopper, Blackwell: H100, H200, B200, GB200)")


def _emulated_local(qa, qb, sa_BxJxM, sb_BxJxN, out_dtype, interpret=False):
    """local_gemm's numbers by the definition, in fp32 (XLA:CPU cannot run the Triton kernel)."""
    return _emulated_gemm(qa, qb, jnp.swapaxes(sa_BxJxM, 1, 2), jnp.swapaxes(sb_BxJxN, 1, 2), jnp.float32)


LAYOUTS = {  # x's spec, w's spec, the result's, a region manual over data: what the partition must get right
    "rows over fsdp, columns over tensor": (("fsdp", None), ("tensor", None), ("fsdp", "tensor"), False),
    "K over tensor in both (row-parallel): summed": ((("fsdp",), "tensor"), (None, "tensor"), ("fsdp", None), False),
    "K over fsdp in both (dw's tokens): reduce-scattered onto N": ((None, "fsdp"), (None, "fsdp"), (None, "fsdp"),
                                                                    False),
    "K over fsdp in x only: w gathered": (("tensor", "fsdp"), (None, None), ("tensor", None), False),
    "inside a region manual over data": ((("data", "fsdp"), None), ("tensor", None), (("data", "fsdp"), "tensor"),
                                         True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_kernels_partition_computes_the_unsharded_product(monkeypatch, layout):
    """The kernel's custom partitioning on 8 CPU devices (data=2 x fsdp=2 x tensor=2), its local GEMM replaced
    by the definition: each layout's product (and the sums its shards issue) equals one device's to fp32's
    rounding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(triton, "local_gemm", _emulated_local)
    (x_rows, x_k), (w_rows, w_k), out, manual = LAYOUTS[layout]
    (qa, sa), (qb, sb) = (mx_quantize(jnp.asarray(data((1, r, 512), seed=r)), FP8_BLOCKWISE) for r in (256, 384))
    want = _emulated_gemm(qa, qb, sa, sb, jnp.float32)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    specs = (P(None, x_rows, x_k), P(None, w_rows, w_k), P(None, x_rows), P(None, w_rows))
    gemm = functools.partial(triton.blockwise_gemm, out_dtype=jnp.float32)
    if manual:  # the step's data axis: a shard_map manual over it, the other axes left to the partitioner
        region = lambda *a: jax.shard_map(gemm, mesh=mesh, in_specs=(P(None, "data"), P(), P(None, "data"), P()),
                                          out_specs=P(None, "data"), axis_names={"data"}, check_vma=False)(*a)
    else:
        region = gemm
    with jax.set_mesh(mesh):
        args = [jax.device_put(t, NamedSharding(mesh, s)) for t, s in zip((qa, qb, sa, sb), specs)]
        got = jax.jit(region, out_shardings=NamedSharding(mesh, P(None, *out)))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * np.abs(want).max())
