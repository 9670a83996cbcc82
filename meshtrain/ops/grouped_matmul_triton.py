"""The grouped matmul on NVIDIA GPUs: three Pallas Triton kernels whose work follows the rows routed,
not the buffer that holds them (meshtrain/ops/grouped_matmul.py chooses them on a GPU).

- `gmm` y[r] = x[r] @ w[group[r]] (or w[group[r]].T): a program per (tile, group) step of the
  megablox schedule (grouped_matmul.py `_schedule`) and column block. A step whose group has no row
  in its tile exits before the K loop, so a tile costs the groups it holds and the worst-case
  buffer's empty tiles cost a launch; rows of no group (padding, group >= G) are not written (their
  values are the buffer's, unspecified: their readers mask them, meshtrain/ops/block_exchange.py).
- `tgmm` dw[g] = x[rows of g].T @ dy[rows of g], fp32: a program per (group, K block, N block)
  loops over its group's row tiles only (the group's offsets), so it too costs the rows it has.

Each kernel accumulates in fp32 and is one `__gpu$xla.gpu.triton` call in the GPU program, named
`meshtrain_<kernel>_rows<R>`: R is the rows it is expected to run (`rows`; balanced routing on an
expert-parallel buffer, models/experts.py), which the planner prices it by (meshtrain/planner/
kernel_time.py). Tests run the kernels in Pallas' interpreter on the CPU.

Names carry their shapes: R rows (a whole number of tiles), K and N the matmul's widths, G groups,
S the schedule's steps, BM a tile's rows, BK and BN the K and N blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# Blocks for Hopper (bf16 in, fp32 accumulated; a width a block does not divide takes the largest power of
# two that does, down to MIN_BLOCK, the tensor cores' 16), the fastest of those timed on an H200
# (benchmarks/grouped_matmul.py --tiles and --tiles tgmm; RESULTS.md, 2026-12-04) at Qwen3-30B-A3B's
# widths. gmm and gmm_t: 128 rows x 256 columns in 64-wide K steps on 8 warps, 3 stages (1.11 and 1.22 ms
# against 1.58 and 1.41 at Triton's usual 128 x 128 x 64 on 4 warps, one run). tgmm: its own, 64 rows a
# step into a 128 x 256 block of dw on 8 warps (1.65x and 1.85x faster than at gmm's old tile).
BM, BK, BN = 128, 64, 256
WARPS, STAGES = 8, 3
# tgmm's own: its rows are the reduction, stepped TGMM_BM at a time (a divisor of BM, the buffer's tile)
TGMM_BM, TGMM_BK, TGMM_BN = 64, 128, 256
TGMM_WARPS, TGMM_STAGES = 8, 3
MIN_BLOCK = 16
NAME = "meshtrain_{kernel}_rows{rows}"  # the planner reads the kernel and its rows back (kernel_time.py)


def most_blocks(dtype, bk: int, bn: int) -> tuple[int, int]:
    """(bk, bn), bf16's blocks, for operands of `dtype`: halved for 4-byte operands, so that STAGES copies of a
    step's operand tiles fit a Hopper's 227 KiB of shared memory (fp32 at bf16's blocks asked 257 KiB of
    XLA's GPU compiler for an H200)."""
    shrink = max(1, jnp.dtype(dtype).itemsize // 2)
    return bk // shrink, bn // shrink


def group_ids(groups: int, runs: int) -> int:
    """How many group ids rows of `runs` sorted runs of `groups` groups carry: run r's group j is
    r (G + 1) + j, and r (G + 1) + G its padding (grouped_matmul.py `grouped_matmul`; the loop's too)."""
    return runs * (groups + 1)


def weight_of(g, groups: int):
    """(weight index, whether it is one) of a step's group id `g` (-1: none; `group_ids`)."""
    j = jax.lax.rem(jnp.maximum(g, 0), groups + 1)
    return jnp.minimum(j, groups - 1), (g >= 0) & (j < groups)


def block(width: int, most: int) -> int | None:
    """The largest power of two <= `most` dividing `width`, None below MIN_BLOCK."""
    b = most
    while b >= MIN_BLOCK and width % b:
        b //= 2
    return b if b >= MIN_BLOCK else None


def fits(k: int, n: int) -> bool:
    """The kernels take widths [k, n] (and the transposed product's [n, k]): each has a block."""
    return k % MIN_BLOCK == 0 and n % MIN_BLOCK == 0


def _gmm_kernel(tile_ref, group_ref, row_group_ref, x_ref, w_ref, out_ref, *, groups, bk, bn, transpose):
    s, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[s]
    expert, real = weight_of(g, groups)
    rows = pl.ds(pl.multiple_of(tile_ref[s] * BM, BM), BM)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    group_T = row_group_ref[rows]
    mine_T = (group_T == g) & real

    @pl.when(jnp.max(mine_T.astype(jnp.int32)) > 0)
    def _():
        def step(k, acc_TxN):
            ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
            w_KxN = w_ref[expert, cols, ks].T if transpose else w_ref[expert, ks, cols]
            return acc_TxN + jnp.dot(x_ref[rows, ks], w_KxN, preferred_element_type=jnp.float32)

        acc_TxN = jax.lax.fori_loop(0, x_ref.shape[1] // bk, step, jnp.zeros((BM, bn), jnp.float32))
        plt.store(out_ref.at[rows, cols], acc_TxN.astype(out_ref.dtype), mask=mine_T[:, None])


def gmm(x_RxK, w_GxKxN, steps, group_R, rows: int, transpose: bool = False, interpret: bool = False):
    """out[r] = x[r] @ w[group[r]] (w[group[r]].T when `transpose`; padding rows: not written) over the
    schedule `steps` (tile_S, group_S) of BM-row tiles, whose group ids (grouped_matmul.py `group_ids`)
    name the weight (`weight_of`)."""
    (R, K), G = x_RxK.shape, w_GxKxN.shape[0]
    N = w_GxKxN.shape[1] if transpose else w_GxKxN.shape[2]
    most_k, most_n = most_blocks(x_RxK.dtype, BK, BN)
    bk, bn = block(K, most_k), block(N, most_n)
    tile_S, group_S = steps
    kernel = functools.partial(_gmm_kernel, groups=G, bk=bk, bn=bn, transpose=transpose)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((R, N), x_RxK.dtype), grid=(tile_S.shape[0], N // bn),
        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES), interpret=interpret,
        name=NAME.format(kernel="gmm_t" if transpose else "gmm", rows=rows),
    )(tile_S, group_S, group_R, x_RxK, w_GxKxN)


def _tgmm_kernel(offset_ref, row_group_ref, x_ref, dy_ref, dw_ref, *, groups, runs, bt, bk, bn):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ks, ns = pl.ds(pl.multiple_of(i * bk, bk), bk), pl.ds(pl.multiple_of(j * bn, bn), bn)

    def group_rows(run, acc_KxN):  # expert g's rows in one run: id run (G + 1) + g
        gid = run * (groups + 1) + g
        start, end = offset_ref[gid], offset_ref[gid + 1]

        def step(t, acc_KxN):
            rows = pl.ds(pl.multiple_of(t * bt, bt), bt)
            mine_T = row_group_ref[rows] == gid
            # both masked: a row of another group or of padding may hold anything (NaN x 0 is NaN)
            x_TxK = jnp.where(mine_T[:, None], x_ref[rows, ks], 0)
            dy_TxN = jnp.where(mine_T[:, None], dy_ref[rows, ns], 0)
            return acc_KxN + jnp.dot(x_TxK.T, dy_TxN, preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(start // bt, (end + bt - 1) // bt, step, acc_KxN)

    dw_ref[g, ks, ns] = jax.lax.fori_loop(0, runs, group_rows, jnp.zeros((bk, bn), jnp.float32))


def tgmm(x_RxK, dy_RxN, group_R, groups: int, runs: int, rows: int, interpret: bool = False):
    """dw[g] = sum over the rows r of expert g of x[r]^T dy[r], in fp32 ([G, K, N]; an expert without
    rows: 0). Rows in `runs` runs sorted by group id (grouped_matmul.py `group_ids`)."""
    K, N = x_RxK.shape[1], dy_RxN.shape[1]
    most_k, most_n = most_blocks(x_RxK.dtype, TGMM_BK, TGMM_BN)
    bk, bn, bt = block(K, most_k), block(N, most_n), min(TGMM_BM, BM)
    ids = jnp.arange(group_ids(groups, runs) + 1, dtype=group_R.dtype)
    offset_I1 = jnp.searchsorted(group_R, ids, method="compare_all").astype(jnp.int32)  # one kernel, not a loop
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, groups=groups, runs=runs, bt=bt, bk=bk, bn=bn),
        out_shape=jax.ShapeDtypeStruct((groups, K, N), jnp.float32), grid=(groups, K // bk, N // bn),
        compiler_params=plt.CompilerParams(num_warps=TGMM_WARPS, num_stages=TGMM_STAGES), interpret=interpret,
        name=NAME.format(kernel="tgmm", rows=rows),
    )(offset_I1, group_R, x_RxK, dy_RxN)
