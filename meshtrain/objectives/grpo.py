"""Group relative policy optimisation (GRPO, Shao et al. 2024) and its variants, issue 60: the
arithmetic of its loss. A rollout draws G completions of each prompt; their rewards r become
advantages within the group,

    A_i = (r_i - mean(r)) / (std(r) + eps)        (rl.scale_rewards: true; GRPO)
    A_i =  r_i - mean(r)                          (false; Dr. GRPO, Liu et al. 2025)

(std with Bessel's correction, eps 1e-4, as TRL). Each completion token t with policy log-prob
logp_t, the rollout policy's old_t and the reference's ref_t costs

    ρ_t = exp(logp_t - old_t)
    loss_t = -min(ρ_t A, clip(ρ_t, 1 - ε_low, 1 + ε_high) A) + β (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

(PPO's clipped surrogate, DAPO's asymmetric ε_high, Yu et al. 2025; the KL term is Schulman's k3
estimator, β = rl.kl_coef), and the loss is the mean over every completion token of the batch
(token-level aggregation, DAPO): each executor averages over all positions, untrained ones adding 0,
and the step divides by the trained share, as sft's loss mask does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.data import prompts
from meshtrain.objectives.base import Microbatch, Objective
from meshtrain.objectives.dpo import keeps_reference, reference_params
from meshtrain.objectives.next_token import trained_share, trained_tokens
from meshtrain.ops.loss import position_log_probs
from meshtrain.ops.precision import cast_for_compute

ADVANTAGE_EPS = 1e-4


def group_advantages(rewards_PxG: np.ndarray, scale: bool = True, eps: float = ADVANTAGE_EPS) -> np.ndarray:
    """[P, G] advantages of G completions of each of P prompts (the module's formula)."""
    rewards_PxG = np.asarray(rewards_PxG, np.float64)
    centered = rewards_PxG - rewards_PxG.mean(axis=1, keepdims=True)
    if not scale:
        return centered
    return centered / (rewards_PxG.std(axis=1, ddof=1, keepdims=True) + eps)


def token_losses(logp_BxL, old_BxL, adv_B, trained_BxL, clip_low: float, clip_high: float, kl_coef: float = 0.0,
                 ref_BxL=None) -> dict:
    """Per position [B, L], 0 where untrained: 'loss' (the module's loss_t), 'clipped' (1 where the
    clip decides the surrogate, so the token's gradient is 0), 'kl' (k3, 0 without a reference)."""
    ratio = jnp.exp(logp_BxL - old_BxL)
    adv = adv_B[:, None]
    unclipped, clipped = ratio * adv, jnp.clip(ratio, 1 - clip_low, 1 + clip_high) * adv
    loss = -jnp.minimum(unclipped, clipped)
    kl = jnp.zeros_like(loss)
    if ref_BxL is not None:
        delta = ref_BxL - logp_BxL
        kl = jnp.exp(delta) - delta - 1
        loss = loss + kl_coef * kl
    zero = lambda x: jnp.where(trained_BxL, x, 0.0)
    return {"loss": zero(loss), "clipped": zero((clipped < unclipped).astype(jnp.float32)), "kl": zero(kl)}


def longest_prompt(seq_len: int, rl) -> int:
    """The tokens a prompt may hold: a sequence is the prompt then the completion, seq_len + 1 tokens."""
    return seq_len + 1 - rl.max_new_tokens


def prompts_per_batch(batch_size: int, rl) -> int:
    """A batch's prompts: train.batch_size completions, rl.group_size a prompt."""
    return batch_size // rl.group_size


def batch_struct(rows: int, seq_len: int) -> dict:
    """A rollout batch as the step takes it (meshtrain/engine/rollout.py builds it): 'tokens' [N, L + 1]
    (prompt then completion, the completion's tokens trained: data/tokens.py `with_mask`; padding ~0),
    'sampler_logp' [N, L] (the sampler's log-prob of each trained target, 0 elsewhere) and
    'advantages' [N]."""
    return {"tokens": jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32),
            "sampler_logp": jax.ShapeDtypeStruct((rows, seq_len), jnp.float32),
            "advantages": jax.ShapeDtypeStruct((rows,), jnp.float32)}


class GRPO(Objective):
    """train.objective=grpo, its settings the rl section. A step's batch is a rollout (`batch_struct`),
    sampled from the step's parameters by the trainer (meshtrain/engine/rollout.py `Rollouts`). Before
    the gradient pass the step scores the rollout forward-only (`scores`): the trainer's log-probs of
    the sampled tokens at the parameters that drew them, the ratio's denominator (so the first update's
    ratio is exactly 1) and, against the sampler's, the metric logp_diff_max; under rl.kl_coef > 0 also
    the reference's. With rl.updates_per_batch = U > 1 the state keeps the rollout and those log-probs
    ('rollout'), scored on the first of its U steps and reused by the others, so a resume mid-batch
    continues exactly; those others run a second compiled step without the scoring passes
    (`reuses_scores`: a conditional in one program would deadlock XLA:CPU's collectives)."""
    name = "grpo"
    scores_first = True
    masked = True  # the completions are the trained targets
    reads = ("prompts",)
    rolls_out = True

    def __init__(self, model, plan, train, loss_mask: bool = False, rl=None, vocab: int | None = None):
        super().__init__(model, plan, train, loss_mask, rl, vocab)
        self.clip_high = rl.clip_eps_high or rl.clip_eps
        self.rows, self.seq_len = train.batch_size, train.seq_len

    @property
    def scores_reference(self) -> bool:
        return self.rl.kl_coef > 0

    def forward_passes(self) -> int:
        return 1 + int(self.rl.kl_coef > 0)  # the policy's, and the reference's

    def batch_struct(self, shape) -> dict:
        return batch_struct(self.rows, self.seq_len)

    def keeps_rollout(self) -> bool:
        return self.rl.updates_per_batch > 1

    def reuses_scores(self) -> bool:
        return self.keeps_rollout()

    def scores_at(self, step: int) -> bool:
        return step % self.rl.updates_per_batch == 0  # a rollout's first update

    def initial_state(self, params) -> dict:
        state = {}
        if self.rl.kl_coef > 0 and keeps_reference(self.model.cfg):
            state["reference"] = params
        if self.keeps_rollout():
            state["rollout"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.rollout_struct())
        return state

    def rollout_struct(self) -> dict:
        """The state's 'rollout': the batch and its scored log-probs (`scored`)."""
        logp = jax.ShapeDtypeStruct((self.rows, self.seq_len), jnp.float32)
        return {**batch_struct(self.rows, self.seq_len), "old_logp": logp,
                **({"ref_logp": logp} if self.rl.kl_coef > 0 else {})}

    def row_state(self) -> tuple[str, ...]:
        return ("rollout",) if self.keeps_rollout() else ()

    def scored(self, state, tokens, score) -> dict:
        """{'old_logp': the policy's log-probs of the rollout's targets at these parameters, 'ref_logp':
        the reference's under rl.kl_coef > 0}, forward only."""
        of = lambda params: score(cast_for_compute(params, self.precision), {"tokens": tokens})
        out = {"old_logp": of(state["params"])}
        if self.rl.kl_coef > 0:
            out["ref_logp"] = of(reference_params(state, self.model.cfg))
        return out

    def step_inputs(self, state, batch, score):
        tokens = batch["tokens"]
        if score is None:  # a rollout's later update (`reuses_scores`): its first update's scores, kept
            logps = {k: state["rollout"][k] for k in ("old_logp", "ref_logp") if k in state["rollout"]}
        else:
            logps = self.scored(state, tokens, score)
        trained_BxL = tokens[:, 1:] >= 0
        diff = jnp.max(jnp.where(trained_BxL, jnp.abs(logps["old_logp"] - batch["sampler_logp"]), 0.0))
        rows = {"tokens": tokens, "advantages": batch["advantages"], **logps, **self.noise_rows(state, tokens)}
        return rows, {"trained_share": trained_share(tokens), "logp_diff_max": diff}

    def next_state(self, state, batch, rows) -> dict:
        if not self.keeps_rollout():
            return {}
        return {"rollout": {**batch, **{k: rows[k] for k in self.rollout_struct() if k not in batch}}}

    def extras(self, rows):
        return {k: rows[k] for k in ("advantages", "old_logp", "ref_logp") if k in rows}

    def policy_log_probs(self, p_outer, y, targets, entropy: bool = False):
        return position_log_probs(self.model.final_norm(p_outer, y), self.model.unembedding(p_outer), targets,
                                  self.rl.temperature, self.vocab, entropy)

    def score_head(self, p_outer, y, micro: Microbatch):
        return self.policy_log_probs(p_outer, y, micro.targets)

    def head(self, shared):
        def policy_loss(p_outer, y, micro: Microbatch):
            logp_BxL, entropy_BxL = self.policy_log_probs(p_outer, y, micro.targets, entropy=True)
            extras, trained_BxL = micro.extras, micro.targets >= 0
            terms = token_losses(logp_BxL, extras["old_logp"], extras["advantages"], trained_BxL, self.rl.clip_eps,
                                 self.clip_high, self.rl.kl_coef, extras.get("ref_logp"))
            mean = lambda x_BxL: jnp.mean(x_BxL)  # over all positions: `finish` divides by the trained share
            loss = mean(terms["loss"])
            return loss, {"loss": loss, "kl": mean(terms["kl"]), "clip_fraction": mean(terms["clipped"]),
                          "entropy": mean(jnp.where(trained_BxL, entropy_BxL, 0.0))}

        return policy_loss

    def aux_weight(self, shared):
        return shared["trained_share"]

    def finish(self, metrics, rows, shared):
        share = shared["trained_share"]
        per_token = {k: metrics[k] / share for k in ("loss", "kl", "clip_fraction", "entropy")}
        return {**metrics, **per_token, "trained_tokens": trained_tokens(rows["tokens"]),
                "logp_diff_max": shared["logp_diff_max"]}, share

    def batches(self, mix, data, train, sharding, vocab_size: int):
        """(the training prompt batches, train.batch_size / rl.group_size prompts each, {"": the held-out
        prompts} or {}): meshtrain/data/prompts.py."""
        return prompts.batches(data.path, data.val_fraction, prompts_per_batch(train.batch_size, self.rl),
                               train.seed, longest_prompt(train.seq_len, self.rl), vocab_size)
