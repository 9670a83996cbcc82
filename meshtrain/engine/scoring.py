"""Log-likelihood scoring: `Scorer(model, rows, length, mesh=...)(requests)` rates continuations given
contexts, the primitive of multiple-choice tasks (meshtrain/data/tasks.py), of the in-loop task
evaluation (meshtrain/run/trainer.py) and of the lm-eval-harness adapter (meshtrain/interop/harness.py).

A request (context ids, continuation ids) becomes one row:
`inputs = (context + continuation)[-(length + 1):][:-1]`, left-truncated to the window as lm-eval-harness
does, right-padded to `length`; the
targets are the inputs shifted by one and a mask marks the continuation's positions. Its score is
sum over the mask of log softmax(logits)[target], and `greedy` says whether every continuation token
is the argmax (target logit = max logit: exact ties count as greedy). Rows start at position 0, as
in training, so a row's score never depends on the others or on the padding (attention is causal).

One jitted program for [rows, length] arrays: it compiles once, on any mesh (parameters in their
shardings, rows split over the batch axes, activations under the logical rules); requests are
packed `rows` at a time, the last batch padded with empty rows. The head runs over chunks of
positions (meshtrain/ops/loss.py `chunk_positions`), so fp32 logits [rows, length, V] never exist
whole; the target logit is a one-hot product, so a vocabulary split over `tensor` stays split.
The model is rebuilt from its decoding spec (the moe family routes dropless: a token's experts do not
depend on the other rows) with the plain attention given (no ring, no packing: a row is one text).
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.core.errors import UserError
from meshtrain.data.tasks import choice_metrics
from meshtrain.engine.decode import padded_rows, place
from meshtrain.models import FAMILIES
from meshtrain.ops.attention import BACKENDS, MIN_ATTENTION_BLOCK, xla_attention
from meshtrain.ops.loss import chunk_positions
from meshtrain.ops.precision import cast_for_compute
from meshtrain.parallel.batching import placed_rows
from meshtrain.parallel.sharding import activation_rules, constrain, make_rules, shard_count, spec_for


def score_fn(model, precision: str = "fp32", prepare=None):
    """(params, tokens, targets, mask [B, L]) -> (log-likelihood [B] fp32, greedy [B] bool) for `model`.
    `prepare`: params -> params in model order (a training run's storage order; None: as given)."""
    def score(params, tokens_BxL, targets_BxL, mask_BxL):
        params = cast_for_compute(params if prepare is None else prepare(params), precision)
        tokens_BxL = constrain(tokens_BxL, ("batch", "seq"))
        x_BxLxD = model.trunk(params, tokens_BxL)[0]
        (B, L), V = tokens_BxL.shape, model.cfg.vocab_size
        C = chunk_positions(max(1, B // shard_count("batch")), L, max(1, V // shard_count("vocab")))
        # chunk n holds positions n, n + L/C, ... (ops/loss.py `_chunks`): sums and alls are order-free
        chunks = lambda a: jnp.moveaxis(a.reshape(B, C, L // C, *a.shape[2:]), 2, 0)

        def chunk(_, xs):
            x_BxCxD, t_BxC, m_BxC = xs
            logits_BxCxV = model.head(params, x_BxCxD).astype(jnp.float32)
            target_BxC = jnp.sum(logits_BxCxV * jax.nn.one_hot(t_BxC, V, dtype=jnp.float32), axis=-1)
            logprob_BxC = target_BxC - jax.nn.logsumexp(logits_BxCxV, axis=-1)
            greedy_BxC = target_BxC >= jnp.max(logits_BxCxV, axis=-1)
            return None, (jnp.sum(jnp.where(m_BxC, logprob_BxC, 0.0), -1), jnp.all(greedy_BxC | ~m_BxC, -1))

        _, (ll_NxB, greedy_NxB) = jax.lax.scan(chunk, None, (chunks(x_BxLxD), chunks(targets_BxL), chunks(mask_BxL)))
        return ll_NxB.sum(0), greedy_NxB.all(0)

    return score


def pack(requests, rows: int, length: int):
    """Requests as batches of `rows` rows of `length` positions: a list of (tokens, targets, mask)
    numpy arrays [rows, length] (module doc). A continuation longer than the window is an error."""
    batches = []
    for start in range(0, len(requests), rows):
        tokens, targets = np.zeros((2, rows, length), np.int32)
        mask = np.zeros((rows, length), bool)
        for r, (context, continuation) in enumerate(requests[start:start + rows]):
            if not len(continuation):
                raise UserError("a continuation encodes to no tokens, which have no log-likelihood; give each "
                                "choice some text")
            if len(continuation) > length:
                raise UserError(f"a continuation of {len(continuation)} tokens does not fit the scoring window of "
                                f"{length} tokens (train.seq_len, or --seq-len); shorten the choice or widen it")
            whole = np.concatenate([np.asarray(context, np.int32), np.asarray(continuation, np.int32)])[-(length + 1):]
            n = len(whole) - 1
            tokens[r, :n], targets[r, :n] = whole[:-1], whole[1:]
            mask[r, n - len(continuation):n] = True
        batches.append((tokens, targets, mask))
    return batches


class Scorer:
    """`scorer(requests)` -> (log-likelihoods, greedy flags), numpy arrays, one per request (a pair
    of int sequences: context ids, continuation ids; the context non-empty).

    `rows` x `length`: the compiled batch (rows rounded up to a multiple of the mesh's batch axes).
    `mesh`, `rules`: where it runs (None: the first device); `param_shardings`: the parameters' layout
    (default: meshtrain/engine/decode.py `place`, replicated over data); `prepare`: see `score_fn`;
    `attention`: the kernel (meshtrain/ops/attention.py; ring needs its own layout: pass xla)."""

    def __init__(self, model, rows: int, length: int, *, mesh=None, rules=None, param_shardings=None,
                 prepare=None, precision: str = "fp32", attention=xla_attention):
        spec = model.decoding_spec()
        self.model = FAMILIES[spec.family](spec, attention=attention)
        self.mesh, self.rules = mesh, rules or make_rules()
        self.rows, self.length = padded_rows(rows, mesh, self.rules), length
        fn = score_fn(self.model, precision, prepare)
        if mesh is None:
            self.program = jax.jit(fn)
            return
        seq = math.prod(mesh.shape[a] for name in ("seq", "residual_seq") for a in self.rules[name])
        self.length = -(-length // seq) * seq  # a whole number of sequence shards
        self.row_sharding = NamedSharding(mesh, spec_for(("batch", None), self.rules, mesh))
        shardings = param_shardings if param_shardings is not None else place(model, mesh, self.rules)
        replicated = NamedSharding(mesh, P())
        self.program = jax.jit(fn, in_shardings=(shardings, *[self.row_sharding] * 3),
                               out_shardings=(replicated, replicated))

    def context(self):
        """The mesh and activation rules the program is traced and run under."""
        stack = contextlib.ExitStack()
        if self.mesh is not None:
            stack.enter_context(jax.set_mesh(self.mesh))
            stack.enter_context(activation_rules(self.rules, self.mesh))
        return stack

    def put(self, a):
        """A host array of rows (one of `pack`'s), placed as the program takes it."""
        if self.mesh is None:
            return a
        return placed_rows(a, self.row_sharding)

    def __call__(self, params, requests) -> tuple[np.ndarray, np.ndarray]:
        scores, greedy = [], []
        with self.context():
            for batch in pack(requests, self.rows, self.length):
                ll_B, greedy_B = jax.device_get(self.program(params, *map(self.put, batch)))
                scores.append(ll_B)
                greedy.append(greedy_B)
        if not requests:
            return np.zeros(0, np.float32), np.zeros(0, bool)
        n = len(requests)
        return np.concatenate(scores)[:n], np.concatenate(greedy)[:n]


def for_program(program, tasks=(), rows: int | None = None, model_order: bool = False) -> Scorer:
    """The scorer of a training program's mesh, rules, precision and parameter layout (the train
    state's shardings; storage order, or model order with `model_order`): `rows` default a training
    microbatch's rows (the forward of as many as a training step holds), the window the longest of
    `tasks`' requests (meshtrain/data/tasks.py), rounded up to a whole blockwise-attention block, at
    most train.seq_len."""
    t, plan = program.train, program.plan
    longest = max((len(c) + len(x) - 1 for task in tasks for c, x in task.requests), default=t.seq_len)
    rows = rows or t.batch_size // plan.num_microbatches(program.sizes["pipeline"])
    attention = BACKENDS[plan.attention] if plan.attention != "ring" else xla_attention
    length = min(t.seq_len, -(-longest // MIN_ATTENTION_BLOCK) * MIN_ATTENTION_BLOCK)
    return Scorer(program.model, rows, length, mesh=program.mesh, rules=program.rules,
                  param_shardings=program.state_shardings["params"],
                  prepare=None if model_order else program.in_model_order, precision=plan.precision,
                  attention=attention)


def task_metrics(scorer: Scorer, params, tasks) -> dict[str, float]:
    """{eval_acc_<name>, eval_acc_norm_<name>} of each task (meshtrain/data/tasks.py `choice_metrics`)."""
    record = {}
    for task in tasks:
        metrics = choice_metrics(task.items, scorer(params, task.requests)[0])
        record.update({f"eval_{metric}_{task.name}": value for metric, value in metrics.items()})
    return record
