"""One data-parallel gradient reduction per step, for every ZeRO stage.

Inside `jax.shard_map` over the `data` axis (manual; the other axes stay compiler-managed), each
data shard runs the forward and backward of its own rows for every microbatch and sums the
gradients locally, in fp32. After the microbatch loop the gradients are reduced over `data` once:
averaged (pmean) where they are replicated over `data` (zero 0/1), reduce-scattered
(psum_scatter / N) where ZeRO-2/3 shard them. Parameters that ZeRO-3 shards over `data` are
all-gathered once, in the compute dtype, before the loop. Left to XLA, the accumulator's sharding
would ask for a reduction every microbatch.

Beside compiler-managed axes (tensor), the gather and reduce-scatter over `data` run on each
device's block, in a shard_map over those axes too (`_per_block`), on arrays unfolded so that
`data`, the minor factor of a dimension it shares, has a dimension of its own (`unfold`); the
pipeline (meshtrain/engine/pipeline.py) does the same.

With `parallel.grad_compression=int8` (meshtrain/parallel/compression.py) the reduction moves int8 blocks
and their scales instead (an all-to-all, and at zero 0/1 an all-gather), with each data shard's
error-feedback residuals passed in and out beside the gradients.

The price: during the step a data shard holds gradients (and, under zero 3, parameters) whole over
`data`, as at zero 1; between steps the ZeRO layout holds. `fsdp` is the axis that gathers and
reduce-scatters per layer and microbatch, bounding those bytes instead.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.parallel.batching import Gradients, StepInputs
from meshtrain.parallel.sharding import axes_entry, entry_axes, manual_axes_rules

AXIS = "data"
_is_spec = lambda x: isinstance(x, P)


def is_manual(data_size: int, *, microbatches: int = 1, pipelined: bool = False, zero: int = 0,
              compressed: bool = False) -> bool:
    """Whether the step runs `data` as a manual axis: with data > 1, under microbatches, a pipeline
    or gradient compression, and at zero 0/1 always. With one microbatch and no compression, zero
    2/3 keep XLA's per-layer reduce-scatters (and gathers): already one reduction per step, and
    they bound the memory."""
    return data_size > 1 and (pipelined or compressed or microbatches > 1 or zero <= 1)


def local_spec(spec: P, manual) -> P:
    """The part of a PartitionSpec over the `manual` axes: a shard_map's in/out spec."""
    return P(*[axes_entry(a for a in entry_axes(e) if a in manual) for e in spec])


def local_specs(specs, manual):
    return jax.tree.map(lambda s: local_spec(s, manual), specs, is_leaf=_is_spec)


def _data_dim(spec: P):
    return next((i for i, e in enumerate(spec) if AXIS in entry_axes(e)), None)


def _blockwise(spec: P):
    """(the dimension `spec` splits over `data`, the axes before `data` in its entry) where `data` is
    its entry's minor factor (sharding.spec_for: beside any axis but fsdp), else None: then each
    data shard's block lies within one block of the other axes, and the gather and reduce-scatter
    over `data` run per device block (`_per_block`)."""
    for d, entry in enumerate(spec):
        axes = entry_axes(entry)
        if AXIS in axes:
            return (d, axes[:-1]) if axes[-1] == AXIS else None
    return None


def unfold_spec(spec: P) -> P:
    """`spec` with a dimension that other axes split before `data` written as two, (those axes,
    `data`): the layout `unfold` gives."""
    found = _blockwise(spec)
    if found is None or not found[1]:
        return spec
    d, before = found
    return P(*spec[:d], axes_entry(before), AXIS, *spec[d + 1:])


def unfold(x, spec: P, sizes):
    """`x` (laid out as `spec`) reshaped as `unfold_spec` says: the dimension n that B axes and then
    `data` split becomes (B, n / B). Each data shard's block of it is then a block of the second
    dimension: a shard_map over `data` takes it where it lies, and gathering it moves nothing over B."""
    found = _blockwise(spec)
    if found is None or not found[1]:
        return x
    d, before = found
    b = math.prod(sizes[a] for a in before)
    return x.reshape(*x.shape[:d], b, x.shape[d] // b, *x.shape[d + 1:])


def fold(x, spec: P):
    """The inverse of `unfold`."""
    found = _blockwise(spec)
    if found is None or not found[1]:
        return x
    d = found[0]
    return x.reshape(*x.shape[:d], x.shape[d] * x.shape[d + 1], *x.shape[d + 2:])


def _per_block(fn, x, spec: P):
    """`fn` on each device's block of `x` (laid out over the compiler-managed axes as `spec` says,
    inside a shard_map over `data`). XLA partitions a collective over a manual `data` on an array
    that other, compiler-managed axes split by first gathering it whole over them (19x the formula's
    all-gather beside `tensor`): made manual too, they stay where they are."""
    mesh = jax.sharding.get_abstract_mesh()
    others = {a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1}
    if not others:
        return fn(x)
    local = local_spec(spec, others)
    return jax.shard_map(fn, mesh=mesh, in_specs=local, out_specs=local, axis_names=others, check_vma=False)(x)


def layouts(specs):
    """`unfold_spec` of every spec."""
    return jax.tree.map(unfold_spec, specs, is_leaf=_is_spec)


def unfolded(tree, specs, sizes, mesh=None):
    """`unfold` of every leaf (laid out as `specs`); with `mesh`, outside the shard_map, pinned to
    the unfolded layout (a local reshape)."""
    def one(spec, x):
        x = unfold(x, spec, sizes)
        return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, unfold_spec(spec)))

    return jax.tree.map(one, specs, tree, is_leaf=_is_spec)


def folded(tree, specs, mesh=None):
    """`fold` of every leaf back to `specs`' shape; with `mesh`, outside the shard_map, pinned to `specs`."""
    def one(spec, x):
        x = fold(x, spec)
        return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(one, specs, tree, is_leaf=_is_spec)


def gather(tree, specs, layouts=None):
    """Whole over `data`: all-gather the leaves whose spec splits a dimension over it. `layouts`
    (the leaves' unfolded global specs): gathered per device block (`_per_block`)."""
    def one(x, spec, layout=None):
        d = _data_dim(spec)
        if d is None:
            return x
        fn = lambda b: jax.lax.all_gather(b, AXIS, axis=d, tiled=True)
        return fn(x) if layout is None or _blockwise(layout) is None else _per_block(fn, x, layout)

    return jax.tree.map(one, tree, specs, *([layouts] if layouts else []), is_leaf=_is_spec)


def reduce_mean(tree, specs, layouts=None):
    """The mean over `data` of every data shard's gradients, laid out as `specs` say: pmean, or
    reduce-scatter of the sum, then / N, on the dimension a spec splits over `data`. `layouts` (the
    leaves' unfolded global specs): reduce-scattered per device block (`_per_block`)."""
    n = jax.lax.axis_size(AXIS)

    def one(g, spec, layout=None):
        d = _data_dim(spec)
        if d is None:
            return jax.lax.pmean(g, AXIS)
        fn = lambda b: jax.lax.psum_scatter(b, AXIS, scatter_dimension=d, tiled=True) / n
        return fn(g) if layout is None or _blockwise(layout) is None else _per_block(fn, g, layout)

    return jax.tree.map(one, tree, specs, *([layouts] if layouts else []), is_leaf=_is_spec)


def input_specs(inputs: StepInputs, rows_spec: P | None, error_specs) -> StepInputs:
    """The shard_map specs of a step's inputs: every leaf of the rows split as `rows_spec` says (the
    batch's dimension; None: no rows), the shared values and the loss scale replicated, the residuals
    as laid out (absent fields stay None)."""
    each = lambda tree, spec: jax.tree.map(lambda _: spec, tree)
    return StepInputs(each(inputs.rows, rows_spec), each(inputs.shared, P()),
                      None if inputs.loss_scale is None else P(),
                      None if inputs.grad_error is None else error_specs)


def data_parallel(metrics_and_grads, mesh, param_specs, grad_specs, batch_spec: P, compressor=None,
                  error_specs=None):
    """A gradient function (meshtrain/parallel/batching.py) with `metrics_and_grads` run per data
    shard on its rows (the loss scale replicated), its metrics averaged and its gradients reduced
    over `data` once. With a `compressor` (compression.Int8Reduction) the reduction is int8 with
    error feedback: the inputs' `grad_error` (laid out as `error_specs`) in, the new residuals out."""
    manual = {AXIS}
    # the leaves `data` splits as a minor factor are unfolded (`unfold`) on the way in and out, and
    # gathered and reduce-scattered over `data` per device block
    param_layouts, grad_layouts = layouts(param_specs), layouts(grad_specs)
    in_params, out_grads = local_specs(param_layouts, manual), local_specs(grad_layouts, manual)
    errors_local = local_specs(error_specs, manual) if compressor else None

    def per_shard(params, inputs: StepInputs) -> Gradients:
        with manual_axes_rules(manual):  # activations are constrained over the other axes only
            out = metrics_and_grads(folded(gather(params, in_params, param_layouts), param_specs), inputs)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), out.grads)  # reduced in fp32
            metrics = jax.lax.pmean(out.metrics, AXIS)
            if compressor is None:
                return Gradients(metrics, reduce_mean(unfolded(grads, grad_specs, mesh.shape), out_grads, grad_layouts))
            grads, errors = compressor.reduce_mean(grads, inputs.grad_error, manual, inputs.loss_scale)
            # each owned slice (this shard's row of every B block: compression.Int8Reduction) unfolded
            return Gradients(metrics, unfolded(grads, grad_specs, mesh.shape), errors)

    def fn(params, inputs: StepInputs) -> Gradients:
        rows_spec = P(local_spec(batch_spec, manual)[0])  # a row's other dimensions stay whole
        in_specs = (in_params, input_specs(inputs, rows_spec, errors_local))
        out = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs,
                            out_specs=Gradients(P(), out_grads, errors_local), axis_names=manual,
                            check_vma=False)(unfolded(params, param_specs, mesh.shape, mesh), inputs)
        return dataclasses.replace(out, grads=folded(out.grads, grad_specs, mesh))

    return fn
