"""How a step's batch is cut: into microbatches (gradient accumulation, pipeline microbatches) and
into the model's inputs and targets in the plan's sequence layout.

Every executor (meshtrain/engine/step.py, meshtrain/parallel/data_parallel.py, meshtrain/engine/pipeline.py) is a
gradient function `(params, StepInputs) -> Gradients`: `metrics` a dict of fp32 scalars, the
objective's (meshtrain/objectives/) `loss` first, then the model's block statistics (e.g. the MoE
router's), each a mean over the step's microbatches; `grads` the gradients of the training objective
(its loss + the model's auxiliary losses), a mean over the step's microbatches.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.data.tokens import token_ids
from meshtrain.parallel.sharding import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a gradient function takes besides the parameters: the objective's (meshtrain/objectives/
    base.py) rows and shared values, and what the executor owns. A field that does not apply is
    None (an empty pytree: nothing is traced or sent for it)."""
    rows: Any  # a pytree of [B, ...] arrays, split with the batch (the tokens [B, L+1] among them)
    shared: Any = None  # a pytree of step constants, replicated
    loss_scale: Any = None  # fp16: the objective is multiplied by it (meshtrain/ops/precision.py)
    grad_error: Any = None  # int8 compression: the residuals carried in (meshtrain/parallel/compression.py)

    def with_rows(self, rows) -> StepInputs:
        """These rows instead: a microbatch's, or a data shard's."""
        return dataclasses.replace(self, rows=rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gradients:
    """What a gradient function returns: the step's metrics, the gradients of its objective (times
    the loss scale under fp16) and, under int8 compression, the new residuals."""
    metrics: Any
    grads: Any
    grad_error: Any = None


def inputs_and_targets(tokens_BxL1, sequence_order=None):
    """tokens [B, L+1] -> (inputs [B, L], targets [B, L]), the sequence stored in `sequence_order`
    (context parallelism keeps each device's early and late chunk together). The loss is a mean
    over positions, so the order changes nothing but the layout."""
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    if sequence_order is not None:
        inputs, targets = inputs[:, sequence_order], targets[:, sequence_order]
    return constrain(inputs, ("batch", "seq")), constrain(targets, ("batch", "seq"))



def model_inputs(model, tokens_BxL1, loss_mask: bool = False):
    """tokens [B, L+1] -> the model's inputs (ids), targets (< 0 where a loss mask leaves them
    untrained) and packed documents (meshtrain/ops/packing.py, or None), in its sequence order."""
    inputs, targets = inputs_and_targets(tokens_BxL1, model.sequence_order)
    if loss_mask:
        inputs, tokens_BxL1 = token_ids(inputs), token_ids(tokens_BxL1)
    return inputs, targets, model.documents(tokens_BxL1)


def batch_rows(x):
    """`x` ([B, ...]) constrained as a batch's rows are laid out: split on the batch only."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def placed_rows(rows_Bx_, sharding):
    """A host array every process holds whole, placed on `sharding`: each device takes its slice."""
    return jax.make_array_from_callback(rows_Bx_.shape, sharding, lambda index: rows_Bx_[index])


def split_microbatches(rows_Bx_, num_micro: int):
    """[B, ...] -> [M, B/M, ...] with microbatch m = rows i*M + m, so that every microbatch spans
    all data-parallel shards (a contiguous split would leave most devices idle)."""
    B = rows_Bx_.shape[0]
    return rows_Bx_.reshape(B // num_micro, num_micro, *rows_Bx_.shape[1:]).swapaxes(0, 1)


def accumulate(grad_fn, microbatches: int, accumulator_specs, prepare=None):
    """A gradient function over `microbatches` slices of the batch: its metrics and gradients are the
    means of `grad_fn`'s over the slices, summed in a scan. The accumulator is pinned to
    `accumulator_specs` (PartitionSpecs over the axes that are not manual here), so the sum is kept
    sharded and never reduced inside the loop. `prepare` (parameters -> parameters, e.g. gathered once:
    meshtrain/engine/step.py) runs once, before the loop; the gradients are of what it returns."""
    if microbatches == 1:
        return grad_fn if prepare is None else lambda params, inputs: grad_fn(prepare(params), inputs)
    pin = lambda tree: jax.tree.map(jax.lax.with_sharding_constraint, tree, accumulator_specs)

    def metrics_and_grads(params, inputs: StepInputs) -> Gradients:
        params = params if prepare is None else prepare(params)
        micro_inputs = lambda rows: inputs.with_rows(jax.tree.map(batch_rows, rows))

        def add(carry, micro_rows):
            metric_sums, grad_sums = carry
            out = grad_fn(params, micro_inputs(micro_rows))
            grad_sums = pin(jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sums, out.grads))
            return (jax.tree.map(jnp.add, metric_sums, out.metrics), grad_sums), None

        micro_rows = jax.tree.map(lambda x: split_microbatches(x, microbatches), inputs.rows)
        like = jax.eval_shape(grad_fn, params, micro_inputs(jax.tree.map(lambda x: x[0], micro_rows)))
        zeros = (jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), like.metrics),  # grads: the trained params'
                 pin(jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), like.grads)))  # fp32 sums
        (metrics, grads), _ = jax.lax.scan(add, zeros, micro_rows)
        mean = lambda tree: jax.tree.map(lambda x: x / microbatches, tree)
        return Gradients(mean(metrics), mean(grads))

    return metrics_and_grads


def stage_rows(model, objective, rows, micro: int) -> dict:
    """The rows the stages read, each [M, b, ...]: the model's 'inputs', 'targets', packed 'docs'
    (or None) and the rows' random 'noise' (or None) of the objective's `sequences`, and its 'extras'
    (or None), all made outside the stages' conds (inside them a resharding collective would wait
    for the stages that skip the branch), in the plan's sequence order (meshtrain/engine/pipeline.py)."""
    seqs = objective.sequences(rows, micro)
    x, targets, docs = model_inputs(model, seqs["tokens"], objective.masked)  # the targets keep a loss mask
    split = lambda tree: jax.tree.map(lambda a: split_microbatches(a, micro), tree)
    return {"inputs": split(x), "targets": split(targets), "docs": split(docs), "noise": split(seqs.get("noise")),
            "extras": split(objective.extras(rows))}
