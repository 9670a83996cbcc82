"""A grouped matmul for rows sorted by group, y[m] = x[m] @ w[group[m]], in O(rows x width) memory,
with its own backward (dw accumulated in fp32), on one of two implementations (`grouped_matmul`):
on NVIDIA GPUs three Pallas Triton kernels whose work follows the rows routed
(meshtrain/ops/grouped_matmul_triton.py), elsewhere a loop over (tile, group) steps, megablox-style.
XLA expands jax.lax.ragged_dot densely into [groups, rows, width] (on CPU in JAX 0.10 and on an H100
in JAX 0.11.2), which both avoid. The dropless experts run on it (models/experts.py).

Names carry their shapes: M rows, K and N the matmul's widths, G groups, R rows padded to whole
tiles, T a tile's rows, S the loop's steps.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from meshtrain.ops import grouped_matmul_triton as triton
from meshtrain.ops.grouped_matmul_triton import group_ids, weight_of
from meshtrain.ops.platform import GPU_PLATFORMS, by_platform

# Rows of the sorted buffer per grouped-matmul step. On an H100 (JAX 0.11.2, bf16, 16384 x 4096 @
# [G, 4096, 14336]) the loop ran 102/178/243 TFLOP/s at 128/256/512 rows with G = 8 (ragged_dot:
# 101, with 9x the temporaries) and 87/135/154 with G = 32 (ragged_dot: 25); a step spent on a
# tile's share of a group costs a whole tile, up to G - 1 extra tiles per matmul.
GMM_TILE = 256


def _schedule(group_M, groups: int, tile: int):
    """The grouped matmul's (tile, group) steps, megablox-style: tile t of the sorted rows meets
    groups first_t..last_t, so the nt + G - 1 steps (nt = ceil(M / tile)) cover every pair; the
    spare steps get group -1 (they match no row). Rows with group >= G (padding) join no pair."""
    nt = -(-group_M.shape[0] // tile)
    g_R = jnp.pad(jnp.minimum(group_M, groups - 1), (0, nt * tile - group_M.shape[0]), mode="edge")
    first_T, last_T = g_R[::tile], g_R[tile - 1::tile]
    pairs_T = last_T - first_T + 1
    end_T = jnp.cumsum(pairs_T)
    step_S = jnp.arange(nt + groups - 1)
    tile_S = jnp.minimum(jnp.searchsorted(end_T, step_S, side="right", method="compare_all"), nt - 1)
    group_S = first_T[tile_S] + step_S - (end_T - pairs_T)[tile_S]
    return tile_S, jnp.where(step_S < end_T[-1], group_S, -1)


def _tiles(a_MxX, tile: int):
    pad = -a_MxX.shape[0] % tile
    fill = jnp.iinfo(a_MxX.dtype).max if jnp.issubdtype(a_MxX.dtype, jnp.integer) else 0  # no group
    return jnp.pad(a_MxX, ((0, pad),) + ((0, 0),) * (a_MxX.ndim - 1), constant_values=fill)


def _gmm_loop(a_RxA, w_GxXxY, group_R, steps, tile: int, out_cols: int, transpose: bool):
    """out[r] = a[r] @ w[group[r]] (w[group[r]].T when `transpose`), a step per (tile, group id)."""
    tile_S, group_S = steps

    def step(i, out_RxO):
        t, g = tile_S[i] * tile, group_S[i]
        a_TxA = jax.lax.dynamic_slice_in_dim(a_RxA, t, tile)
        j, real = weight_of(g, w_GxXxY.shape[0])
        w_XxY = jax.lax.dynamic_index_in_dim(w_GxXxY, j, keepdims=False)
        y_TxO = a_TxA @ (w_XxY.T if transpose else w_XxY)
        mine_T = (jax.lax.dynamic_slice_in_dim(group_R, t, tile) == g) & real
        old_TxO = jax.lax.dynamic_slice_in_dim(out_RxO, t, tile)
        return jax.lax.dynamic_update_slice_in_dim(out_RxO, jnp.where(mine_T[:, None], y_TxO, old_TxO), t, 0)

    out = jnp.zeros((a_RxA.shape[0], out_cols), a_RxA.dtype)
    return jax.lax.fori_loop(0, tile_S.shape[0], step, out)


def _loop_forward(x_MxK, w_GxKxN, group_M, runs: int):
    M, (G, _, N) = x_MxK.shape[0], w_GxKxN.shape
    tile = min(GMM_TILE, M)
    return _gmm_loop(_tiles(x_MxK, tile), w_GxKxN, _tiles(group_M, tile), _schedule(group_M, group_ids(G, runs), tile),
                     tile, N, False)[:M]


def _loop_backward(x_MxK, w_GxKxN, group_M, dy_MxN, runs: int):
    """dx = dy @ w[g].T per row; dw[g] = sum over g's rows of x^T dy, accumulated in fp32."""
    M, K = x_MxK.shape
    G = w_GxKxN.shape[0]
    tile = min(GMM_TILE, M)
    tile_S, group_S = _schedule(group_M, group_ids(G, runs), tile)
    x_RxK, dy_RxN, group_R = _tiles(x_MxK, tile), _tiles(dy_MxN, tile), _tiles(group_M, tile)
    dx_RxK = _gmm_loop(dy_RxN, w_GxKxN, group_R, (tile_S, group_S), tile, K, True)

    def step(i, dw_GxKxN):
        t, g = tile_S[i] * tile, group_S[i]
        j, real = weight_of(g, G)
        mine_T = (jax.lax.dynamic_slice_in_dim(group_R, t, tile) == g) & real
        mine = lambda a_RxX: jnp.where(mine_T[:, None], jax.lax.dynamic_slice_in_dim(a_RxX, t, tile), 0)
        dw_KxN = jnp.einsum("tk,tn->kn", mine(x_RxK), mine(dy_RxN), preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_index_in_dim(dw_GxKxN, j, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw_GxKxN, old + dw_KxN, j, 0)

    dw = jax.lax.fori_loop(0, tile_S.shape[0], step, jnp.zeros(w_GxKxN.shape, jnp.float32))
    return dx_RxK[:M], dw.astype(w_GxKxN.dtype)


def _triton_steps(group_M, groups: int, runs: int):
    """The kernels' (tile, group id) schedule of BM-row tiles and the tiles' group ids."""
    return _schedule(group_M, group_ids(groups, runs), triton.BM), _tiles(group_M, triton.BM)


def _triton_forward(x_MxK, w_GxKxN, group_M, runs: int, rows: int, interpret: bool = False):
    M, G = x_MxK.shape[0], w_GxKxN.shape[0]
    steps, group_R = _triton_steps(group_M, G, runs)
    return triton.gmm(_tiles(x_MxK, triton.BM), w_GxKxN, steps, group_R, rows, interpret=interpret)[:M]


def _triton_backward(x_MxK, w_GxKxN, group_M, dy_MxN, runs: int, rows: int, interpret: bool = False):
    M, G = x_MxK.shape[0], w_GxKxN.shape[0]
    steps, group_R = _triton_steps(group_M, G, runs)
    dy_RxN = _tiles(dy_MxN, triton.BM)
    dx_MxK = triton.gmm(dy_RxN, w_GxKxN, steps, group_R, rows, transpose=True, interpret=interpret)[:M]
    dw_GxKxN = triton.tgmm(_tiles(x_MxK, triton.BM), dy_RxN, group_R, G, runs, rows, interpret=interpret)
    return dx_MxK, dw_GxKxN.astype(w_GxKxN.dtype)


def runs_rows_routed(platform: str, k: int, n: int) -> bool:
    """Whether a grouped matmul of widths [k, n] on `platform` runs only the rows routed (the Triton
    kernels, an NVIDIA GPU's), not its whole buffer (the loop: every tile, filled or not)."""
    return platform in GPU_PLATFORMS and triton.fits(k, n)


def _by_kernels(kernels: str, loop, kernel, w_GxKxN, *args, runs: int, rows: int):
    """The loop (`loop`) or the Triton kernels (`kernel`) on `args`, as `kernels` says (module doc)."""
    loop, use = partial(loop, runs=runs), partial(kernel, runs=runs, rows=rows)
    if kernels == "interpret":
        return use(*args, interpret=True)
    if kernels == "auto" and triton.fits(*w_GxKxN.shape[1:]):
        return by_platform(use, loop, *args)
    return loop(*args)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def grouped_matmul(x_MxK, w_GxKxN, group_M, rows: int | None = None, kernels: str = "auto", runs: int = 1):
    """y[m] = x[m] @ w[group[m]] for rows sorted by group (group >= G: padding, whose rows of y and
    of dx are 0 on the loop and not written by the Triton kernels: no reader may use them), in
    O(M x N) memory. `runs` > 1: the rows are that many runs each sorted by group with its padding
    last (expert parallelism's receive buffer, a block per sender), run r's group j carrying id
    r (G + 1) + j and its padding r (G + 1) + G (`group_ids`): no sort needed. `kernels`: "auto"
    runs the Triton kernels where the program is traced for NVIDIA GPUs (meshtrain/ops/platform.py)
    and the widths fit them (meshtrain/ops/grouped_matmul_triton.py; their work follows the rows
    routed), the loop over (tile, group) steps elsewhere (`_schedule`; XLA expands jax.lax.ragged_dot densely into
    [G, M, N] on both); "loop" or "interpret" (the Triton kernels in Pallas' interpreter, for
    tests) force one. `rows`: the rows expected routed (the planner prices the
    Triton kernels by them; None: all M)."""
    return _gmm_fwd(x_MxK, w_GxKxN, group_M, rows, kernels, runs)[0]


def _gmm_fwd(x_MxK, w_GxKxN, group_M, rows, kernels, runs):
    rows = x_MxK.shape[0] if rows is None else rows
    y = _by_kernels(kernels, _loop_forward, _triton_forward, w_GxKxN, x_MxK, w_GxKxN, group_M, runs=runs,
                    rows=rows)
    return y, (x_MxK, w_GxKxN, group_M)


def _gmm_bwd(rows, kernels, runs, res, dy_MxN):
    x_MxK, w_GxKxN, group_M = res
    rows = x_MxK.shape[0] if rows is None else rows
    dx, dw = _by_kernels(kernels, _loop_backward, _triton_backward, w_GxKxN, *res, dy_MxN, runs=runs, rows=rows)
    return dx, dw, None


grouped_matmul.defvjp(_gmm_fwd, _gmm_bwd)
