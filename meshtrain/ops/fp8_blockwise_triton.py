"""fp8_blockwise's GEMM on NVIDIA GPUs: one Pallas Triton kernel, partitioned by XLA like an einsum
(meshtrain/ops/block_scaled.py chooses it on a GPU; elsewhere the same numbers come from a dequantization
and a bf16 GEMM).

    y[b, m, n] = sum_j sa[b, m, j] sb[b, n, j] (sum_{k in block j} qa[b, m, k] qb[b, n, k])

with qa, qb in e4m3 and one fp32 scale per 128 consecutive elements along K (DeepSeek-V3's fine-grained
quantization, its section 3.3.2). A program computes a [BM, BN] tile of y: its K loop takes one 128-wide
block a step, an fp8 GEMM of the two tiles into fp32, and adds it times the block's scales (the row's
and the column's) to an fp32 accumulator: DeepSeek's promotion of the partial sums to fp32 every 128
elements of K, which Hopper's fp8 tensor cores would otherwise accumulate in about 14 bits. Both
operands are K-major ([M, K] and [N, K]), the layout Hopper's fp8 tensor cores read.

Partitioned with `custom_partitioning` over the mesh's axes that are not manual: a shard keeps its
batch, M and N slices, and a K sharded alike in both operands (tensor parallelism's row-parallel layers,
a weight gradient's tokens) is summed after the local GEMM: reduce-scattered onto M or N where one
divides, else all-reduced. Inside a manual region (shard_map) the sum's replica groups would be the
region's, which XLA refuses, so there K is gathered instead (block_scaled.gpu_layout_refusal refuses the
layouts that would need it on a GPU: data or pipeline beside another axis, tensor beside capacity-routed
experts; a contraction whose shards are not whole blocks is gathered too, which a real model's widths
never need). It is one `__gpu$xla.gpu.triton` call in the GPU program, named NAME, which the
planner counts and prices as an fp8 GEMM (meshtrain/planner/kernel_time.py). Tests run it in Pallas'
interpreter on the CPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.experimental.pallas import triton as plt
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.ops.grouped_matmul_triton import block

BLOCK = 128  # elements of K per scale (the recipe's) and the kernel's K step
BM, BN = 128, 128  # a program's tile of y (the largest power of two <= these dividing M and N, >= 16)
# untuned (no GPU has run this kernel yet: benchmarks/blockwise_gemm.py --tiles on one): 8 warps, as Triton's fp8
# GEMMs on Hopper take, so the fp32 accumulator and a step's partial product (two 128 x 128 tiles) fit the registers
WARPS, STAGES = 8, 3
NAME = "meshtrain_fp8_blockwise"  # the planner finds the kernel by it (kernels.py)


def _kernel(a_ref, b_ref, sa_ref, sb_ref, y_ref, *, bm, bn):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = pl.ds(pl.multiple_of(i * bm, bm), bm), pl.ds(pl.multiple_of(j * bn, bn), bn)

    def step(k, acc_MxN):
        ks = pl.ds(pl.multiple_of(k * BLOCK, BLOCK), BLOCK)
        part_MxN = jnp.dot(a_ref[b, rows, ks], b_ref[b, cols, ks].T, preferred_element_type=jnp.float32)
        return acc_MxN + part_MxN * sa_ref[b, k, rows][:, None] * sb_ref[b, k, cols][None, :]

    acc_MxN = jax.lax.fori_loop(0, a_ref.shape[2] // BLOCK, step, jnp.zeros((bm, bn), jnp.float32))
    y_ref[b, rows, cols] = acc_MxN.astype(y_ref.dtype)


def local_gemm(qa_BxMxK, qb_BxNxK, sa_BxJxM, sb_BxJxN, out_dtype, interpret: bool = False):
    """One device's GEMM (module doc): K a multiple of BLOCK; M and N padded to 16 where no tile divides
    them; scales [B, K / BLOCK, M] and [B, K / BLOCK, N] (M and N contiguous: a step loads a row of each)."""
    (B, M, _), N = qa_BxMxK.shape, qb_BxNxK.shape[1]
    bm, bn = block(M, BM), block(N, BN)
    if bm is None or bn is None:  # a width no tile of 16 or more divides: zeros appended, sliced off
        pad = lambda t, axis: jnp.pad(t, [(0, -t.shape[axis] % 16 if d == axis else 0) for d in range(3)])
        y = local_gemm(pad(qa_BxMxK, 1), pad(qb_BxNxK, 1), pad(sa_BxJxM, 2), pad(sb_BxJxN, 2), out_dtype, interpret)
        return y[:, :M, :N]
    return pl.pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn), out_shape=jax.ShapeDtypeStruct((B, M, N), out_dtype),
        grid=(B, M // bm, N // bn), compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        interpret=interpret, name=NAME,
    )(qa_BxMxK, qb_BxNxK, sa_BxJxM, sb_BxJxN)


def blockwise_gemm(qa_BxMxK, qb_BxNxK, sa_BxMxJ, sb_BxNxJ, out_dtype):
    """[B, M, K] x [B, N, K] -> [B, M, N] in `out_dtype`, on the mesh's shards (module doc)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    auto = tuple((n, s) for n, s, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types) if t != manual)
    in_manual = len(auto) < len(mesh.axis_names)
    sa_BxJxM, sb_BxJxN = jnp.swapaxes(sa_BxMxJ, 1, 2), jnp.swapaxes(sb_BxNxJ, 1, 2)
    if all(size == 1 for _, size in auto):  # one device's GEMM: a manual region of data or pipeline alone
        return local_gemm(qa_BxMxK, qb_BxNxK, sa_BxJxM, sb_BxJxN, out_dtype)
    return _partitioned(qa_BxMxK, qb_BxNxK, sa_BxJxM, sb_BxJxN, jnp.dtype(out_dtype).name, auto, in_manual)


@functools.partial(custom_partitioning, static_argnums=(4, 5, 6))
def _partitioned(qa, qb, sa, sb, out_dtype, auto, in_manual):
    return local_gemm(qa, qb, sa, sb, out_dtype)


def _mesh(auto, sharding):
    """The mesh the partitioner's shardings are read and written on: the first devices of the assignment over
    the axes that are not manual. JAX's callback passes the physical mesh only outside shard_map (inside, an
    empty one, and shardings numbering the region's devices), so both cases build it here. Inside a manual
    region these devices need not form one of its groups; the partition issues no collective there, so only
    the axes' names and sizes matter."""
    names, sizes = zip(*auto)
    return jax.sharding.Mesh(np.array(sharding._device_assignment[:int(np.prod(sizes))]).reshape(sizes), names)


def _spec(sharding, mesh, ndim: int) -> tuple:
    """A sharding's partition spec of `ndim` entries, from XLA's form (JAX's own decoding fails on the
    sub-axis shardings Shardy gives the scales, e.g. fsdp=8 split 2 x 4). One that is not whole mesh axes
    reads as replicated: the partition then asks for what it needs."""
    from jax._src.sharding_impls import parse_flatten_op_sharding
    try:
        spec = tuple(parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0])
    except (ValueError, NotImplementedError, AssertionError):  # sub-axes, several subgroup kinds
        spec = ()
    spec = tuple(entry if entry not in ((), []) else None for entry in spec)  # unsharded: None, whatever the JAX
    return spec + (None,) * (ndim - len(spec))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _layout(mesh, in_manual, shapes, result=None):
    """(batch, m, n, k, scatter): the specs a shard computes on (module doc) and where its K sum lands
    (1: M, 2: N, None: all-reduced): the dimension the result's users shard over K's axes (`result`, what the
    partitioner propagated back: a weight gradient's reduce-scatter), else all-reduced (a row-parallel
    layer's activations, as an einsum's)."""
    a, b = (_spec(s.sharding, mesh, 3) for s in shapes[:2])
    batch, m = a[0], a[1]
    used = set(_axes(batch)) | set(_axes(m))
    n = b[1] if not used & set(_axes(b[1])) else None
    size = lambda entry: int(np.prod([mesh.shape[x] for x in _axes(entry)]))
    K = shapes[0].shape[2]
    k = a[2] if (a[2] == b[2] and not in_manual and not (used | set(_axes(n))) & set(_axes(a[2]))
                 and K % (size(a[2]) * BLOCK) == 0) else None
    scatter = None
    if k is not None:
        M, N = shapes[0].shape[1], shapes[1].shape[1]
        free = [d for d, entry, width in ((1, m, M), (2, n, N)) if entry is None and width % size(k) == 0]
        wanted = [d for d in free if result is not None and _spec(result.sharding, mesh, 3)[d] == k]
        scatter = (wanted or [None])[0]
    return batch, m, n, k, scatter


def _out_spec(batch, m, n, k, scatter):
    return P(batch, k if scatter == 1 else m, k if scatter == 2 else n)


def _infer(out_dtype, auto, in_manual, mesh, shapes, result_shape):
    mesh = _mesh(auto, shapes[0].sharding)  # not the callback's (`_mesh`)
    return NamedSharding(mesh, _out_spec(*_layout(mesh, in_manual, shapes)))


def _partition(out_dtype, auto, in_manual, mesh, shapes, result_shape):
    mesh = _mesh(auto, shapes[0].sharding)  # not the callback's (`_mesh`)
    batch, m, n, k, scatter = _layout(mesh, in_manual, shapes, result_shape)

    def lower(qa, qb, sa, sb):
        y = local_gemm(qa, qb, sa, sb, out_dtype)
        if k is None:
            return y
        if scatter is None:
            return jax.lax.psum(y, k)
        return jax.lax.psum_scatter(y, k, scatter_dimension=scatter, tiled=True)

    specs = (P(batch, m, k), P(batch, n, k), P(batch, k, m), P(batch, k, n))
    return (mesh, lower, NamedSharding(mesh, _out_spec(batch, m, n, k, scatter)),
            tuple(NamedSharding(mesh, s) for s in specs))


_partitioned.def_partition(
    infer_sharding_from_operands=_infer, partition=_partition,
    decode_shardings=False,
    sharding_rule=SdyShardingRule(operand_mappings=(("b", "m", "k"), ("b", "n", "k"), ("b", "j", "m"), ("b", "j", "n")),
                                  result_mappings=(("b", "m", "n"),), reduction_factors=("k", "j")))
