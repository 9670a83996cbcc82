"""Text generation with a KV cache: `generate(model, params, prompts, max_new_tokens, ...)`; the
command `python -m meshtrain.generate --run RUN --prompt "ROMEO:"` is meshtrain/generate.py.

- The cached forward is the model's (`LanguageModel.decode`): the prompt (prefill) and each new
  token go through one function, which writes their keys and values into a cache [layers, B, T, G, K]
  and attends over it. A sliding-window layer (gemma3's local ones) keeps a ring buffer of its
  window's positions instead; the prefill tells it each row's length, so padding evicts nothing.
  deepseek_v3's latent attention caches one latent per position [layers, B, T, kv_lora_rank +
  qk_rope_head_dim] and decodes from it with wkv_b absorbed (models/deepseek_v3.py).
- Prompts of different lengths: each row keeps its own length. The prompts are right-padded to the
  longest and prefilled together; row b's first new token comes from position len_b - 1 and its t-th
  is written at position len_b + t, over the padding's keys, which no query of the row has read (a
  query attends to cache positions <= its own). Every row's positions start at 0, as in training,
  so a row's tokens never depend on the other rows (left padding would shift them).
- One jitted program: prefill, then a `jax.lax.while_loop` of one-token steps that ends when every
  row has produced `eos_id` or after max_new_tokens. Prompts longer than PREFILL_CHUNK positions
  are prefilled a chunk at a time, so the prefill's scores are [B, H, chunk, T], not [B, H, P, T].
- Sampling: greedy (temperature 0), or softmax(logits / temperature) restricted to the top k and to
  the nucleus (Holtzman et al. 2020); step t draws with `fold_in(key(seed), t)`, so a seed
  reproduces its tokens, on any mesh.
- On a mesh (`place`): parameters sharded by the logical rules over fsdp/tensor/expert (replicated
  over data, whatever ZeRO stage trained them), prompt rows over the batch axes. No pipeline or
  context axes.
- `window` (the CLI: the run's train.seq_len): a query attends to the latest `window` positions at
  most, so text longer than the trained length keeps every query-key distance a trained one.
- `vocab` (the CLI: the tokenizer's size): ids from `vocab` up (a model vocabulary padded past its
  tokenizer's) get logit -inf before sampling, greedy included, so no id the tokenizer cannot
  decode is ever produced.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from meshtrain.core.bounds import Bounds
from meshtrain.core.errors import UserError
from meshtrain.ops.loss import position_chunk_logits, token_log_probs
from meshtrain.ops.precision import cast_for_compute
from meshtrain.parallel.sharding import activation_rules, make_rules, param_shardings, spec_for


def filter_logits(logits_BxV, top_k=0, top_p=1.0):
    """Logits outside the k largest (top_k > 0) and outside the nucleus (top_p < 1: the smallest set
    of most likely tokens whose probabilities, renormalised over the top k, sum to >= top_p) set to
    -inf; ties at the boundary stay in. top_k and top_p may be traced: one sort serves both."""
    V = logits_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
    in_top_k_V = jnp.arange(V) < jnp.where(top_k > 0, top_k, V)
    probs_BxV = jax.nn.softmax(jnp.where(in_top_k_V, sorted_BxV, -jnp.inf), axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # the mass of the more likely tokens
    kept_Bx1 = jnp.sum(in_top_k_V & (before_BxV < top_p), axis=-1, keepdims=True)
    cut_Bx1 = jnp.take_along_axis(sorted_BxV, kept_Bx1 - 1, axis=-1)
    return jnp.where(logits_BxV < cut_Bx1, -jnp.inf, logits_BxV)


def sample(logits_BxV, key, temperature, top_k, top_p):
    """One token per row: the argmax at temperature 0, else a draw from the filtered softmax of
    logits / temperature."""
    hot = temperature > 0
    filtered_BxV = filter_logits(logits_BxV / jnp.where(hot, temperature, 1.0), top_k, top_p)
    drawn_B = jax.random.categorical(key, filtered_BxV, axis=-1)
    return jnp.where(hot, drawn_B, jnp.argmax(logits_BxV, axis=-1)).astype(jnp.int32)


def draw(logits_BxV, key, done_B, temperature, top_k, top_p, eos_id, end_of_turn, log_probs=token_log_probs):
    """(each row's next token, its log-probability under logits / temperature (`log_probs`, of the
    logits, the token and the temperature), the rows done): a row ends at eos_id or end_of_turn (-1:
    none), and once done repeats eos_id with log-prob 0."""
    token_B = sample(logits_BxV, key, temperature, top_k, top_p)
    logp_B = log_probs(logits_BxV, token_B, jnp.where(temperature > 0, temperature, 1.0))
    ends_B = (token_B == eos_id) | (token_B == end_of_turn)
    return jnp.where(done_B, eos_id, token_B), jnp.where(done_B, 0.0, logp_B), done_B | ends_B


def put(a_BxN, new_B, t):
    """Column t of a_BxN set to new_B."""
    return jax.lax.dynamic_update_slice_in_dim(a_BxN, new_B[:, None].astype(a_BxN.dtype), t, 1)


PREFILL_CHUNK = 512  # prompt positions per prefill step: its scores are [B, H, chunk, T], never [B, H, P, T]


@functools.lru_cache(maxsize=32)
def _program(model, max_new: int, mesh, rules, chunk: int = PREFILL_CHUNK, precision: str = "fp32"):
    """The jitted generation of max_new tokens (jit caches the compiled shapes; the sampling
    settings, eos and window are traced, so changing them compiles nothing); traced under `rules`
    (a tuple of items) on `mesh` when one is given. Prompts longer than `chunk` are prefilled
    `chunk` positions at a time (`prefill`). The parameters are cast to `precision`'s compute dtype
    inside the program (a trainer's fp32 state samples without a second copy)."""
    def run(params, prompts_BxP, lengths_B, key, settings):
        with activation_rules(dict(rules), mesh) if mesh is not None else contextlib.nullcontext():
            return tokens(cast_for_compute(params, precision), prompts_BxP, lengths_B, key, **settings)

    def prefill(params, prompts_BxP, lengths_B, window):
        """The prompts through the cached forward, `chunk` positions at a time (each chunk's queries
        see the cache its predecessors wrote, as one pass would): the cache, and each row's hidden
        state at its last prompt position. Rows are right-padded to whole chunks; the padding's
        keys lie beyond each row's end, where new tokens overwrite them before any query reads."""
        B, P = prompts_BxP.shape
        n = -(-P // chunk)
        # one chunk: the prompt's and the new tokens' positions; more: whole chunks, padding included
        positions = P + max_new - 1 if n == 1 else max(n * chunk, P + max_new - 1)
        cache = model.init_cache(B, positions, params["embedding"].dtype)  # in the compute dtype
        if n == 1:
            x_BxPxD, cache = model.decode(params, prompts_BxP, cache, jnp.zeros(B, jnp.int32), window, lengths_B)
            return cache, jnp.take_along_axis(x_BxPxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        padded_BxNC = jnp.pad(prompts_BxP, ((0, 0), (0, n * chunk - P)))
        last_B = lengths_B - 1

        def step(carry, xs):
            cache, x_BxD = carry
            i, chunk_BxC = xs
            x_BxCxD, cache = model.decode(params, chunk_BxC, cache, jnp.full(B, i * chunk, jnp.int32), window,
                                          lengths_B)
            picked_BxD = jnp.take_along_axis(x_BxCxD, (last_B % chunk)[:, None, None], axis=1)[:, 0]
            return (cache, jnp.where((last_B // chunk == i)[:, None], picked_BxD, x_BxD)), None

        x_BxD = jnp.zeros((B, model.cfg.d_model), params["embedding"].dtype)
        chunks_NxBxC = padded_BxNC.reshape(B, n, chunk).swapaxes(0, 1)
        (cache, x_BxD), _ = jax.lax.scan(step, (cache, x_BxD), (jnp.arange(n), chunks_NxBxC))
        return cache, x_BxD

    def tokens(params, prompts_BxP, lengths_B, key, temperature, top_k, top_p, eos_id, end_of_turn, window,
               vocab):
        B = prompts_BxP.shape[0]
        cache, x_BxD = prefill(params, prompts_BxP, lengths_B, window)

        def next_token(x_BxD, t, done_B):
            logits_BxV = model.head(params, x_BxD[:, None])[:, 0]
            logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < vocab, logits_BxV, -jnp.inf)
            return draw(logits_BxV, jax.random.fold_in(key, t), done_B, temperature, top_k, top_p, eos_id,
                        end_of_turn)

        first_B, logp_B, done_B = next_token(x_BxD, 0, jnp.zeros(B, bool))
        out_BxN, logp_BxN = (put(jnp.zeros((B, max_new), a.dtype), a, 0) for a in (first_B, logp_B))

        def step(state):
            t, out_BxN, logp_BxN, cache, done_B = state
            last_Bx1 = jax.lax.dynamic_slice_in_dim(out_BxN, t - 1, 1, axis=1)
            x_Bx1xD, cache = model.decode(params, last_Bx1, cache, lengths_B + t - 1, window)
            token_B, logp_B, done_B = next_token(x_Bx1xD[:, 0], t, done_B)
            return t + 1, put(out_BxN, token_B, t), put(logp_BxN, logp_B, t), cache, done_B

        going = lambda state: (state[0] < max_new) & ~jnp.all(state[-1])
        _, out_BxN, logp_BxN, _, _ = jax.lax.while_loop(going, step, (1, out_BxN, logp_BxN, cache, done_B))
        return out_BxN, logp_BxN

    return jax.jit(run)


@functools.lru_cache(maxsize=32)
def _exact_program(model, max_new: int, mesh, rules, precision: str = "fp32"):
    """`_program`'s generation without a KV cache (rl.sampler=exact): each new token runs the training
    forward (`model.trunk`) over the whole padded sequence [B, P + max_new - 1], the width the trainer
    scores, and its logits are the head's at the row's last position as the trainer's log-probs compute
    them (`position_chunk_logits`): the same GEMM shapes, so the drawn tokens' log-probabilities are the
    trainer's bit for bit on one layout. max_new forwards of the whole width; no window."""
    def run(params, tokens_BxL, lengths_B, key, settings):
        with activation_rules(dict(rules), mesh) if mesh is not None else contextlib.nullcontext():
            return tokens(cast_for_compute(params, precision), tokens_BxL, lengths_B, key, **settings)

    def tokens(params, tokens_BxL, lengths_B, key, temperature, top_k, top_p, eos_id, end_of_turn, window,
               vocab):
        B, rows_B = tokens_BxL.shape[0], jnp.arange(tokens_BxL.shape[0])

        def step(state):
            t, tokens_BxL, out_BxN, logp_BxN, done_B = state
            x_BxLxD, _ = model.trunk(params, tokens_BxL)
            logits_BxCxV, column_B = position_chunk_logits(model.final_norm(params, x_BxLxD),
                                                           model.unembedding(params), lengths_B + t - 1, vocab)
            # the token's log-prob over the whole chunk, as the trainer's (`position_log_probs`), then its column
            log_probs = lambda _, token_B, temp: token_log_probs(
                logits_BxCxV, jnp.broadcast_to(token_B[:, None], logits_BxCxV.shape[:2]), temp)[rows_B, column_B]
            token_B, logp_B, done_B = draw(logits_BxCxV[rows_B, column_B], jax.random.fold_in(key, t), done_B,
                                           temperature, top_k, top_p, eos_id, end_of_turn, log_probs)
            tokens_BxL = tokens_BxL.at[rows_B, lengths_B + t].set(token_B, mode="drop")  # the last one: no input
            return t + 1, tokens_BxL, put(out_BxN, token_B, t), put(logp_BxN, logp_B, t), done_B

        going = lambda state: (state[0] < max_new) & ~jnp.all(state[-1])
        start = (0, tokens_BxL, jnp.zeros((B, max_new), jnp.int32), jnp.zeros((B, max_new), jnp.float32),
                 jnp.zeros(B, bool))
        _, _, out_BxN, logp_BxN, _ = jax.lax.while_loop(going, step, start)
        return out_BxN, logp_BxN

    return jax.jit(run)


def _chosen(model, max_new: int, mesh, rules, chunk: int, precision: str, exact: bool):
    """The generation program: `_exact_program` or `_program`, traced under `rules` (None: none)."""
    items = None if rules is None else tuple(sorted(rules.items()))
    return (_exact_program(model, max_new, mesh, items, precision) if exact
            else _program(model, max_new, mesh, items, chunk, precision))


def generate(model, params, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, window: int | None = None,
             vocab: int | None = None, mesh=None, rules=None,
             prefill_chunk: int = PREFILL_CHUNK) -> list[np.ndarray]:
    """The new token ids of each prompt (a list of 1-D int arrays): max_new_tokens of them, or up to
    (not including) the row's first `eos_id`. temperature 0 is greedy; top_k 0 and top_p 1 keep every
    token; ids >= `vocab` (the tokenizer's size, when the model's vocabulary is larger) are never
    produced. With `mesh`, runs there under the logical `rules` (default: meshtrain's), `params`
    placed by `place`; rows are padded to a multiple of the batch axes and the padding dropped."""
    out_BxN, _ = sample_rows(model, params, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, eos_id=eos_id, window=window, vocab=vocab, mesh=mesh,
                             rules=rules, prefill_chunk=prefill_chunk)
    return [row[:np.argmax(row == eos_id)] if eos_id is not None and (row == eos_id).any() else row
            for row in out_BxN]


def sample_rows(model, params, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, window: int | None = None,
                vocab: int | None = None, mesh=None, rules=None, prefill_chunk: int = PREFILL_CHUNK,
                precision: str = "fp32", pad_to: int | None = None, exact: bool = False,
                end_of_turn: int | None = None):
    """`generate`'s rows whole, as numpy [len(prompts), max_new_tokens]: the new ids (after a row's
    first `eos_id` or `end_of_turn`, eos_id again) and each one's log-probability under the policy it was drawn
    from, log softmax(logits / temperature) (temperature 0: of the logits; ids >= `vocab` masked;
    top_k and top_p filter the draw, not this distribution), 0 after the row's end. The
    log-probabilities are `token_log_probs` of the cached forward's logits (`exact`: of the training
    forward's): the trainer's recomputation applies the same function to its own forward's.
    `precision`: the parameters are cast to its compute dtype inside the program
    (meshtrain/ops/precision.py). `pad_to`: the prompts'
    padded width (default: the longest prompt's), so batches of other prompt lengths compile nothing
    new. `exact`: without a KV cache, the training forward over the whole sequence for each token
    (`_exact_program`; rl.sampler=exact). `end_of_turn`: a second id a row ends at, which it keeps (a
    chat template's, meshtrain/data/chat.py `end_of_turn`). Every process gets the whole rows."""
    check_settings(max_new_tokens, temperature, top_k, top_p)
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise UserError("every prompt needs at least one token; pass a non-empty prompt")
    rules = rules or make_rules()
    rows = padded_rows(len(prompts), mesh, rules)
    width = max(max(lengths), pad_to or 0)
    prompts_BxP = np.zeros((rows, width + max_new_tokens - 1 if exact else width), np.int32)
    lengths_B = np.full(rows, lengths[0], np.int32)
    for b, p in enumerate(prompts):
        prompts_BxP[b, :len(p)], lengths_B[b] = p, len(p)
    prompts_BxP[len(prompts):, :lengths[0]] = prompts[0]  # padding rows repeat the first prompt
    program = _chosen(model, max_new_tokens, mesh, None if mesh is None else rules, prefill_chunk, precision, exact)
    settings = {"temperature": np.float32(temperature), "top_k": np.int32(top_k),
                "top_p": np.float32(top_p), "eos_id": np.int32(-1 if eos_id is None else eos_id),
                "end_of_turn": np.int32(-1 if end_of_turn is None else end_of_turn),
                "window": np.int32(window or prompts_BxP.shape[1] + max_new_tokens),
                "vocab": np.int32(vocab or model.cfg.vocab_size)}
    args = [prompts_BxP, lengths_B]
    if mesh is None:
        out = program(params, *args, jax.random.key(seed), settings)
    else:
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, row_sharding(a.ndim, mesh, rules)) for a in args]
            out = program(params, *args, jax.random.key(seed), settings)
    out_BxN, logp_BxN = (whole(a)[:len(prompts)] for a in out)
    return out_BxN, logp_BxN


def whole(x) -> np.ndarray:
    """A global array's values on every process (gathered from the others where it spans several)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def padded_rows(rows: int, mesh, rules) -> int:
    """Rows padded to a multiple of the batch axes' product (one size for every data shard)."""
    if mesh is None:
        return rows
    multiple = math.prod(mesh.shape[a] for a in rules["batch"])
    return -(-rows // multiple) * multiple


def row_sharding(ndim: int, mesh, rules):
    return NamedSharding(mesh, spec_for(("batch",) + (None,) * (ndim - 1), rules, mesh))


def lower(model, mesh, batch: int, prompt_len: int, max_new_tokens: int, rules=None, param_shardings=None,
          precision: str = "fp32", exact: bool = False, held: str = "fp32"):
    """The generation program `generate` runs, lowered on `mesh` from abstract inputs (nothing
    materialised; the planner compiles it for its memory): `batch` prompts of `prompt_len` tokens
    (rows padded as `generate` pads them), the parameters laid out by `place` (or by
    `param_shardings`: a trainer's rollouts sample from its state's layout) and cast to `precision`'s
    compute dtype, a KV cache of prompt_len + max_new_tokens - 1 positions (`exact`: none, the
    sequence that wide instead: `_exact_program`). `held`: the precision whose compute dtype the
    parameters arrive in (generate --precision casts them before placing them)."""
    rules = rules or make_rules()
    rows = padded_rows(batch, mesh, rules)
    abstract = lambda tree, shardings: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    shapes = jax.eval_shape(lambda key: cast_for_compute(model.init(key), held), jax.random.key(0))
    params = abstract(shapes, param_shardings or place(model, mesh, rules))
    width = prompt_len + max_new_tokens - 1 if exact else prompt_len
    prompts = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=row_sharding(2, mesh, rules))
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sharding(1, mesh, rules))
    settings = {"temperature": jnp.float32, "top_k": jnp.int32, "top_p": jnp.float32, "eos_id": jnp.int32,
                "end_of_turn": jnp.int32, "window": jnp.int32, "vocab": jnp.int32}
    settings = {k: jax.ShapeDtypeStruct((), dtype) for k, dtype in settings.items()}
    program = _chosen(model, max_new_tokens, mesh, rules, PREFILL_CHUNK, precision, exact)
    with jax.set_mesh(mesh):
        return program.lower(params, prompts, lengths, jax.eval_shape(jax.random.key, 0), settings)


SAMPLING = {"max_new_tokens": Bounds(min=1), "temperature": Bounds(min=0.0), "top_k": Bounds(min=0),
            "top_p": Bounds(above=0.0, max=1.0)}  # ranges of the sampling settings, for the API and the flags


def check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """The sampling settings within SAMPLING's ranges (finite): 0 temperature = greedy, 0 top_k and 1
    top_p = no filter."""
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p)):
        SAMPLING[name].check(f"--{name.replace('_', '-')}", value)


def place(model, mesh, rules=None, params=None):
    """The parameters' shardings on `mesh` (no ZeRO: replicated over data); with `params`, those
    parameters placed there."""
    shardings = param_shardings(model, mesh, rules, check=True)
    return shardings if params is None else jax.device_put(params, shardings)
