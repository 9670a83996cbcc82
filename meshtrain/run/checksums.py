"""Checksums of a state's values that do not depend on the mesh: one per leaf, the wrapping uint32 sum
of its raw bits (`state_checksums`), and a short hash of them (`tree_hash`). A checkpoint's manifest
records them at save and checks them at restore (meshtrain/run/checkpoint.py); a LoRA run's frozen
base is checked against its record by its hash (meshtrain/run/run_dir.py).
"""
from __future__ import annotations

import functools
import hashlib
import json

import jax
import jax.numpy as jnp


def _bits(x):
    """`x`'s raw bits as uint32 (8-byte types as two words)."""
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)


@functools.partial(jax.jit, static_argnums=1)
def _leaf_checksum(x, axis: int | None):
    """The sum of a leaf's raw bits as uint32, wrapping: exact and order-free, so the value does not
    depend on the mesh or on how the sum is grouped; any flipped bit changes it. XLA:CPU materialises
    the bitcast, so the bits are taken one slice along `axis` (a dimension no device splits) at a
    time, summed elementwise on each device, and across devices once at the end."""
    if axis is None:
        return jnp.sum(_bits(x), dtype=jnp.uint32)
    part = lambda i: _bits(jax.lax.dynamic_index_in_dim(x, i, axis, keepdims=False))
    return jnp.sum(jax.lax.fori_loop(1, x.shape[axis], lambda i, total: total + part(i), part(0)), dtype=jnp.uint32)


def state_checksums(state) -> list[int]:
    """One checksum per leaf, one leaf (and within it one slice) at a time: a program over the whole
    state held a copy of it on the CPU (S bytes of temporaries at every save and restore)."""
    def slice_axis(x):
        """A dimension every shard holds whole: the shortest of length 8 or more (at most an eighth of
        the leaf at a time, in few steps), else the longest."""
        whole = [d for d, (n, k) in enumerate(zip(x.shape, x.sharding.shard_shape(x.shape))) if n == k and n > 1]
        long = [d for d in whole if x.shape[d] >= 8]
        return min(long, key=lambda d: x.shape[d]) if long else max(whole, key=lambda d: x.shape[d], default=None)

    return [int(_leaf_checksum(x, slice_axis(x))) for x in jax.tree.leaves(state)]


def tree_hash(tree) -> str:
    """A short hash of a tree's values (its leaves' checksums, `state_checksums`): the same on every
    mesh and layer order, so a LoRA run's base, rebuilt anywhere, is checked against its record."""
    return hashlib.sha256(json.dumps(state_checksums(tree)).encode()).hexdigest()[:16]
