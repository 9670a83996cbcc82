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

from meshtrain.models.lora import adapters_off, fold_key
from meshtrain.ops import remat as remat_lib
from meshtrain.ops.loss import sequence_log_probs
from meshtrain.ops.precision import cast_for_compute
from meshtrain.parallel.batching import model_inputs, split_microbatches
from meshtrain.parallel.sharding import constrain


def keeps_reference(model_spec) -> bool:
    """Whether the state holds a copy of the initial parameters as the reference: not under LoRA
    (model.lora), whose reference is the frozen base itself."""
    return not model_spec.lora.rank


def reference_params(state, model_spec):
    """The weights the reference log-probs come from: the initial parameters kept in the state, or
    under LoRA the base, the parameters with the adapters off (`adapters_off`: no second copy)."""
    return state["reference"] if keeps_reference(model_spec) else adapters_off(state["params"])


def sequences(pairs_BxP):
    """[B, 2 (L + 1)] pairs -> [2B, L + 1] sequences: chosen 0, rejected 0, chosen 1, ..."""
    B, P = pairs_BxP.shape
    return constrain(pairs_BxP.reshape(2 * B, P // 2), ("batch", None))


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
    order of `sequences`: the pair's key folded with 0 (chosen) and 1 (rejected)."""
    return jax.vmap(lambda k: jnp.stack([fold_key(k, 0), fold_key(k, 1)]))(keys_Bx2).reshape(-1, 2)


def make_log_probs(model, precision: str, remat: str = "none"):
    """(params, pairs [B, 2 (L + 1)]) -> ([B, 2] summed response log-probs, chosen then rejected;
    the blocks' statistics as means over layers). Untrained targets (the prompt, the padding: ~id,
    meshtrain/data/tokens.py) add nothing. `dropout_keys` (the policy's in training): the pairs'
    LoRA dropout keys."""
    layer = remat_lib.apply(model.block, remat, model.saveable)

    def log_probs(params, pairs_BxP, dropout_keys=None):
        compute = cast_for_compute(params, precision)
        inputs, targets, docs = model_inputs(model, sequences(pairs_BxP), loss_mask=True)
        keys = None if dropout_keys is None else constrain(sequence_keys(dropout_keys), ("batch", None))
        x_NxLxD, stats = model.trunk(compute, inputs, docs, layer, keys)
        return pair_log_probs(model, compute, x_NxLxD, targets), stats

    return log_probs


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


def make_dpo_loss_fn(model, precision: str, remat: str, beta: float, label_smoothing: float):
    """(params, pairs [B, 2 (L + 1)], reference log-probs [B, 2]) -> (objective, metrics): the DPO
    loss plus the model's auxiliary losses (the MoE router's), as `step.make_loss_fn` gives them;
    the policy under LoRA dropout when given `dropout_keys` (the reference never)."""
    log_probs = make_log_probs(model, precision, remat)

    def loss_fn(params, pairs_BxP, reference_Bx2, dropout_keys=None):
        policy_Bx2, stats = log_probs(params, pairs_BxP, dropout_keys)
        loss, metrics = dpo_loss(policy_Bx2, reference_Bx2, beta, label_smoothing)
        return loss + model.auxiliary_loss(stats), {**metrics, **stats}

    return loss_fn


def make_reference_log_probs(model, precision: str, microbatches: int):
    """(reference params, pairs [B, 2 (L + 1)]) -> [B, 2], without gradient, a microbatch at a time
    (rows as `split_microbatches` cuts them), so it holds no more activations than the train step.
    The evaluation (`make_dpo_eval`) runs the policy through it too."""
    log_probs = make_log_probs(model, precision)

    def reference(params, pairs_BxP):
        params = jax.lax.stop_gradient(params)
        if microbatches == 1:
            return log_probs(params, pairs_BxP)[0]
        one = lambda _, micro: (None, log_probs(params, constrain(micro, ("batch", None)))[0])
        out_MxbX2 = jax.lax.scan(one, None, split_microbatches(pairs_BxP, microbatches))[1]
        return out_MxbX2.swapaxes(0, 1).reshape(pairs_BxP.shape[0], 2)  # row j * M + m, as split

    return reference


def make_dpo_eval(model, precision: str, microbatches: int, beta: float, label_smoothing: float, log_probs=None):
    """(params, pairs [B, 2 (L + 1)], the reference's parameters if the state keeps a copy) -> the
    held-out pairs' DPO loss, reward_accuracy and reward_margin (`dpo_loss`), forward only, a
    microbatch at a time for the policy and the reference alike: `log_probs` ((params, pairs) ->
    [B, 2]; on a pipeline meshtrain/engine/pipeline.py `make_pipeline_log_probs`), by default
    `make_reference_log_probs`."""
    log_probs = log_probs or make_reference_log_probs(model, precision, microbatches)

    def evaluate(params, pairs_BxP, *reference):
        ref = reference[0] if reference else adapters_off(params)
        compute = lambda p: cast_for_compute(p, precision)
        _, metrics = dpo_loss(log_probs(compute(params), pairs_BxP), log_probs(compute(ref), pairs_BxP), beta,
                              label_smoothing)
        return {k: metrics[k] for k in ("loss", "reward_accuracy", "reward_margin")}

    return evaluate
