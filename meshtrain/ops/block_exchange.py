"""Expert parallelism's exchange of rows that moves only the rows routed.

A device's rows for the other devices of `axis` (size N) are packed by destination: `sent_N[n]` rows
for device n, one run after another. `dispatch` delivers them into a block per sender, [N, A, ...]
(block i: the rows device i sent here, recv_N[i] of them; past them zeros, or on GPUs whatever the
unfilled buffer held); `collect` sends each block's rows back, packed again in the sender's order (the
runs covering every packed row). The dropless experts (models/experts.py
`dropless_local`) dispatch their assignments sorted by expert (a run per destination), run what
arrived, and collect the results. A block is worst-case sized (A rows: static shapes); the rows
routed fill k/(N x min(k, E/N)) of the blocks when the routing is balanced (1/N at E/N >= k).

- On NVIDIA GPUs (meshtrain/ops/platform.py chooses): `jax.lax.ragged_all_to_all`, which moves
  only the rows the sizes name (the dispatch sized to the tokens, as Megatron's all-to-all-v); the
  packed side holds only the rows routed, no worst-case buffer. No receive buffer is filled
  (meshtrain/ops/unfilled.py: a zero fill and its copies cost Qwen3-30B-A3B's layer shape on
  expert=8 about a tenth of its step): the grouped matmuls that read the blocks mask every row past the
  runs, forward and backward. Each direction's transpose (the backward) is the other, a ragged
  all-to-all of the sizes swapped, whose blocks are not filled either.
- Elsewhere: the runs copied into worst-case blocks and `jax.lax.all_to_all` of the whole blocks
  (XLA:CPU has no ragged all-to-all: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU",
  JAX 0.10).

The same numbers on both (tests/test_moe_layer.py runs the GPU branch's offsets and sizes through
the ragged all-to-all's documented semantics, into blocks poisoned with NaN). The planner reads a
ragged all-to-all at its smaller side, the packed rows (meshtrain/planner/hlo.py `RAGGED`), and its
formula at the routing's balanced share of the blocks (models/experts.py `dispatch_bytes`'
`routed_share`).
Names carry shapes: N devices on `axis`, A rows a block, M packed rows.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from meshtrain.ops.platform import by_platform
from meshtrain.ops.unfilled import unfilled


def _starts(sizes_N):
    return (jnp.cumsum(sizes_N) - sizes_N).astype(jnp.int32)


def _ragged_dispatch(rows_MxD, sent_N, recv_N, block: int, axis: str, op=jax.lax.ragged_all_to_all,
                     empty=unfilled):
    return _dispatched(rows_MxD, sent_N, recv_N, block, rows_MxD.shape[0], axis, op, empty)


def _ragged_collect(y_NxAxD, recv_N, sent_N, rows: int, axis: str, op=jax.lax.ragged_all_to_all,
                    empty=unfilled):
    return _collected(y_NxAxD, recv_N, sent_N, y_NxAxD.shape[1], rows, axis, op, empty)


# Each exchange's transpose is the other (a ragged all-to-all of the sizes swapped), written here rather
# than left to JAX's rule, whose receive buffer for the backward's dispatch would be a zero fill.
# block: A rows a block; rows: M packed rows; op: the ragged all-to-all; empty: `unfilled` (tests poison it)
@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _dispatched(rows_MxD, sent_N, recv_N, block, rows, axis, op, empty):
    N = sent_N.shape[0]
    mine_N = jnp.full((N,), jax.lax.axis_index(axis) * block, jnp.int32)  # this device's block on each
    got = op(rows_MxD, empty((N * block,) + rows_MxD.shape[1:], rows_MxD.dtype, rows_MxD), _starts(sent_N),
             sent_N.astype(jnp.int32), mine_N, recv_N.astype(jnp.int32), axis_name=axis)
    return got.reshape((N, block) + rows_MxD.shape[1:])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _collected(y_NxAxD, recv_N, sent_N, block, rows, axis, op, empty):
    N = y_NxAxD.shape[0]
    flat = y_NxAxD.reshape((N * block,) + y_NxAxD.shape[2:])
    theirs_N = jax.lax.all_to_all(_starts(sent_N), axis, 0, 0, tiled=True)  # where each sender's run for here began
    # the packed side, k / (N min(k, E/N)) of the blocks' rows: the runs cover it (`collect`), not filled either
    return op(flat, empty((rows,) + flat.shape[1:], flat.dtype, flat), jnp.arange(N, dtype=jnp.int32) * block,
              recv_N.astype(jnp.int32), theirs_N, sent_N.astype(jnp.int32), axis_name=axis)


def _dispatched_fwd(rows_MxD, sent_N, recv_N, block, rows, axis, op, empty):
    return _dispatched(rows_MxD, sent_N, recv_N, block, rows, axis, op, empty), (sent_N, recv_N)


def _dispatched_bwd(block, rows, axis, op, empty, sizes, ct_NxAxD):
    sent_N, recv_N = sizes
    return _collected(ct_NxAxD, recv_N, sent_N, block, rows, axis, op, empty), None, None


def _collected_fwd(y_NxAxD, recv_N, sent_N, block, rows, axis, op, empty):
    return _collected(y_NxAxD, recv_N, sent_N, block, rows, axis, op, empty), (recv_N, sent_N)


def _collected_bwd(block, rows, axis, op, empty, sizes, ct_MxD):
    recv_N, sent_N = sizes
    return _dispatched(ct_MxD, sent_N, recv_N, block, rows, axis, op, empty), None, None


_dispatched.defvjp(_dispatched_fwd, _dispatched_bwd)
_collected.defvjp(_collected_fwd, _collected_bwd)


def _block_rows(sizes_N, block: int, rows: int):
    """For each row of N blocks of `block`: the packed row it holds (runs of `sizes_N`), or `rows`
    (none) past its run."""
    j_NxA = jnp.arange(block)[None, :]
    return jnp.where(j_NxA < sizes_N[:, None], _starts(sizes_N)[:, None] + j_NxA, rows).reshape(-1)


def _dense_dispatch(rows_MxD, sent_N, recv_N, block: int, axis: str):
    del recv_N  # whole blocks travel, zeros past each run
    N = sent_N.shape[0]
    blocks = jnp.take(rows_MxD, _block_rows(sent_N, block, rows_MxD.shape[0]), axis=0, mode="fill", fill_value=0)
    return jax.lax.all_to_all(blocks.reshape((N, block) + rows_MxD.shape[1:]), axis, 0, 0, tiled=True)


def _dense_collect(y_NxAxD, recv_N, sent_N, rows: int, axis: str):
    del recv_N
    N, A = y_NxAxD.shape[:2]
    back = jax.lax.all_to_all(y_NxAxD, axis, 0, 0, tiled=True).reshape((N * A,) + y_NxAxD.shape[2:])
    # packed row r came back where dispatch put it: the slot of the blocks holding r (none: N * A)
    slot_M = jnp.full((rows,), N * A).at[_block_rows(sent_N, A, rows)].set(jnp.arange(N * A), mode="drop")
    return jnp.take(back, slot_M, axis=0, mode="fill", fill_value=0)


def dispatch(rows_MxD, sent_N, recv_N, block: int, axis: str):
    """This device's rows packed by destination (sent_N[n] for device n, in device order) to their
    devices: [N, block, ...], block i the rows device i sent here (recv_N[i] of them, what its sent_N
    says for this device); past them zeros, or on GPUs unspecified values, which no reader may use unmasked.
    Inside a shard_map manual over `axis` (size N)."""
    return by_platform(partial(_ragged_dispatch, block=block, axis=axis),
                       partial(_dense_dispatch, block=block, axis=axis), rows_MxD, sent_N, recv_N)


def collect(y_NxAxD, recv_N, sent_N, rows: int, axis: str):
    """`dispatch` backwards: block i's first recv_N[i] rows back to device i, which gets [rows, ...]:
    what each device returns, packed in the order it was dispatched (sent_N). The runs must cover the
    packed rows (sum(sent_N) == rows, as the dropless experts' do: every assignment goes to one device):
    on GPUs a row past them would be unspecified, and so would its gradient through `dispatch`."""
    return by_platform(partial(_ragged_collect, rows=rows, axis=axis), partial(_dense_collect, rows=rows, axis=axis),
                       y_NxAxD, recv_N, sent_N)
