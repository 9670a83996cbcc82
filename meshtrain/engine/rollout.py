"""Rollouts for reinforcement learning (train.objective=grpo, meshtrain/objectives/grpo.py): the
trainer turns each step's prompts into the step's batch here, on the training mesh, from the
step's own parameters (no copy through the host, no second engine).

A rollout of P prompts samples rl.group_size = G completions of each with the KV-cache sampler
(meshtrain/engine/decode.py `sample_rows`: rl.temperature, rl.top_p, up to rl.max_new_tokens, a
completion ending at the tokenizer's EOS or the prompts' chat template's end-of-turn token
(`prompts.Prompts.end_of_turn`), which it keeps), in the plan's compute dtype; under
rl.sampler=exact without a KV cache, each token from the training forward over the whole sequence. Row
p * G + g is prompt p's g-th completion, drawn with the key of (train.seed, step), so any layout of
the same batch samples the same tokens (JAX's partitionable threefry: its bits do not depend on the
sharding). The completions are decoded and scored (rl.reward,
meshtrain/objectives/rewards.py), each group's rewards become advantages (`group_advantages`),
and the batch is laid out as the step takes it (`grpo.batch_struct`). Under rl.updates_per_batch
U > 1, a step that is not the first of its rollout's U trains on the rollout the state keeps.

The held-out prompts' evaluation (`evaluation`) samples one greedy completion of each and reports
the mean reward (eval_reward, and each term's).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.core.console import NOTICE, log
from meshtrain.core.errors import UserError
from meshtrain.engine.decode import sample_rows
from meshtrain.objectives import rewards
from meshtrain.objectives.grpo import group_advantages, longest_prompt, prompts_per_batch
from meshtrain.parallel.batching import placed_rows

BATCH = ("tokens", "sampler_logp", "advantages")


class Rollouts:
    def __init__(self, program, rl, tokenizer, seed: int):
        self.program, self.rl, self.tok, self.seed = program, rl, tokenizer, seed
        self.terms = rewards.parse(rl.reward, rl.format_pattern)
        self.seq_len = program.train.seq_len
        self.prompt_len = longest_prompt(self.seq_len, rl)  # every rollout's padded width: one program
        self.count = prompts_per_batch(program.train.batch_size, rl)
        self.figures: dict = {}  # the last rollout's reward figures, which its later updates report too
        if tokenizer.eos_id is None:
            log.log(NOTICE, f"the prompts' tokenizer ({tokenizer.name}) has no EOS: a completion runs "
                            f"rl.max_new_tokens={rl.max_new_tokens} tokens unless its chat template's end-of-turn "
                            f"token ends it")

    def check_rows(self, *prompt_sets) -> None:
        """Every row of the `prompts.Prompts` holds what the rewards read (exact_answer: an 'answer'):
        one error naming the first that does not, before anything is compiled."""
        if not rewards.needs_answer(self.terms):
            return
        for held in prompt_sets:
            where = next((w for w, row in zip(held.where, held.rows) if "answer" not in row), None)
            if where is not None:
                raise UserError(f"{where}: rl.reward exact_answer reads each row's 'answer', and this row has "
                                f"none; add it to the prompt data, or set another rl.reward")

    def sample(self, params, ids: list, temperature: float, key_seed: int, end_of_turn: int | None):
        """(completion ids [N, max_new], their log-probs, each completion's length with the EOS or
        end-of-turn token it ends at)."""
        p = self.program
        out_BxN, logp_BxN = sample_rows(p.model, params, ids, self.rl.max_new_tokens, temperature=temperature,
                                        top_p=self.rl.top_p, seed=key_seed, eos_id=self.tok.eos_id,
                                        vocab=self.tok.vocab_size, mesh=p.mesh, rules=p.rules,
                                        precision=p.plan.precision, pad_to=self.prompt_len,
                                        exact=self.rl.sampler == "exact", end_of_turn=end_of_turn)
        ended = np.isin(out_BxN, self.stops(end_of_turn))
        lengths = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, out_BxN.shape[1])
        return out_BxN, logp_BxN, lengths

    def stops(self, end_of_turn: int | None) -> list[int]:
        return [t for t in (self.tok.eos_id, end_of_turn) if t is not None]

    def scores(self, prompts, out_BxN, lengths, repeat: int) -> dict:
        """rl.reward's terms of each completion (`rewards.score`), each row's prompt repeated `repeat`
        times. With several processes, process 0 scores and sends the figures to the others, so a
        reward that is not a pure function of its inputs (a judge, a timeout) gives every process the
        same advantages, and a reward's error stops every process, not one in a collective."""
        stops = self.stops(prompts.end_of_turn)  # the text scored is the completion's without them
        each = lambda xs: [x for x in xs for _ in range(repeat)]

        def score():  # on the scoring process only: the texts are decoded there
            texts = [self.tok.decode([t for t in row[:n] if t not in stops]) for row, n in zip(out_BxN, lengths)]
            return rewards.score(self.terms, each(prompts.texts), texts, each(prompts.rows), each(prompts.where))

        if jax.process_count() == 1:
            return score()
        from jax.experimental import multihost_utils

        out, error = None, None
        if jax.process_index() == 0:
            try:
                out = score()
            except UserError as e:
                error = e
        if not multihost_utils.broadcast_one_to_all(np.bool_(error is None)):
            raise error or UserError("process 0's rl.reward failed on this rollout (its error line names the row); "
                                     "fix the reward or the row")
        keys = ["reward"] + [f"reward_{t.name}" for t in self.terms]
        like = {k: np.zeros(len(out_BxN)) for k in keys} if out is None else out
        return {k: np.asarray(v) for k, v in multihost_utils.broadcast_one_to_all(like).items()}

    def __call__(self, state, prompts, step: int):
        """(the step's batch, its rollout metrics) from `prompts`, the step's `prompts.Prompts`."""
        U = self.rl.updates_per_batch
        if U > 1 and step % U:  # the rollout the state keeps (copied: the state is donated to the step), and
            # its reward figures where this process sampled it (not after a resume between its updates)
            return {k: jnp.copy(state["rollout"][k]) for k in BATCH}, dict(self.figures)
        jax.block_until_ready(state["params"])  # the step before's: its time is not the rollout's
        started, G = time.perf_counter(), self.rl.group_size
        ids = [p for p in prompts.ids for _ in range(G)]
        key_seed = int(np.random.SeedSequence([self.seed, step]).generate_state(1)[0])
        out_BxN, logp_BxN, lengths = self.sample(state["params"], ids, self.rl.temperature, key_seed,
                                                 prompts.end_of_turn)
        scored = self.scores(prompts, out_BxN, lengths, G)
        rewards_PxG = scored["reward"].reshape(-1, G)
        advantages = group_advantages(rewards_PxG, self.rl.scale_rewards).reshape(-1)
        arrays = self.layout(ids, out_BxN, logp_BxN, lengths, advantages)
        seconds = time.perf_counter() - started
        metrics = {"reward": float(np.mean(scored["reward"])),
                   "reward_std": float(np.mean(np.std(rewards_PxG, axis=1, ddof=1))),
                   "response_length": float(np.mean(lengths)), "rollout_s": seconds,
                   "rollout_tokens_per_sec": float(np.sum(lengths)) / seconds}
        if len(self.terms) > 1:
            metrics.update({k: float(np.mean(v)) for k, v in scored.items() if k != "reward"})
        self.figures = {k: v for k, v in metrics.items() if not k.startswith("rollout")}
        shardings = self.program.step_batch_shardings
        return {k: placed_rows(arrays[k], shardings[k]) for k in BATCH}, metrics

    def layout(self, ids, out_BxN, logp_BxN, lengths, advantages) -> dict:
        """The rollout as `grpo.batch_struct` lays it out: row r is prompt then completion (its tokens
        the trained ones), padded with untrained 0s; the sampler's log-prob of target j (token j + 1)."""
        N, L1 = len(ids), self.seq_len + 1
        tokens = np.full((N, L1), ~0, np.int32)
        sampler = np.zeros((N, L1 - 1), np.float32)
        for r, (prompt, n) in enumerate(zip(ids, lengths)):
            P = len(prompt)
            tokens[r, :P] = ~prompt
            tokens[r, P:P + n] = out_BxN[r, :n]
            sampler[r, P - 1:P - 1 + n] = logp_BxN[r, :n]
        return {"tokens": tokens, "sampler_logp": sampler, "advantages": advantages.astype(np.float32)}

    def evaluation(self, params, val_sets: dict, batches: int) -> dict:
        """{'eval_reward': the mean reward of one greedy completion of each of the first batches x
        (prompts a batch) held-out prompts (val_sets[""], a `prompts.Prompts`), and each term's where
        there are several}; {} where the data holds none out."""
        if not val_sets:
            return {}
        held = val_sets[""]
        prompts = held.subset(range(min(len(held), batches * self.count)))
        out_BxN, _, lengths = self.sample(params, prompts.ids, 0.0, self.seed, prompts.end_of_turn)
        scored = self.scores(prompts, out_BxN, lengths, 1)
        record = {"eval_reward": float(np.mean(scored["reward"])),
                  "eval_response_length": float(np.mean(lengths))}
        if len(self.terms) > 1:
            record.update({f"eval_{k}": float(np.mean(v)) for k, v in scored.items() if k != "reward"})
        return record
