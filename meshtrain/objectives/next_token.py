"""`sft` (the default): next-token cross-entropy, with chat data's loss mask and multi-token
prediction. The batch is [B, L + 1] tokens; the loss is the mean over the B x L targets plus the
model's auxiliary losses (the MoE router's).

Under a loss mask (data.train_on=assistant, meshtrain/data/tokens.py `with_mask`) an untrained
target adds nothing and every executor still divides by all B x L positions: the step divides the
loss and its gradients by the batch's trained share (`trained_share`, a shared value), so they are
the mean over the trained tokens on every layout, while the auxiliary losses, weighted by that share
(`aux_weight`), stay means over all tokens. With multi-token prediction (model.mtp_depth D > 0,
models/deepseek_v3.py) the objective adds mtp_loss_weight x the mean of the D depths' losses
(DeepSeek-V3 eq. 25), weighted as the auxiliary losses are, each depth normalised by its trained
share of the whole step batch (`mtp_shares`, shared), and reports 'mtp_loss'.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from meshtrain.data import mixture
from meshtrain.objectives.base import Microbatch, Objective, head_loss
from meshtrain.ops import offload
from meshtrain.ops import remat as remat_lib
from meshtrain.ops.precision import cast_for_compute
from meshtrain.parallel.batching import batch_rows, model_inputs, split_microbatches


def make_loss_fn(model, precision: str, remat: str = "none", loss_mask: bool = False, fetch: bool = False):
    """(params, tokens [B, L+1]) -> (objective, metrics): the mean cross-entropy plus the model's
    auxiliary losses, and the metrics ('loss', then the blocks' statistics as means over layers).
    The blocks run under the plan's remat policy. `loss_mask`: the tokens carry a loss mask; the loss
    is still divided by all B x L positions. `aux_weight` multiplies the auxiliary losses and the MTP
    term; `mtp_shares` ([D], `mtp_shares`; None in evaluation): the objective adds the multi-token
    prediction loss and the metric 'mtp_loss'; `dropout_keys` ([B, 2], models/lora.py `row_keys`):
    LoRA dropout is on. `fetch`: the stacked layers' parameters may be in host memory
    (parallel.offload=optimizer+params: meshtrain/ops/offload.py `fetching`)."""
    block = offload.fetching(model.block, lambda p: cast_for_compute(p, precision)) if fetch else model.block
    layer = remat_lib.apply(block, remat, model.saveable)

    def loss_fn(params, tokens_BxL1, aux_weight=1.0, mtp_shares=None, dropout_keys=None):
        head = lambda p, x_BxLxD, micro: token_loss(model, p, x_BxLxD, micro, aux_weight, mtp_shares)
        return head_loss(model, layer, precision, params, tokens_BxL1, head, loss_mask, dropout_keys,
                         aux_weight=aux_weight)

    return loss_fn


def token_loss(model, params, x_BxLxD, micro: Microbatch, aux_weight=1.0, mtp_shares=None):
    """(the cross-entropy of the final hidden state, plus the MTP term; its metrics): the head of
    the flat loss and of a pipeline's last stage alike."""
    loss = model.loss(params, x_BxLxD, micro.targets)
    if mtp_shares is None:
        return loss, {"loss": loss}
    mtp = jnp.mean(model.mtp_losses(params, x_BxLxD, micro.inputs, micro.targets, micro.docs, mtp_shares))
    return loss + aux_weight * model.cfg.mtp_loss_weight * mtp, {"loss": loss, "mtp_loss": mtp}


def mtp_shares(model, tokens_BxL1, loss_mask: bool = False):
    """[D]: each multi-token prediction depth's trained share of the step batch (None without MTP)."""
    if not model.mtp_depth:
        return None
    _, targets, docs = model_inputs(model, tokens_BxL1, loss_mask)
    return model.mtp_shares(targets, docs)


def trained_share(tokens_BxL1):
    """The fraction of the batch's B x L targets that are trained (>= 0), at least one token's: the
    executors average the masked loss over all positions, so loss / share is the sum of the trained
    tokens' losses over their number, for the whole batch and every layout."""
    trained_BxL = tokens_BxL1[:, 1:] >= 0
    return jnp.maximum(jnp.mean(trained_BxL, dtype=jnp.float32), 1.0 / trained_BxL.size)


def trained_tokens(tokens_BxL1):
    """How many of the batch's targets are trained (>= 0), in fp32."""
    return jnp.sum(tokens_BxL1[:, 1:] >= 0, dtype=jnp.float32)


class NextToken(Objective):
    name = "sft"

    def __init__(self, model, plan, train, loss_mask: bool = False, rl=None, vocab: int | None = None):
        super().__init__(model, plan, train)
        self.masked = loss_mask

    def step_inputs(self, state, tokens, score):
        shared = {"trained_share": trained_share(tokens)} if self.masked else {}
        if self.model.mtp_depth:
            shared["mtp_shares"] = mtp_shares(self.model, tokens, self.masked)
        return {"tokens": tokens, **self.noise_rows(state, tokens)}, shared

    def head(self, shared):
        weight = shared.get("trained_share", 1.0)
        return lambda p_outer, y, micro: token_loss(self.model, p_outer, y, micro, weight, shared.get("mtp_shares"))

    def aux_weight(self, shared):
        return shared.get("trained_share")

    def finish(self, metrics, rows, shared):
        if not self.masked:
            return metrics, None
        # the mean over trained tokens (the model's statistics and auxiliary losses stay means over all tokens)
        share = shared["trained_share"]
        return {**metrics, "loss": metrics["loss"] / share, "trained_tokens": trained_tokens(rows["tokens"])}, share

    def evaluation(self, score, microbatches: int, model_order):
        """(params, tokens) -> (the mean loss, its weight): the weight is 1, or with a loss mask the
        batch's trained tokens, so an eval set's mean is sum(loss x weight) / sum(weight)
        (`validation`). The batch is cut into the train step's microbatches (equal sizes: the mean of
        the means is the batch's mean)."""
        eval_loss = make_loss_fn(self.model, self.precision, loss_mask=self.masked, fetch=self.fetches)

        def all_positions(params, tokens_BxL1):
            if microbatches == 1:
                return eval_loss(params, tokens_BxL1)[1]["loss"]
            add = lambda total, tokens: (total + eval_loss(params, batch_rows(tokens))[1]["loss"], None)
            return jax.lax.scan(add, jnp.zeros((), jnp.float32),
                                split_microbatches(tokens_BxL1, microbatches))[0] / microbatches

        def mean_loss(params, tokens_BxL1):
            loss = all_positions(model_order(params), tokens_BxL1)
            if not self.masked:
                return loss, jnp.ones((), jnp.float32)
            return loss / trained_share(tokens_BxL1), trained_tokens(tokens_BxL1)

        return mean_loss

    @staticmethod
    def batches(mix, data, train, sharding, vocab_size: int):
        """(training batches, {source name: validation batches}) of the data mixture."""
        return mixture.batches(mix, data.val_fraction, train.batch_size, train.seq_len, train.seed, sharding,
                               vocab_size)

    @staticmethod
    def validation(eval_step, params, val_sets: dict, eval_inputs: tuple, sources, batches: int) -> dict:
        """The evaluation record for `params` (the eval step's layout): each validation set's mean
        loss over `batches` batches (with a loss mask, over all their trained tokens: the batches'
        means weighted by their trained tokens); with several sources, eval_loss is their mean
        weighted by the sources' shares and each adds its eval_loss_<name>. Call it under the
        program's context."""
        def mean(val):
            loss_N, weight_N = (jnp.stack(x) for x in zip(*(eval_step(params, val(i)) for i in range(batches))))
            return float(jnp.sum(loss_N * weight_N) / jnp.maximum(jnp.sum(weight_N), 1.0))  # no trained token: 0

        losses = {name: mean(val) for name, val in val_sets.items()}
        if len(losses) < 2:
            return {"eval_loss": next(iter(losses.values()))} if losses else {}
        record = {"eval_loss": math.fsum(s.share * losses[s.name] for s in sources)}
        return record | {f"eval_loss_{name}": loss for name, loss in losses.items()}
