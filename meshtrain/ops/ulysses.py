"""Ulysses and hybrid context parallelism: attention over a `context` axis by all-to-all.

Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): the sequence is stored in order, a contiguous
slice of L/c positions per device of the axis (size c). Inside a shard_map over the axis, one
all-to-all each turns q, k and v from sequence-sharded [B, L/c, H, K] into head-sharded
[B, L, H/c, K]: device j gets heads j H/c .. (j+1) H/c - 1 of the whole sequence (and kv heads
j G/c ..: with H = G x R grouped contiguously, its query heads' kv heads). The local kernel
(`parallel.attention`: xla, blockwise, cudnn) runs on that unchanged, with the whole sequence's
positions, document ids and window; a fourth all-to-all takes the output back to
sequence-sharded. Autodiff transposes each all-to-all into the reverse one (4 more backward).
Each moves (c-1)/c of the tensor's local bytes off the device (`formulas.ulysses_all_to_all_bytes`).

Hybrid (USP, Fang & Zhao 2024; Megatron's hierarchical CP): the axis is cut into c/u groups of
u = `parallel.ulysses_degree` consecutive devices. The sequence is stored in the ring's
load-balanced order over the c/u groups (meshtrain/ops/context_parallel.py), each group's slot
split contiguously over its u devices; the all-to-all runs within each group (H/u heads of the
slot per device), and the ring passes K/V across the groups between devices of the same place in
them (`Ring.group`).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.ops.context_parallel import Ring
from meshtrain.ops.ring_schedule import load_balanced_order
from meshtrain.parallel.sharding import mesh_axis, rule_axes


def groups_of(c: int, degree: int):
    """The all-to-all groups: consecutive runs of `degree` devices of the axis (None: the whole axis)."""
    return None if degree == c else [list(range(g * degree, (g + 1) * degree)) for g in range(c // degree)]


def ulysses_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L=None, segment_ids=None, window: int = 0, *,
                      local=None, degree: int = 0, axis: str = "context"):
    """Causal GQA over the `axis` by all-to-all: the local kernel `local` (a meshtrain.ops.attention
    backend) on whole sequences of heads/degree heads (`degree` 0: the whole axis, Ulysses), or
    the ring across the groups (`degree` < the axis: hybrid; `local` unused). Arrays in storage
    order: the true order for Ulysses (`positions_L` None), `load_balanced_order(L, c/degree)`
    for hybrid. As `ring_attention`: under `jax.set_mesh`, inside `jax.jit`, possibly inside the
    caller's shard_map (over `axis` too: then the arrays are this device's slice); `segment_ids`
    [B, L] cover the whole sequence; without the axis (size 1), `local` alone."""
    mesh = jax.sharding.get_abstract_mesh()
    c, manual = mesh_axis(axis)
    if c == 1:
        return local(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, segment_ids=segment_ids, window=window)
    degree = degree or c
    ring = c // degree
    L = q_BxLxHxK.shape[1] * (c if manual else 1)
    want = None if ring == 1 else load_balanced_order(L, ring)
    if (positions_L is None) != (want is None) or (want is not None and not np.array_equal(positions_L, want)):
        raise ValueError(f"context parallelism of degree {degree} on an axis of {c} stores the sequence "
                         f"{'in order' if want is None else f'as load_balanced_order({L}, {ring})'}")
    groups = groups_of(c, degree)
    # Inside pipeline stages the ring gathers instead of passing blocks (as ring_attention does)
    across = Ring(cp=ring, axis=axis, window=window, gather="pipeline" in mesh.manual_axes, group=degree)

    def attend(q, k, v, *segments):
        to_heads = lambda x: lax.all_to_all(x, axis, 2, 1, tiled=True, axis_index_groups=groups)
        q, k, v = to_heads(q), to_heads(k), to_heads(v)  # [B, L/ring, H/degree, K]
        seg = segments[0] if segments else None
        if ring == 1:
            out = local(q, k, v, None, segment_ids=seg, window=window)
        else:
            out = across.attend(q, k, v, seg)
        return lax.all_to_all(out, axis, 1, 2, tiled=True, axis_index_groups=groups)  # back to [B, L/c, H, K]

    segments = () if segment_ids is None else (segment_ids,)
    if manual:
        return attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *segments)
    # The batch's and heads' own splits (data/fsdp, tensor) are manual too, so the all-to-all moves this
    # device's rows and heads: left to the compiler, it gathers them first (2x the bytes at fsdp=2).
    # Every other axis is manual as well (replicated in the specs): cuDNN's kernel is custom-partitioned,
    # which fails inside a partly manual region on XLA's GPU compiler.
    split = lambda name: tuple(a for a in rule_axes(name) if mesh.shape.get(a, 1) > 1 and a != axis
                               and a not in mesh.manual_axes)
    batch, heads = split("batch"), tuple(a for a in split("heads") if a in split("kv_heads"))
    spec = P(batch or None, axis, heads or None)
    whole = (P(batch or None),) * len(segments)
    manual_here = set(mesh.axis_names) - set(mesh.manual_axes)
    return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec) + whole, out_specs=spec,
                         axis_names=manual_here, check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *segments)


def context_degrees(strategy: str, C: int, ulysses_degree: int = 0) -> tuple[int, int]:
    """(devices round the ring (hybrid: groups), devices per all-to-all group) of
    `parallel.context_strategy` on a context axis of C: ring (C, 1), ulysses (1, C), hybrid (C / u, u)
    with u `parallel.ulysses_degree`; (1, 1) without a context axis."""
    u = {"ring": 1, "ulysses": C}.get(strategy, ulysses_degree or 1) if C > 1 else 1
    return C // u, u


def context_layout(strategy: str, attention, context: int, seq_len: int, degree: int = 0):
    """(the attention kernel, the sequence's storage order or None) the model runs with on a
    context axis of `context` under `parallel.context_strategy` (`attention`: the configured
    backend's function, meshtrain.ops.attention.BACKENDS)."""
    if context == 1:
        return attention, None
    ring, degree = context_degrees(strategy, context, degree)
    order = None if ring == 1 else load_balanced_order(seq_len, ring)
    if strategy == "ring":
        return attention, order
    return functools.partial(ulysses_attention, local=attention, degree=degree), order
