"""Deterministic batches: the batch of step k depends only on (seed, split, k).

Its rows are random windows of the token stream drawn from `np.random.default_rng([seed, split, k])`,
so resuming or changing the mesh never changes the data order. Each process reads only the rows
its devices hold and the global array is assembled with `jax.make_array_from_callback`. JAX is
imported when a batch is made: prepare's workers (data/prepare.py, data/cluster.py) import this module
through preference.py and never start JAX.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.data.tokens import Tokens, token_ids

if TYPE_CHECKING:
    import jax


class Batches:
    """`batches(k)` -> the global [batch, seq_len + 1] token array of step k, sharded as `sharding`.
    Each process builds only the rows its devices hold (whatever their order on the mesh)."""

    def __init__(self, tokens, batch_size: int, seq_len: int, seed: int, split: int, sharding,
                 vocab_size: int):
        """`tokens`: a `Tokens` stream, a 1-D array, or None for synthetic data."""
        self.tokens = tokens if tokens is None or isinstance(tokens, Tokens) else Tokens([tokens])
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.split, self.sharding, self.vocab_size = seed, split, sharding, vocab_size
        self.shape = (batch_size, seq_len + 1)
        held = sharding.addressable_devices_indices_map(self.shape).values()
        self.rows = np.array(sorted({i for idx in held for i in range(*idx[0].indices(batch_size))}))
        self.position = {int(r): i for i, r in enumerate(self.rows)}  # global row -> its place in `rows`

    def shares(self, step: int) -> dict[str, float]:
        """Each source's share of step k's tokens, by name: none for one source (a mixture's:
        meshtrain/data/mixture.py `MixedBatches`)."""
        return {}

    def local_rows(self, step: int) -> np.ndarray:
        """The rows `self.rows` of step k's batch."""
        rng = np.random.default_rng([self.seed, self.split, step])
        if self.tokens is None:
            return synthetic_rows(rng, self.seed, self.vocab_size, self.shape)[self.rows]
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)[self.rows]
        return self.checked(self.tokens.windows(starts, self.seq_len + 1))

    def checked(self, rows: np.ndarray) -> np.ndarray:
        """`rows`, whose ids the model's embedding must hold (untrained ones stored as ~id: tokens.py)."""
        if (top := token_ids(rows).max()) >= self.vocab_size:
            raise UserError(f"token id {top} >= model.vocab_size={self.vocab_size}; set "
                            f"model.vocab_size to the tokenizer's vocabulary")
        return rows

    def __call__(self, step: int) -> jax.Array:
        import jax

        rows = self.local_rows(step)
        return jax.make_array_from_callback(
            self.shape, self.sharding,
            lambda idx: rows[[self.position[r] for r in range(*idx[0].indices(self.batch_size))]])


def synthetic_rows(rng, seed: int, vocab_size: int, shape) -> np.ndarray:
    """Rows from a fixed random bigram chain (each token has 4 likely successors), so a model can
    learn it: the loss falls from ln(vocab) towards the chain's entropy (~1.4 nats) without any
    file. The chain depends on `seed` only; the rows on `rng` (seed, split, step)."""
    successors = np.random.default_rng([seed, 99]).integers(0, vocab_size, size=(vocab_size, 4))
    rows = np.empty(shape, np.int32)
    rows[:, 0] = rng.integers(0, vocab_size, size=shape[0])
    choice = rng.integers(0, 4, size=shape)
    for t in range(1, shape[1]):
        rows[:, t] = successors[rows[:, t - 1], choice[:, t]]
    return rows


def split_tokens(tokens, val_fraction: float, seq_len: int):
    """Hold out the stream's tail for validation; each part must hold more than one window."""
    if tokens is None:
        return None, None
    cut = int(len(tokens) * (1 - val_fraction))
    train, val = tokens[:cut], (tokens[cut:] if val_fraction > 0 else None)
    for name, part in (("training", train), ("validation", val)):
        if part is not None and len(part) <= seq_len + 1:
            raise UserError(f"the data holds {len(tokens):,} tokens, leaving {len(part):,} for {name} "
                            f"(data.val_fraction={val_fraction}), which is not more than train.seq_len + 1 = "
                            f"{seq_len + 1}; use more data, a shorter train.seq_len"
                            f"{', or a larger data.val_fraction' if name == 'validation' else ''}")
    return train, val
