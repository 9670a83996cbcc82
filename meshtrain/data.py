"""Byte tokenizer, token sources, and deterministic batches.

The batch of step k depends only on (seed, k): its rows are random windows of the token stream
drawn from `np.random.default_rng([seed, split, k])`, so resuming or changing the mesh never
changes the data order. Each process reads only the rows its devices hold and the global array
is assembled with `jax.make_array_from_callback`.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import numpy as np

from meshtrain.errors import UserError

BYTE_VOCAB = 256
TOKEN_DTYPE = np.dtype(np.uint16)  # .bin token files, as nanoGPT writes them
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".tex")


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The Python standard library's own .py files: a real corpus every machine has offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _read_text(files: list[Path]) -> np.ndarray:
    return np.concatenate([np.frombuffer(f.read_bytes() + b"\n", dtype=np.uint8) for f in files])


def resolve_kind(dcfg) -> str:
    if dcfg.kind != "auto":
        return dcfg.kind
    if not dcfg.path:
        return "stdlib"
    return "tokens" if dcfg.path.endswith(".bin") else "text"


def load_tokens(dcfg, vocab_size: int) -> np.ndarray | None:
    """The whole token stream as a 1-D array (memory-mapped for .bin); None for synthetic data."""
    kind = resolve_kind(dcfg)
    if kind == "synthetic":
        return None
    if kind == "stdlib":
        tokens = _read_text(stdlib_files())
    else:
        path = Path(dcfg.path)
        if not dcfg.path or not path.exists():
            raise UserError(f"data path {dcfg.path!r} does not exist; pass --data FILE_OR_FOLDER "
                            f"(or omit it to train on the Python standard library)")
        if kind == "tokens":
            size = path.stat().st_size
            if size % TOKEN_DTYPE.itemsize or size == 0:
                raise UserError(f"token file {path} has {size} bytes, not a whole number of "
                                f"{TOKEN_DTYPE.itemsize}-byte ({TOKEN_DTYPE.name}) tokens; "
                                f"write it as a flat {TOKEN_DTYPE.name} array (e.g. numpy's tofile)")
            tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
        else:
            files = [path] if path.is_file() else sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not files:
                raise UserError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {path}")
            tokens = _read_text(files)
    if kind != "tokens" and vocab_size < BYTE_VOCAB:
        raise UserError(f"byte-level text needs model.vocab_size >= {BYTE_VOCAB}, got {vocab_size}")
    return tokens


class Batches:
    """`batches(k)` -> the global [batch, seq_len + 1] token array of step k, sharded as `sharding`.
    Each process builds only the rows its devices hold (whatever their order on the mesh)."""

    def __init__(self, tokens, batch_size: int, seq_len: int, seed: int, split: int, sharding, vocab_size: int):
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.split, self.sharding, self.vocab_size = seed, split, sharding, vocab_size
        self.shape = (batch_size, seq_len + 1)
        self.rows = np.array(sorted({i for idx in sharding.addressable_devices_indices_map(self.shape).values()
                                     for i in range(*idx[0].indices(batch_size))}))
        self.position = {int(r): i for i, r in enumerate(self.rows)}  # global row -> its place in `rows`

    def local_rows(self, step: int) -> np.ndarray:
        """The rows `self.rows` of step k's batch."""
        rng = np.random.default_rng([self.seed, self.split, step])
        if self.tokens is None:
            return synthetic_rows(rng, self.seed, self.vocab_size, self.shape)[self.rows]
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)[self.rows]
        window = np.arange(self.seq_len + 1)
        rows = np.asarray(self.tokens[starts[:, None] + window[None, :]], dtype=np.int32)
        if rows.max() >= self.vocab_size:
            raise UserError(f"token id {rows.max()} >= model.vocab_size={self.vocab_size}; set model.vocab_size "
                            f"to the tokenizer's vocabulary")
        return rows

    def __call__(self, step: int) -> jax.Array:
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
