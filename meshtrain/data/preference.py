"""Preference data for DPO (issue 43, section 3): jsonl rows of {"prompt", "chosen", "rejected"}.

Each field is text, or (with a chat template, meshtrain/data/chat.py) a list of messages: a prompt
string is one user message, a response string one assistant message. An example becomes two
documents, prompt + chosen then prompt + rejected, each tokenized whole and followed by the
tokenizer's document end, with a loss mask on the response's tokens only (a token is in the
response when its first character is: after the prompt's text, or after the prompt's rendering
with the generation prompt). `prepare --preference` stores them as chat data is stored (tokens,
.mask beside them) plus `pairs.npy`: int64 [N, 3], each pair's (chosen start, rejected start,
rejected end) in the token stream.

A batch row is one pair: [chosen window | rejected window], each L + 1 tokens from its sequence's
start, cut at its end and padded with untrained tokens (~0). Pairs are never packed: each sequence
starts at position 0 and attends to nothing of another, so its log-probability is exactly the one
of the sequence alone, and a row keeps its pair on one device and one microbatch on every layout.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from meshtrain.core.console import log
from meshtrain.core.errors import UserError
from meshtrain.data import chat as chat_lib
from meshtrain.data.batches import Batches
from meshtrain.data.tokens import MANIFEST

FIELDS = ("prompt", "chosen", "rejected")
PAIRS = "pairs.npy"


def example_of(row, _field, where: str) -> tuple:
    """A row's (prompt, chosen, rejected), each text or a conversation (chat.messages_of), checked,
    and `where` it is (for `encode`'s errors)."""
    if not isinstance(row, dict) or any(k not in row for k in FIELDS):
        keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{where}: a preference row needs the fields prompt, chosen and rejected (has: {keys}); "
                        f"fix the row")
    return (*(row[k] if isinstance(row[k], str) else chat_lib.messages_of(row[k], k, where) for k in FIELDS), where)


def encode(fmt: chat_lib.ChatFormat | None, tok, examples: list[tuple]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(text, ids, uint8 response mask) of prompt + chosen, then of prompt + rejected, for each example."""
    out = []
    for prompt, chosen, rejected, where in examples:
        for name, response in (("chosen", chosen), ("rejected", rejected)):
            others = [] if isinstance(response, str) else [m["role"] for m in response if m["role"] != "assistant"]
            if others:  # the whole conversation as the response (HH-RLHF style) would train the prompt as the answer
                raise UserError(f"{where}: {name} holds a {others[0]!r} turn; a response is the assistant's answer "
                                f"alone: put the turns before it in prompt")
            text, start = _text(fmt, prompt, response, where)
            ids, starts = chat_lib.ids_and_starts(tok, text)
            out.append((text, ids, (starts >= start).astype(np.uint8)))
    return out


def _text(fmt, prompt, response, where: str) -> tuple[str, int]:
    """(the sequence's text, the response's first character)."""
    if fmt is None:
        if not (isinstance(prompt, str) and isinstance(response, str)):
            raise UserError(f"{where}: the row holds messages: pass --chat-template (auto, chatml or a .jinja file) "
                            "to render them")
        return prompt + response, len(prompt)
    as_messages = lambda x, role: [{"role": role, "content": x}] if isinstance(x, str) else x
    prompt, response = as_messages(prompt, "user"), as_messages(response, "assistant")
    before, text = fmt.render(prompt, add_generation_prompt=True), fmt.render(prompt + response)
    if not text.startswith(before):
        raise UserError(f"{where}: chat template {fmt.name} does not render the prompt as a prefix of prompt + "
                        f"response, so the response cannot be located; pass --chat-template chatml or a template "
                        f"that does")
    return text, len(before)


def pairs_of(ends: np.ndarray) -> np.ndarray:
    """[N, 3] (chosen start, rejected start, rejected end) of the stream's documents (their `ends`),
    two an example."""
    starts = np.concatenate([[0], ends[:-1]])
    return np.stack([starts[0::2], starts[1::2], ends[1::2]], axis=1).astype(np.int64)


def write_pairs(folder: Path, ends: np.ndarray) -> dict:
    """pairs.npy in `folder`; the manifest's fields for it."""
    pairs = pairs_of(ends)
    np.save(folder / PAIRS, pairs)
    return {"pairs": len(pairs), "pairs_sha256": hashlib.sha256(pairs.tobytes()).hexdigest()}


def read_pairs(folder: str | Path) -> np.ndarray:
    """The pairs of a folder prepared with --preference, checked against its manifest."""
    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else {}
    if "pairs" not in manifest:
        raise UserError(f"train.objective=dpo reads preference pairs; {folder} holds none: prepare "
                        f"{{prompt, chosen, rejected}} rows with python -m meshtrain.data prepare --preference")
    pairs = np.load(folder / PAIRS) if (folder / PAIRS).is_file() else np.zeros((0, 3), np.int64)
    if hashlib.sha256(pairs.tobytes()).hexdigest() != manifest.get("pairs_sha256"):
        raise UserError(f"{folder / PAIRS} is not the file prepare wrote (its manifest's pairs_sha256); prepare "
                        f"the data again")
    return pairs


class PairBatches(Batches):
    """`batches(k)` -> step k's [batch, 2 (seq_len + 1)] rows, one pair each (the module's layout),
    drawn from `pairs` by (seed, split, k)."""

    def __init__(self, tokens, pairs, batch_size: int, seq_len: int, seed: int, split: int, sharding,
                 vocab_size: int):
        super().__init__(tokens, batch_size, seq_len, seed, split, sharding, vocab_size)
        self.pairs, self.shape = pairs, (batch_size, 2 * (seq_len + 1))

    def local_rows(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split, step])
        chosen = rng.integers(0, len(self.pairs), size=self.batch_size)[self.rows]
        L1 = self.seq_len + 1
        out = np.full((len(chosen), 2 * L1), ~0, np.int32)  # padding: id 0, untrained
        for row, (c, r, end) in zip(out, self.pairs[chosen]):
            for half, (lo, hi) in enumerate(((c, r), (r, end))):
                n = int(min(hi - lo, L1))
                row[half * L1:half * L1 + n] = self.tokens.windows(np.array([lo]), n)[0]
        return self.checked(out)


def split_pairs(pairs: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray | None]:
    """(training pairs, held-out pairs or None): the file's last data.val_fraction of the pairs are
    held out, as the token stream's tail is for other data; each part holds at least one pair."""
    if val_fraction <= 0:
        return pairs, None
    held = max(1, round(len(pairs) * val_fraction))
    if held >= len(pairs):
        raise UserError(f"the data holds {len(pairs):,} preference pairs, leaving none for training with "
                        f"data.val_fraction={val_fraction} ({held:,} held out); use more pairs or a smaller "
                        f"data.val_fraction (0 holds none out and turns eval off)")
    return pairs[:-held], pairs[-held:]


def batches(tokens, pairs, val_fraction: float, batch_size: int, seq_len: int, seed: int, sharding,
            vocab_size: int) -> tuple[PairBatches, dict]:
    """(the training pair batches, {"": the held-out pairs' batches} or {} when data.val_fraction is
    0): split 0 draws from the training pairs, split 1 from the held-out ones (`split_pairs`)."""
    if tokens is None or tokens.masks is None:
        raise UserError("train.objective=dpo sums each response's log-probabilities under the data's loss mask; "
                        "set data.train_on=assistant")
    lengths = np.maximum(pairs[:, 1] - pairs[:, 0], pairs[:, 2] - pairs[:, 1])
    if (cut := int(np.count_nonzero(lengths > seq_len + 1))):
        log.warning(f"{cut:,} of {len(pairs):,} preference pairs are longer than train.seq_len + 1 = {seq_len + 1} "
                    f"tokens: they are cut there, and a response beyond it adds nothing")
    train, held = split_pairs(pairs, val_fraction)
    val = {} if held is None else {"": PairBatches(tokens, held, batch_size, seq_len, seed, 1, sharding, vocab_size)}
    return PairBatches(tokens, train, batch_size, seq_len, seed, 0, sharding, vocab_size), val
