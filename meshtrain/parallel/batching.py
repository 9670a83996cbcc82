"""How a step's batch is cut: into microbatches (gradient accumulation, pipeline microbatches) and
into the model's inputs and targets in the plan's sequence layout.

Every executor (meshtrain/engine/step.py, meshtrain/parallel/data_parallel.py, meshtrain/engine/pipeline.py) is a
gradient function `(params, StepInputs) -> Gradients`: `metrics` a dict of fp32 scalars, the
cross-entropy `loss` first, then the model's block statistics (e.g. the MoE router's), each a mean
over the step's tokens; `grads` the gradients of the training objective (loss + the model's
auxiliary losses), a mean over the step's microbatches.
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
    """What a gradient function takes besides the parameters. A field that does not apply is None
    (an empty pytree: nothing is traced or sent for it)."""
    tokens: Any  # [B, L+1] token ids: inputs and (shifted by one) targets
    loss_scale: Any = None  # fp16: the objective is multiplied by it (meshtrain/ops/precision.py)
    grad_error: Any = None  # int8 compression: the residuals carried in (meshtrain/parallel/compression.py)
    reference: Any = None  # DPO: [B, 2] the reference model's log-probs of each row (meshtrain/engine/dpo.py)
    # a loss mask: the step batch's trained share (meshtrain/engine/step.py `trained_share`), by which the
    # auxiliary losses are weighted, so that the step's division by it leaves them means over all tokens
    trained_share: Any = None
    # multi-token prediction: [D] each depth's trained share of the step batch (models/deepseek_v3.py mtp_shares)
    mtp_shares: Any = None
    # LoRA dropout: [B, 2] each row's key (models/lora.py `row_keys`), which travels with its row
    dropout_keys: Any = None

    def with_tokens(self, tokens, reference=None, dropout_keys=None) -> StepInputs:
        """These rows' tokens (and their reference log-probs and dropout keys): a microbatch's."""
        return dataclasses.replace(self, tokens=tokens, reference=reference, dropout_keys=dropout_keys)


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


def split_microbatches(tokens_BxL1, num_micro: int):
    """[B, L+1] -> [M, B/M, L+1] with microbatch m = rows i*M + m, so that every microbatch spans
    all data-parallel shards (a contiguous split would leave most devices idle)."""
    B = tokens_BxL1.shape[0]
    return tokens_BxL1.reshape(B // num_micro, num_micro, -1).swapaxes(0, 1)


def accumulate(grad_fn, microbatches: int, accumulator_specs):
    """A gradient function over `microbatches` slices of the batch: its metrics and gradients are the
    means of `grad_fn`'s over the slices, summed in a scan. The accumulator is pinned to
    `accumulator_specs` (PartitionSpecs over the axes that are not manual here), so the sum is kept
    sharded and never reduced inside the loop."""
    if microbatches == 1:
        return grad_fn
    pin = lambda tree: jax.tree.map(jax.lax.with_sharding_constraint, tree, accumulator_specs)

    def metrics_and_grads(params, inputs: StepInputs) -> Gradients:
        rows = lambda x: None if x is None else constrain(x, ("batch", None))
        micro_inputs = lambda tokens, reference=None, keys=None: inputs.with_tokens(rows(tokens), rows(reference),
                                                                                   rows(keys))

        def add(carry, micro_rows):
            metric_sums, grad_sums = carry
            out = grad_fn(params, micro_inputs(*micro_rows))
            grad_sums = pin(jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sums, out.grads))
            return (jax.tree.map(jnp.add, metric_sums, out.metrics), grad_sums), None

        split = lambda x: None if x is None else split_microbatches(x, microbatches)
        micro_rows = (split(inputs.tokens), split(inputs.reference), split(inputs.dropout_keys))  # the same rows
        like = jax.eval_shape(grad_fn, params, micro_inputs(*jax.tree.map(lambda x: x[0], micro_rows)))
        zeros = (jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), like.metrics),  # grads: the trained params'
                 pin(jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), like.grads)))  # fp32 sums
        (metrics, grads), _ = jax.lax.scan(add, zeros, micro_rows)
        mean = lambda tree: jax.tree.map(lambda x: x / microbatches, tree)
        return Gradients(mean(metrics), mean(grads))

    return metrics_and_grads
