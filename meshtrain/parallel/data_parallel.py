"""One data-parallel gradient reduction per step, for every ZeRO stage.

Inside `jax.shard_map` over the `data` axis (manual; the other axes stay compiler-managed), each
data shard runs the forward and backward of its own rows for every microbatch and sums the
gradients locally, in fp32. After the microbatch loop the gradients are reduced over `data` once:
averaged (pmean) where they are replicated over `data` (zero 0/1), reduce-scattered
(psum_scatter / N) where ZeRO-2/3 shard them. Parameters that ZeRO-3 shards over `data` are
all-gathered once, in the compute dtype, before the loop. Left to XLA, the accumulator's sharding
would ask for a reduction every microbatch.

With `parallel.grad_compression=int8` (meshtrain/parallel/compression.py) the reduction moves int8 blocks
and their scales instead (an all-to-all, and at zero 0/1 an all-gather), with each data shard's
error-feedback residuals passed in and out beside the gradients.

The price: during the step a data shard holds gradients (and, under zero 3, parameters) whole over
`data`, as at zero 1; between steps the ZeRO layout holds. `fsdp` is the axis that gathers and
reduce-scatters per layer and microbatch, bounding those bytes instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
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


def gather(tree, specs):
    """Whole over `data`: all-gather the leaves whose spec splits a dimension over it."""
    def one(x, spec):
        d = _data_dim(spec)
        return x if d is None else jax.lax.all_gather(x, AXIS, axis=d, tiled=True)

    return jax.tree.map(one, tree, specs, is_leaf=_is_spec)


def reduce_mean(tree, specs):
    """The mean over `data` of every data shard's gradients, laid out as `specs` say: pmean, or
    reduce-scatter of the sum, then / N, on the dimension a spec splits over `data`."""
    n = jax.lax.axis_size(AXIS)

    def one(g, spec):
        d = _data_dim(spec)
        if d is None:
            return jax.lax.pmean(g, AXIS)
        return jax.lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True) / n

    return jax.tree.map(one, tree, specs, is_leaf=_is_spec)


def input_specs(inputs: StepInputs, tokens_spec: P, error_specs) -> StepInputs:
    """The shard_map specs of a step's inputs: the tokens as given, the loss scale replicated, the
    residuals as laid out (absent fields stay None)."""
    return StepInputs(tokens_spec, None if inputs.loss_scale is None else P(),
                      None if inputs.grad_error is None else error_specs)


def data_parallel(metrics_and_grads, mesh, param_specs, grad_specs, batch_spec: P, compressor=None,
                  error_specs=None):
    """A gradient function (meshtrain/parallel/batching.py) with `metrics_and_grads` run per data
    shard on its rows (the loss scale replicated), its metrics averaged and its gradients reduced
    over `data` once. With a `compressor` (compression.Int8Reduction) the reduction is int8 with
    error feedback: the inputs' `grad_error` (laid out as `error_specs`) in, the new residuals out."""
    manual = {AXIS}
    in_params, out_grads = local_specs(param_specs, manual), local_specs(grad_specs, manual)
    errors_local = local_specs(error_specs, manual) if compressor else None

    def per_shard(params, inputs: StepInputs) -> Gradients:
        with manual_axes_rules(manual):  # activations are constrained over the other axes only
            out = metrics_and_grads(gather(params, in_params), inputs)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), out.grads)  # reduced in fp32
            metrics = jax.lax.pmean(out.metrics, AXIS)
            if compressor is None:
                return Gradients(metrics, reduce_mean(grads, out_grads))
            return Gradients(metrics, *compressor.reduce_mean(grads, inputs.grad_error, manual, inputs.loss_scale))

    def fn(params, inputs: StepInputs) -> Gradients:
        in_specs = (in_params, input_specs(inputs, local_spec(batch_spec, manual), errors_local))
        return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs,
                             out_specs=Gradients(P(), out_grads, errors_local), axis_names=manual,
                             check_vma=False)(params, inputs)

    return fn
