"""int8 gradient compression for the data-parallel reduction, with error feedback
(`parallel.grad_compression=int8`; as 1-bit Adam, Tang et al. 2021, and ZeRO++ qgZ, Wang et al.
2023, with int8 in place of their 1 and 4 bits).

Quantization, per block of b = `parallel.compression_block` values (one fp32 scale each):
    s = max|c_block| / 127,  q = round(c / s) in [-127, 127] (int8),  deq(q) = q s,
so |c - deq(q)| <= s / 2 per value. Error feedback: each data shard adds its residual e to its
local fp32 gradient, c = g + e, sends q and keeps e' = c - deq(q) for the next step. Over K steps
the values sent telescope: sum_k deq(q_k) = sum_k g_k - e_K, so nothing is lost, only delayed.

The reduction, inside `jax.shard_map` over `data` (N shards), on each device's local slice:
1. reduce-scatter as an all-to-all: each shard's c is cut into N rows, row i being the slice shard
   i owns (sharding.owned_specs); rows are quantized and exchanged (int8 + scales), so each shard
   receives every shard's row of its own, dequantizes and sums them in fp32, and divides by N.
   Under zero 2/3 (gradients sharded over `data` as ZeRO-2 lays them out) that mean is the result.
2. zero 0/1 (gradients replicated over `data`): the owned mean m is quantized again, with a second
   residual on the owned slice (1-bit Adam's "server" error: c2 = m + e2, e2' = c2 - deq(q2);
   without it a value below half a step of its block would be rounded away on every step), and
   all-gathered as int8 + scales; every shard dequantizes the same bytes. Here `data` is the minor
   factor of the owned dimension, so rows are cut from each device's slice where it lies and
   nothing moves over `fsdp`/`tensor`. (At zero 2/3 `data` is the minor factor beside `tensor`
   too, but the major one of fsdp's dimension: that layout asks XLA to move the fp32 gradient over
   `fsdp` first.)
Bytes per device for G bytes of fp32 gradient (G/4 values): each exchange moves G/4 int8 + G/b of
scales, (N-1)/N of it over the links: the all-to-all replaces the fp32 reduce-scatter's
(N-1)/N x G, all-to-all + all-gather replace the all-reduce's 2(N-1)/N x G, a ratio of
1/4 + 1/b (0.254 at b = 256) either way. `formulas.compressed_reduction_traffic` states it.

Blocks run over each device's local slice of all compressed gradients concatenated (rows padded
with zeros to a multiple of b), so every all-to-all and all-gather is one collective per step and
blocks need divide nothing. A gradient that the ZeRO-2 layout leaves whole over `data` (no
dimension divides by N; check_replication bounds such parameters under zero 3) is averaged in fp32.

Scaled losses (fp16): the gradients reduced are S x g. Residuals are stored unscaled (e, not S e)
and scaled by this step's S when added: S changes (halved on overflow, doubled after a window)
and a residual in last step's units would be off by that factor. S is a power of 2, so the
unscaling is exact. An overflowing step (inf in c makes its block's scale inf, so the reduced
gradient is NaN/Inf and the step is skipped) keeps the previous residuals (meshtrain/engine/step.py).

State (`grad_error`, a top-level train-state entry when int8 applies, i.e. data > 1): 'shards',
per gradient [N, *its shape with the data-split dimension written (before, N, after)], sharded
over `data` on the leading dimension and like the owned slice elsewhere: shard j's residual of
the values it sends to shard i; and, at zero 0/1, 'owned', per gradient in that split shape with
`data` on the N dimension: each shard's residual of its slice of the mean. Both are reshapes of
the gradient's own elements, so a checkpoint resumes them on any mesh that keeps these shapes;
another data size (or split of the data-split dimension) starts them at zero
(program.optional_state). Memory: 'shards' is the local gradient's fp32 bytes again on every
device (not divided by N, even at zero 3), 'owned' 1/N of it.
With data = 1 there is no data-parallel reduction to compress and the setting does nothing.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.parallel import data_parallel
from meshtrain.parallel.sharding import axes_entry, entry_axes

AXIS = data_parallel.AXIS
LEVELS = 127  # symmetric int8: -127..127
_is_spec = lambda x: isinstance(x, P)


def applies(plan, sizes) -> bool:
    """Whether `plan` compresses the data-parallel reduction on a mesh of these axis sizes."""
    return plan.grad_compression == "int8" and sizes[AXIS] > 1


# ---- quantization ----
def quantize(c_KxB):
    """Blocks [..., K, b] -> (int8 values [..., K, b], fp32 scales [..., K]): s = max|block| / 127,
    q = round(c / s). A NaN/Inf value makes its block's scale NaN/Inf, so it survives dequantizing."""
    scale_K = jnp.max(jnp.abs(c_KxB), axis=-1) / LEVELS
    safe_K = jnp.where(scale_K > 0, scale_K, 1.0)
    q_KxB = jnp.clip(jnp.round(c_KxB / safe_K[..., None]), -LEVELS, LEVELS).astype(jnp.int8)
    return q_KxB, scale_K


def dequantize(q_KxB, scale_K):
    return q_KxB.astype(jnp.float32) * scale_K[..., None]


def with_feedback(g_KxB, e_KxB, scale=1.0):
    """One error-feedback step: c = g + S e -> (q, scales, e' = (c - deq(q)) / S). `scale` (S) is
    fp16's loss scale when the gradients carry it; the residual stays in unscaled units."""
    c_KxB = g_KxB + scale * e_KxB
    q_KxB, s_K = quantize(c_KxB)
    return q_KxB, s_K, (c_KxB - dequantize(q_KxB, s_K)) / scale


def to_blocks(x_NxM, block: int):
    """[..., M] -> [..., ceil(M / b), b], zero-padded."""
    pad = -x_NxM.shape[-1] % block
    x_NxM = jnp.pad(x_NxM, [(0, 0)] * (x_NxM.ndim - 1) + [(0, pad)])
    return x_NxM.reshape(*x_NxM.shape[:-1], -1, block)


def from_blocks(x_KxB, size: int):
    return x_KxB.reshape(*x_KxB.shape[:-2], -1)[..., :size]


# ---- layouts ----
def data_dim(spec: P):
    """(the dimension a spec splits over `data`, the entry's axes before `data`, those after), or None.
    `pipeline`, manual where it is used, must come first in its entry."""
    for d, entry in enumerate(spec):
        axes = entry_axes(entry)
        if AXIS in axes:
            i = axes.index(AXIS)
            return None if "pipeline" in axes[1:] else (d, axes[:i], axes[i + 1:])
    return None


def _split_layout(shape, spec, found, sizes: dict, data_entry):
    """Dimension d of (shape, spec) written as (before, N, after), split as the entry's axes are."""
    d, before, after = found
    b, n = math.prod(sizes[a] for a in before), sizes[AXIS]
    return ((*shape[:d], b, n, shape[d] // (b * n), *shape[d + 1:]),
            (*spec[:d], axes_entry(before), data_entry, axes_entry(after), *spec[d + 1:]))


def error_shapes_and_specs(params, owned_specs, sizes: dict, zero: int):
    """The `grad_error` state's (ShapeDtypeStructs, PartitionSpecs) for parameters `params`
    (arrays or ShapeDtypeStructs), the slices each data shard reduces (`owned_specs`,
    sharding.owned_specs) and the mesh sizes: each gradient's shape with its data-split dimension
    written (before, N, after), so that `data` sits on a dimension of its own (a shard_map over
    `data` then cuts nothing else), led by [N] in 'shards'."""
    n = sizes[AXIS]
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)

    def shard_error(x, spec):
        found = data_dim(spec)
        if found is None:  # averaged in fp32: a placeholder keeps the tree's structure
            return f32((n,)), P(AXIS)
        shape, split = _split_layout(x.shape, spec, found, sizes, None)
        return f32((n, *shape)), P(AXIS, *split)

    def owned_error(x, spec):
        found = data_dim(spec)
        if found is None:
            return f32(()), P()
        shape, split = _split_layout(x.shape, spec, found, sizes, AXIS)
        return f32(shape), P(*split)

    def split(fn):
        pairs = jax.tree.map(fn, params, owned_specs, is_leaf=_is_spec)
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and _is_spec(x[1])
        return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
                jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))

    shapes, specs = {}, {}
    shapes["shards"], specs["shards"] = split(shard_error)
    if zero <= 1:
        shapes["owned"], specs["owned"] = split(owned_error)
    return shapes, specs


def init_error(params, owned_specs, sizes: dict, zero: int):
    """Zero residuals (see `error_shapes_and_specs`)."""
    shapes, _ = error_shapes_and_specs(params, owned_specs, sizes, zero)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _to_rows(x, d: int):
    """[..., B, N, after, ...] (B, N, after at d, d+1, d+2) -> rows [N, ..., B x after, ...]."""
    x = jnp.moveaxis(x, d + 1, 0)
    return x.reshape(*x.shape[:d + 1], -1, *x.shape[d + 3:])


def _from_rows(rows, d: int, b: int):
    """The inverse of `_to_rows`, B being `b`."""
    rows = rows.reshape(*rows.shape[:d + 1], b, -1, *rows.shape[d + 2:])
    return jnp.moveaxis(rows, 0, d + 1)


class Int8Reduction:
    """The compressed mean over `data` of every data shard's gradients, for one program: `grad_specs`
    (the gradients' layout after the step's reduction), `owned_specs` (the slice each data shard
    reduces: sharding.owned_specs), `block` values per scale."""

    def __init__(self, mesh, grad_specs, owned_specs, block: int, zero: int):
        self.mesh, self.block, self.gathers = mesh, block, zero <= 1
        self.grad_specs, self.owned_specs = grad_specs, owned_specs

    def reduce_mean(self, grads, errors, manual, scale=None):
        """Inside `jax.shard_map` over `manual` (with `data`): (grads whole over `data`, this shard's
        `grad_error` entry) -> (the mean laid out as `grad_specs` say, the new residuals)."""
        leaves, tree = jax.tree.flatten(grads)
        owned = tree.flatten_up_to(self.owned_specs)
        found = [data_dim(spec) for spec in owned]
        # a gradient no dimension of which divides by N: the fp32 mean
        results = [data_parallel.reduce_mean(g, data_parallel.local_spec(spec, manual)) if f is None else None
                   for g, f, spec in zip(leaves, found, tree.flatten_up_to(self.grad_specs))]
        errors = {k: tree.flatten_up_to(v) for k, v in errors.items()}  # 'shards' [, 'owned']
        packed = [i for i, f in enumerate(found) if f is not None]
        if packed:
            # Each local gradient in its residual's split shape: dimension d as (B, N, after), B the
            # compiler-managed axes before `data` in its entry, which then stay where they are. Row i:
            # what data shard i owns.
            dims = [found[i][0] for i in packed]
            bs = [errors["shards"][i].shape[1 + d] for i, d in zip(packed, dims)]
            rows = [_to_rows(leaves[i].reshape(errors["shards"][i].shape[1:]), d) for i, d in zip(packed, dims)]
            e_in = {"shards": [_to_rows(errors["shards"][i][0], d) for i, d in zip(packed, dims)]}
            compiler = set(self.mesh.axis_names) - set(manual)
            local = [data_parallel.local_spec(owned[i], compiler) for i in packed]  # the owned slice over them
            row_specs = [P(None, *spec) for spec in local]
            e_specs = {"shards": row_specs}
            if self.gathers:
                e_in["owned"] = [errors["owned"][i].reshape(r.shape[1:]) for i, r in zip(packed, rows)]
                e_specs["owned"] = local
            reduced, e_out = jax.shard_map(
                self._local, mesh=jax.sharding.get_abstract_mesh(), in_specs=(row_specs, e_specs, P()),
                out_specs=(row_specs if self.gathers else local, e_specs),
                axis_names=compiler, check_vma=False,
            )(rows, e_in, jnp.float32(1.0) if scale is None else scale)
            for k, (i, d, b) in enumerate(zip(packed, dims, bs)):
                if self.gathers:
                    results[i] = _from_rows(reduced[k], d, b).reshape(leaves[i].shape)
                    errors["owned"][i] = e_out["owned"][k].reshape(errors["owned"][i].shape)
                else:  # the owned slice: this shard's row of each B block, B major (the executors unfold
                    # it as data_parallel.unfold lays it out)
                    results[i] = reduced[k]
                errors["shards"][i] = _from_rows(e_out["shards"][k], d, b)[None]
        return tree.unflatten(results), {k: tree.unflatten(v) for k, v in errors.items()}

    def _local(self, rows, errors, scale):
        """On one device's local slices (every axis manual): quantize with feedback, all-to-all,
        dequantize and sum; at zero 0/1 quantize the mean again and all-gather it."""
        n, b = jax.lax.axis_size(AXIS), self.block
        sizes = [r[0].size for r in rows]
        flat = lambda xs, lead: jnp.concatenate([x.reshape(*lead, -1) for x in xs], axis=-1)

        def split_like(x, likes, lead):
            """[*lead, total] -> one array per gradient, shaped as `likes`."""
            out, at = [], 0
            for like, size in zip(likes, sizes):
                out.append(x[..., at:at + size].reshape(*lead, *like.shape[len(lead):]))
                at += size
            return out

        total = sum(sizes)
        c_NxKxB, e_NxKxB = to_blocks(flat(rows, (n,)), b), to_blocks(flat(errors["shards"], (n,)), b)
        q_NxKxB, s_NxK, e_NxKxB = with_feedback(c_NxKxB, e_NxKxB, scale)
        new = {"shards": split_like(from_blocks(e_NxKxB, total), rows, (n,))}
        # each shard receives every shard's row of its own: [N senders, K, b]
        q_NxKxB = jax.lax.all_to_all(q_NxKxB, AXIS, 0, 0, tiled=True)
        s_NxK = jax.lax.all_to_all(s_NxK, AXIS, 0, 0, tiled=True)
        mean_KxB = jnp.sum(dequantize(q_NxKxB, s_NxK), axis=0) / n
        if not self.gathers:
            return split_like(from_blocks(mean_KxB, total), [r[0] for r in rows], ()), new
        q_KxB, s_K, e2_KxB = with_feedback(mean_KxB, to_blocks(flat(errors["owned"], ()), b), scale)
        new["owned"] = split_like(from_blocks(e2_KxB, total), errors["owned"], ())
        q_NxKxB = jax.lax.all_gather(q_KxB, AXIS, axis=0)
        s_NxK = jax.lax.all_gather(s_K, AXIS, axis=0)
        return split_like(from_blocks(dequantize(q_NxKxB, s_NxK), total), rows, (n,)), new
