"""Direct preference optimisation (issue 43, section 3; Rafailov et al. 2023, label smoothing as in
cDPO): a batch is [B, 2 (L + 1)] rows, one pair each, chosen then rejected (meshtrain/data/
preference.py). With π and ref the policy's and the reference model's summed response log-probs,

    m = (π_c - ref_c) - (π_r - ref_r),   loss = -(1 - ls) log σ(β m) - ls log σ(-β m),

averaged over the pairs. Every microbatch and data shard holds the same number of pairs, so the
mean of their means (what every executor forms) is the mean over the whole batch: exact on every
layout. The reference model is a frozen copy of the initial parameters, `state['reference']`
(`reference_params`, the one place that says which weights it is), run forward once per batch
before the gradient pass: no gradient, no optimizer state, one more copy of the parameters in
memory (the compiled step's, so the planner's memory figure, holds it). Under LoRA the reference
is the frozen base, the parameters with the adapters off: no copy."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.data import preference
from meshtrain.models.lora import adapters_off, fold_key
from meshtrain.objectives.base import Microbatch, Objective
from meshtrain.ops.loss import sequence_log_probs
from meshtrain.ops.precision import cast_for_compute
from meshtrain.parallel.batching import split_microbatches


def keeps_reference(model_spec) -> bool:
    """Whether the state holds a copy of the initial parameters as the reference: not under LoRA
    (model.lora), whose reference is the frozen base itself."""
    return not model_spec.lora.rank


def reference_params(state, model_spec):
    """The weights the reference log-probs come from: the initial parameters kept in the state, or
    under LoRA the base, the parameters with the adapters off (`adapters_off`: no second copy)."""
    return state["reference"] if keeps_reference(model_spec) else adapters_off(state["params"])


def pipeline_sequences(pairs_BxP, micro: int):
    """[B, 2 (L + 1)] pairs -> [2B, L + 1] sequences ordered so that `split_microbatches(., micro)`
    gives microbatch m the sequences of the pairs `split_microbatches(pairs, micro)[m]` (rows
    j * M + m), each pair's chosen then rejected: a pipeline microbatch holds whole pairs, so the
    DPO loss of a microbatch is defined on the last stage alone."""
    B, P = pairs_BxP.shape
    seqs_MxNxL1 = split_microbatches(pairs_BxP, micro).reshape(micro, 2 * B // micro, P // 2)
    return seqs_MxNxL1.swapaxes(0, 1).reshape(2 * B, P // 2)


def pair_log_probs(model, params, x_NxLxD, targets_NxL):
    """[N/2, 2]: the head's summed log-probs of the trained targets of N sequences, pair by pair
    (chosen, rejected), from the last hidden state (before the final norm)."""
    logp_N = sequence_log_probs(model.final_norm(params, x_NxLxD), model.unembedding(params), targets_NxL)
    return logp_N.reshape(-1, 2)


def sequence_keys(keys_Bx2):
    """Each pair's LoRA dropout key (models/lora.py `row_keys`) -> its sequences' [2B, 2], in the
    order of `pipeline_sequences`: the pair's key folded with 0 (chosen) and 1 (rejected)."""
    return jax.vmap(lambda k: jnp.stack([fold_key(k, 0), fold_key(k, 1)]))(keys_Bx2).reshape(-1, 2)


def dpo_loss(policy_Bx2, reference_Bx2, beta: float, label_smoothing: float):
    """(the mean loss over the pairs, its metrics). -log σ(x) = softplus(-x)."""
    rewards_Bx2 = beta * (policy_Bx2 - reference_Bx2)
    margin_B = rewards_Bx2[:, 0] - rewards_Bx2[:, 1]  # β m
    losses_B = (1 - label_smoothing) * jax.nn.softplus(-margin_B) + label_smoothing * jax.nn.softplus(margin_B)
    loss = jnp.mean(losses_B)
    return loss, {"loss": loss, "reward_margin": jnp.mean(margin_B),
                  "reward_accuracy": jnp.mean(margin_B > 0, dtype=jnp.float32),
                  "logp_chosen": jnp.mean(policy_Bx2[:, 0]), "logp_rejected": jnp.mean(policy_Bx2[:, 1]),
                  "reward_chosen": jnp.mean(rewards_Bx2[:, 0]), "reward_rejected": jnp.mean(rewards_Bx2[:, 1])}


class DPO(Objective):
    """train.objective=dpo, its settings train.dpo (beta, label_smoothing). Its rows: the pairs
    ('tokens' [B, 2 (L + 1)]) and their 'reference' log-probs [B, 2], scored before the gradient
    pass by the executor's forward-only pass (`scores`); on a pipeline each microbatch holds whole
    pairs (`sequences`), so its loss is the last stage's alone (`head`)."""
    name = "dpo"
    sequences_per_row = 2
    scores_first = True
    masked = True  # the responses are the trained targets
    reads = ("preference",)
    scores_reference = True

    def __init__(self, model, plan, train, loss_mask: bool = False, rl=None, vocab: int | None = None):
        super().__init__(model, plan, train)
        self.beta, self.label_smoothing = train.dpo.beta, train.dpo.label_smoothing

    def initial_state(self, params) -> dict:
        return {"reference": params} if keeps_reference(self.model.cfg) else {}

    def step_inputs(self, state, pairs, score):
        # cast before the forward's gathers, as the policy's parameters are
        reference = score(cast_for_compute(reference_params(state, self.model.cfg), self.precision), {"tokens": pairs})
        return {"tokens": pairs, "reference": reference, **self.noise_rows(state, pairs)}, {}

    def pair_loss(self, policy_Bx2, reference_Bx2):
        return dpo_loss(policy_Bx2, reference_Bx2, self.beta, self.label_smoothing)

    def sequences(self, rows, micro):
        pairs = rows["tokens"]
        out = {"tokens": pipeline_sequences(pairs, micro)}
        if "noise" in rows:  # [B, 2 sequences x 2] is laid out as the pairs [B, 2 (L + 1)] are
            out["noise"] = pipeline_sequences(sequence_keys(rows["noise"]).reshape(pairs.shape[0], -1), micro)
        return out

    def extras(self, rows):
        return rows.get("reference")  # none in the forward-only pass that scores it

    def head(self, shared):
        return lambda p_outer, y, micro: self.pair_loss(self.score_head(p_outer, y, micro), micro.extras)

    def score_head(self, p_outer, y, micro: Microbatch):
        return pair_log_probs(self.model, p_outer, y, micro.targets)

    def evaluation(self, score, microbatches: int, model_order):
        """(params, pairs, the reference's parameters if the state keeps a copy) -> the held-out
        pairs' DPO loss, reward_accuracy and reward_margin (`dpo_loss`), forward only, a microbatch
        at a time for the policy and the reference alike (`score`)."""
        def evaluate(params, pairs_BxP, *reference):
            ref = reference[0] if reference else adapters_off(params)
            log_probs = lambda p: score(cast_for_compute(p, self.precision), {"tokens": pairs_BxP})
            _, metrics = self.pair_loss(log_probs(params), log_probs(ref))
            return {k: metrics[k] for k in ("loss", "reward_accuracy", "reward_margin")}

        return evaluate

    @staticmethod
    def batches(mix, data, train, sharding, vocab_size: int):
        """(training pair batches, {"": the held-out pairs' batches}) of data.path's preference pairs."""
        return preference.batches(mix.tokens[0], preference.read_pairs(data.path), data.val_fraction,
                                  train.batch_size, train.seq_len, train.seed, sharding, vocab_size)

    @staticmethod
    def validation(eval_step, params, val_sets: dict, eval_inputs: tuple, sources, batches: int) -> dict:
        """The mean over `batches` batches of the held-out pairs (each batch holds as many pairs, so
        the mean of the batches' means is the mean over all their pairs) of the DPO loss (eval_loss),
        the reward accuracy and the reward margin; {} without held-out pairs."""
        if not val_sets:
            return {}
        val = val_sets[""]
        per_batch = [eval_step(params, val(i), *eval_inputs) for i in range(batches)]
        mean = lambda k: float(jnp.mean(jnp.stack([m[k] for m in per_batch])))
        return {"eval_loss": mean("loss"), "eval_reward_accuracy": mean("reward_accuracy"),
                "eval_reward_margin": mean("reward_margin")}
