"""What a training objective is to the executors (meshtrain/engine/step.py, meshtrain/parallel/
data_parallel.py, meshtrain/engine/pipeline.py), which know no objective by name.

Before the gradient pass, `step_inputs` turns the step's batch into the objective's **rows** (a
pytree of [B, ...] arrays, every leaf split with the batch: into microbatches, over data shards,
into pipeline microbatches) and its **shared** values (a pytree of replicated step constants, e.g.
a loss mask's trained share of the whole batch). Then:
- the flat executors call `loss(params, rows, shared)` on each microbatch's rows;
- the pipeline feeds the stages `sequences(rows, micro)`, the token rows the model runs on, and its
  last stage calls `head(shared)` on each microbatch's final hidden state (`Microbatch`);
- `finish` turns the step's mean metrics into the reported ones, and names the divisor the
  gradients are unscaled by.
An objective that scores the batch forward-only first (DPO's reference) says `scores_first`,
and gets a `score` function from the executor: `score(params, rows)` -> per-row outputs, from
`scores(params, rows)` on one device's program or `score_head` on a pipeline's last stage.

LoRA dropout is a model input, not an objective's: `noise_rows` adds the rows' keys
(models/lora.py `dropout_rows`), which the trunk reads as `rows['noise']`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from meshtrain.models.lora import dropout_rows
from meshtrain.ops import offload
from meshtrain.ops import remat as remat_lib
from meshtrain.ops.precision import cast_for_compute
from meshtrain.parallel.batching import batch_rows, model_inputs, split_microbatches


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One pipeline microbatch as the last stage's head sees it: the model's inputs and targets
    [b, L], its packed documents (or None) and the objective's `extras` rows (or None)."""
    inputs: Any
    targets: Any
    docs: Any = None
    extras: Any = None


def run_trunk(model, layer, precision: str, params, tokens_NxL1, masked: bool = False, noise=None):
    """(the compute-dtype parameters, the final hidden state [N, L, D] before the final norm, the
    rows' `Microbatch` (inputs, targets, documents), the blocks' statistics as means over layers)
    of token rows [N, L + 1]: the flat executors' forward, through `layer` (the block under a remat
    policy). `masked`: the tokens carry a loss mask; `noise`: the rows' LoRA dropout keys."""
    compute = cast_for_compute(params, precision)
    inputs, targets, docs = model_inputs(model, tokens_NxL1, masked)
    x_NxLxD, stats = model.trunk(compute, inputs, docs, layer, noise)
    return compute, x_NxLxD, Microbatch(inputs, targets, docs), stats


def head_loss(model, layer, precision: str, params, tokens_NxL1, head, masked: bool = False, noise=None,
              extras=None, aux_weight=None):
    """(the objective, its metrics) of token rows on one device: `run_trunk`, then `head` (a pipeline
    last stage's: (parameters, final hidden state, `Microbatch` with `extras`) -> (loss, metrics)),
    plus the model's auxiliary losses x `aux_weight` (None: 1) and the blocks' statistics."""
    compute, x_NxLxD, micro, stats = run_trunk(model, layer, precision, params, tokens_NxL1, masked, noise)
    loss, metrics = head(compute, x_NxLxD, dataclasses.replace(micro, extras=extras))
    return loss + (1.0 if aux_weight is None else aux_weight) * model.auxiliary_loss(stats), {**metrics, **stats}


def forward_scores(score, microbatches: int):
    """`score` ((params, rows) -> per-row outputs [B, ...]) without gradient, a microbatch at a time
    (rows as `split_microbatches` cuts them, reassembled in their order), so it holds no more
    activations than the train step."""
    def scores(params, rows):
        params = jax.lax.stop_gradient(params)
        if microbatches == 1:
            return score(params, rows)
        one = lambda _, micro: (None, score(params, jax.tree.map(batch_rows, micro)))
        out_M = jax.lax.scan(one, None, jax.tree.map(lambda x: split_microbatches(x, microbatches), rows))[1]
        return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(-1, *o.shape[2:]), out_M)  # row j * M + m, as split

    return scores


class Objective:
    """The protocol, with the defaults of an objective that needs no extras, no forward pass first
    and no state of its own. `model`: the family's LanguageModel; `plan`: the ParallelPlan (its
    precision and remat); `train`: the TrainConfig (the objective's own settings); `loss_mask`:
    the batches carry chat data's loss mask (data.train_on)."""
    name: ClassVar[str]
    sequences_per_row: ClassVar[int] = 1  # the sequences a batch row holds (a preference pair: 2)
    scores_first: ClassVar[bool] = False  # `step_inputs` calls `score`: a forward-only pass first
    masked: bool = False  # the tokens carry a loss mask (meshtrain/data/tokens.py `with_mask`)
    reads: ClassVar[tuple[str, ...]] = ("synthetic", "plain", "chat")  # the data it trains on: tokens.DATA_KINDS
    rolls_out: ClassVar[bool] = False  # its batches are rollouts the trainer samples (meshtrain/engine/rollout.py)

    def __init__(self, model, plan, train, loss_mask: bool = False, rl=None, vocab: int | None = None):
        """`rl`: the config's rl section (reinforcement learning's settings); `vocab`: the data
        tokenizer's size, where the model's vocabulary is padded past it (None: unknown)."""
        self.model, self.precision, self.seed = model, plan.precision, train.seed
        self.rl, self.vocab = rl, vocab
        # the plan's remat policy; under offload=optimizer+params each layer's parameters fetched inside it
        self.fetches = plan.offload == "optimizer+params"
        block = offload.fetching(model.block, lambda p: cast_for_compute(p, plan.precision)) if self.fetches \
            else model.block
        self.layer = remat_lib.apply(block, plan.remat, model.saveable)

    scores_reference: ClassVar[bool] = False  # one of its forward-only passes is a frozen reference's

    def forward_passes(self) -> int:
        """The forward-only passes over the batch before the gradient pass (`score`): 1 where it
        `scores_first`."""
        return int(self.scores_first)

    def reuses_scores(self) -> bool:
        """Whether some steps take the scores the state keeps instead of scoring (GRPO's later updates
        of a rollout): the trainer compiles a second step without the forward-only passes, whose
        `step_inputs` gets `score` None, and runs it where `scores_at` says no."""
        return False

    def scores_at(self, step: int) -> bool:
        """Whether the step after `step` steps scores its batch (runs the forward-only passes)."""
        return True

    def initial_state(self, params) -> dict:
        """The state entries the objective keeps beside the parameters (laid out as they are, but for
        those `row_state` names)."""
        return {}

    def row_state(self) -> tuple[str, ...]:
        """The names of `initial_state`'s entries laid out as the batch's rows, not as the parameters."""
        return ()

    def next_state(self, state, batch, rows) -> dict:
        """The objective's state entries after the step (default: unchanged)."""
        return {}

    def batch_struct(self, shape):
        """The step's batch as abstract arrays: by default the token rows `shape` ([B, n (L + 1)])."""
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    def eval_inputs(self, state) -> tuple:
        """What the evaluation takes after (params, batch) from the train `state` (or its abstract form)."""
        return tuple(state[k] for k in self.initial_state(state["params"]))

    def noise_rows(self, state, batch) -> dict:
        """{'noise': the rows' LoRA dropout keys [B, 2]} under LoRA dropout, else {}."""
        return jax.tree.map(batch_rows, dropout_rows(self.model.cfg, self.seed, state["step"], batch.shape[0]))

    def step_inputs(self, state, batch, score) -> tuple[dict, dict]:
        """(rows, shared) of the step's `batch` (`score`: see the module docstring); by default the
        batch as token rows with their LoRA dropout keys, and no shared value."""
        return {"tokens": batch, **self.noise_rows(state, batch)}, {}

    def loss(self, params, rows: dict, shared: dict):
        """(the objective to differentiate, its metrics, 'loss' first) of one microbatch's rows: the
        pipeline's computation on one device. The trunk runs on `sequences(rows, 1)` under the plan's
        precision and remat policy, `head` on its final hidden state, and the model's auxiliary losses
        (x `aux_weight`) are added."""
        seqs = self.sequences(rows, 1)
        noise = seqs.get("noise")
        return head_loss(self.model, self.layer, self.precision, params, seqs["tokens"], self.head(shared),
                         self.masked, None if noise is None else batch_rows(noise), self.extras(rows),
                         self.aux_weight(shared))

    def sequences(self, rows: dict, micro: int) -> dict:
        """The pipeline's token rows: {'tokens': [N, L + 1], 'noise': [N, 2] under LoRA dropout},
        ordered so that `split_microbatches(., micro)` gives microbatch m the sequences of the rows
        `split_microbatches(rows, micro)[m]`."""
        return {k: rows[k] for k in ("tokens", "noise") if k in rows}

    def extras(self, rows: dict):
        """The rows the pipeline's head reads besides the tokens (`Microbatch.extras`), or None."""
        return None

    def head(self, shared: dict):
        """The last pipeline stage's (outer parameters, the final hidden state [b, L, D], a
        `Microbatch`) -> (its loss, its metrics): what `loss` adds on top of the trunk."""
        raise NotImplementedError

    def aux_weight(self, shared: dict):
        """The weight of the model's auxiliary losses in the objective (None: 1)."""
        return None

    def finish(self, metrics: dict, rows: dict, shared: dict):
        """(the step's reported metrics, the divisor the gradients are unscaled by or None) from the
        mean of the microbatches' metrics."""
        return metrics, None

    def score_head(self, p_outer, y, micro: Microbatch):
        """A forward-only pass's per-row outputs, from a pipeline's last stage (objectives that say
        `scores_first`): the microbatch's."""
        raise NotImplementedError

    def scores(self, params, rows: dict):
        """`score_head`'s per-row outputs of the rows on one device: the trunk on `sequences(rows, 1)`."""
        seqs = self.sequences(rows, 1)
        compute, x, micro, _ = run_trunk(self.model, self.layer, self.precision, params, seqs["tokens"], self.masked)
        return self.score_head(compute, x, micro)

    def evaluation(self, score, microbatches: int, model_order):
        """(params in storage order, held-out batch, *`eval_inputs`) -> (the metrics of the batch,
        replicated); `model_order` takes the parameters to model order (for the flat `loss`)."""
        raise NotImplementedError

    def batches(self, mix, data, train, sharding, vocab_size: int):
        """(the training batches, {name: validation batches}) of the run's data (`mix`: the loaded
        mixture; `data`, `train`: the config's sections)."""
        raise NotImplementedError

    def validation(self, eval_step, params, val_sets: dict, eval_inputs: tuple, sources, batches: int) -> dict:
        """The evaluation record (eval_loss first) of `batches` batches of each validation set."""
        raise NotImplementedError
