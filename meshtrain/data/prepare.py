"""`prepare`: tokenize a raw source once, in parallel, into a folder of token shards.

Units (meshtrain/data/sources.py) are tokenized by worker processes and written in source order,
so any number of workers writes the same bytes. Every document is followed by the tokenizer's
`document_end` (its EOS id; a newline for bytes). The folder holds shard-00000.bin, ... (each with
its sidecar), the tokenizer (tokenizer.json or tokenizer.txt) and, written last, manifest.json: a
folder without one is an unfinished prepare. The sha256 of each shard (in its sidecar and manifest
row) and of the whole stream (the manifest's) are computed as the bytes are written, so a run on
the folder reads no shard to know its data's identity (meshtrain/data/tokens.py `vouched`).
Chat data (`--chat`, meshtrain/data/chat.py) adds a loss mask: `shard-00000.mask`, ..., one uint8 a
token (1: an assistant token, trained under data.train_on=assistant), hashed into `mask_sha256`.
Preference data (`--preference`, meshtrain/data/preference.py) is stored so too, two documents an
example (the response's tokens masked in), and `pairs.npy` locates each pair.
"""
from __future__ import annotations

import collections
import hashlib
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from meshtrain.core.console import log
from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_whole
from meshtrain.data import chat as chat_lib
from meshtrain.data import degenerate, store
from meshtrain.data import preference as preference_lib
from meshtrain.data import tokenizer as tokenizer_lib
from meshtrain.data.sources import RAW_KINDS, Unit, detect, read, units
from meshtrain.data.tokens import MANIFEST, MASK_SUFFIX, file_meta, sidecar, token_dtype, write_json

SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard


class Tokenized(NamedTuple):
    """A unit's documents as tokens: `ids`, each document followed by document_end(tok), in the token
    dtype; document i ends before ids[ends[i]]. `dropped`: the characters the tokenizer mapped to no
    token, with their counts, of `characters` (not whitespace) read; empty where it cannot drop any.
    `mask`: chat data's loss mask (uint8 a token, 1 on assistant turns; 0 on each document end), None
    for plain text."""
    ids: np.ndarray
    ends: np.ndarray
    characters: int = 0
    dropped: dict[str, int] = {}
    mask: np.ndarray | None = None
    faults: dict[str, list] = {}  # chat and preference rows that train nothing or the wrong thing (degenerate.py)


def tokenize(unit: Unit, tok, field: str, chat: chat_lib.ChatFormat | None = None,
             preference: bool = False) -> Tokenized:
    """`chat`: the unit's rows are conversations in `field`, rendered with this template.
    `preference`: the rows are preference pairs (rendered with `chat` where it is given)."""
    try:
        if preference:
            rows = list(read(unit, None, preference_lib.example_of, preference_lib.FIELDS))
        else:
            located = lambda value, name, where: (chat_lib.messages_of(value, name, where), where)
            rows = list(read(unit, field, located if chat else None))
    except OSError as e:  # unreadable (permissions, a vanished file): the user's to fix, named
        raise UserError(f"{unit.file} cannot be read ({e.strerror or e}); fix its permissions or remove it "
                        f"from the source") from None
    end, faults = tokenizer_lib.document_end(tok), {}
    if preference:
        texts, encoded, masks = zip(*preference_lib.encode(chat, tok, rows)) if rows else ((), (), ())
        faults = degenerate.pair_faults(rows, masks)
    elif chat:
        texts, encoded, masks = zip(*chat_lib.encode(chat, tok, [m for m, _ in rows])) if rows else ((), (), ())
        faults = degenerate.chat_faults(rows, masks)
    else:
        texts, masks, encoded = rows, None, tok.encode_batch(rows)
    if masks is not None:
        masks = [m for mask in masks for m in (mask, np.zeros(len(end), np.uint8))]
    pieces = [piece for ids in encoded for piece in (ids, end)]
    dtype = token_dtype(tok.vocab_size)
    characters, dropped = 0, {}
    if tok.may_drop:  # a tokenizer with no unknown token: count what it drops
        counts = collections.Counter()
        for text in texts:
            counts.update(text)
        characters = sum(n for c, n in counts.items() if not c.isspace())
        dropped = tok.dropped(counts)
    if not pieces:
        return Tokenized(np.zeros(0, dtype), np.zeros(0, np.int64), characters, dropped,
                         None if masks is None else np.zeros(0, np.uint8), faults)
    return Tokenized(np.concatenate(pieces).astype(dtype), np.cumsum([len(p) for p in pieces])[1::2], characters,
                     dropped, None if masks is None else np.concatenate(masks), faults)


class DroppedText:
    """What a tokenizer without an unknown token mapped to nothing, summed over units: an error at the
    first such character (the model would never see that text), or, where the user allows it, a
    warning with the counts at the end."""

    def __init__(self, tok, src: str, allowed: bool, how_to_allow: str):
        self.tok, self.src, self.allowed, self.how_to_allow = tok, src, allowed, how_to_allow
        self.characters, self.dropped = 0, collections.Counter()

    def add(self, part: Tokenized) -> None:
        self.characters += part.characters
        self.dropped.update(part.dropped)
        if self.dropped and not self.allowed:
            raise UserError(f"{self.summary()} of what was read so far; use a tokenizer that covers this text (a "
                            f"byte-level BPE: python -m meshtrain.data train-tokenizer), or {self.how_to_allow}")

    def summary(self) -> str:
        n = sum(self.dropped.values())
        common = ", ".join(f"{c!r} x {k:,}" for c, k in self.dropped.most_common(3))
        return (f"tokenizer {self.tok.name} has no unknown token: it maps {n:,} characters of {self.src} to no "
                f"token ({n / max(self.characters, 1):.2%}; most often {common})")

    def warn(self) -> None:
        if self.dropped:
            log.warning(f"{self.summary()}; they are left out of the tokens")


def tokenized(parts: list[Unit], tok, field: str, workers: int, chat=None,
              preference: bool = False) -> Iterator[Tokenized]:
    """`tokenize` of each unit, in order; units spread over `workers` processes."""
    workers = min(workers, len(parts))
    if workers <= 1:
        yield from (tokenize(u, tok, field, chat, preference) for u in parts)
        return
    # spawn, not fork: the parent may hold JAX's or the tokenizer's threads, which fork would copy
    # mid-work. An executor, not multiprocessing.Pool: leaving a Pool on an error (a unit without the
    # text field) terminates its workers, and one killed while it sends its result holds the result
    # queue's lock forever: the pool's own threads then wait on it and `prepare` hangs (seen in the
    # suite). On an error, or when the caller stops reading, `map` cancels the units still queued and
    # the executor waits for the few its workers hold (at most workers + 1) and never kills one.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start_worker, initargs=(tok, field, chat, preference)) as pool:
        yield from pool.map(_tokenize_in_worker, parts)  # in order


_worker: tuple = ()  # (tokenizer, field, chat format, preference) in a worker process


def _start_worker(tok, field: str, chat, preference: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    global _worker
    _worker = (tok, field, chat, preference)


def _tokenize_in_worker(unit: Unit):
    return tokenize(unit, *_worker)


class ShardWriter:
    """Appends a token stream to shards of `shard_tokens` tokens (the last one shorter); a document
    may continue into the next shard and counts in the one holding its end. Chat data's loss mask
    goes to a `.mask` file beside each shard, byte for token."""

    def __init__(self, out: Path, tok, shard_tokens: int):
        self.out, self.tok, self.shard_tokens = out, tok, shard_tokens
        self.shards: list[dict] = []  # the manifest's rows
        self.file, self.tokens, self.documents = None, 0, 0  # the open shard
        self.sha256, self.shard_sha256 = hashlib.sha256(), hashlib.sha256()  # the stream's, the open shard's
        self.masked: bool | None = None  # whether the units carry a mask (all or none do)
        self.mask_file, self.mask_sha256 = None, hashlib.sha256()  # the open shard's mask, the mask stream's
        self.trained = 0  # tokens the mask trains

    def add(self, ids: np.ndarray, ends: np.ndarray, mask: np.ndarray | None = None) -> None:
        if self.masked is None:
            self.masked = mask is not None
        assert self.masked == (mask is not None), "a prepared folder's units all carry a mask or none does"
        at = 0
        while at < len(ids):
            if self.file is None:
                self.file = open(self.out / f"shard-{len(self.shards):05d}.bin", "wb")
                if self.masked:
                    self.mask_file = open(self.out / f"shard-{len(self.shards):05d}{MASK_SUFFIX}", "wb")
            take = min(len(ids) - at, self.shard_tokens - self.tokens)
            piece = ids[at:at + take].tobytes()
            self.file.write(piece)
            self.sha256.update(piece)
            self.shard_sha256.update(piece)
            if self.masked:
                self.mask_file.write(mask_piece := mask[at:at + take].astype(np.uint8).tobytes())
                self.mask_sha256.update(mask_piece)
                self.trained += int(np.count_nonzero(mask[at:at + take]))
            self.documents += int(np.count_nonzero((ends > at) & (ends <= at + take)))
            self.tokens, at = self.tokens + take, at + take
            if self.tokens == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        path = Path(self.file.name)
        self.file.close()
        if self.mask_file is not None:
            self.mask_file.close()
            self.mask_file = None
        sha256 = self.shard_sha256.hexdigest()
        write_json(sidecar(path), {**file_meta(self.tok, self.tokens, self.documents), "sha256": sha256})
        self.shards.append({"file": path.name, "tokens": self.tokens, "documents": self.documents, "sha256": sha256})
        self.file, self.tokens, self.documents, self.shard_sha256 = None, 0, 0, hashlib.sha256()

    def close(self) -> list[dict]:
        if self.file is not None:
            self._finish()
        return self.shards


def prepare(src: str, tok, out: str | Path, workers: int = 1, text_field: str = "text",
            shard_tokens: int = SHARD_TOKENS, kind: str = "auto", allow_dropped_text: bool = False,
            chat: chat_lib.ChatFormat | None = None, preference: bool = False, stage: str | None = None, *,
            allow_degenerate: bool = False) -> dict:
    """Tokenize `src` (a raw source: text, jsonl, Parquet, datasets folder) into the empty or new
    folder `out`, or an object-store URI (written in a local folder under `stage`, then uploaded:
    meshtrain/data/store.py); returns the manifest. Text the tokenizer maps to no token is an error unless
    `allow_dropped_text` (then a warning with the counts). `chat`: rows are conversations in
    `text_field`, rendered with this format, and a loss mask is written beside the tokens.
    `preference`: jsonl rows are preference pairs (meshtrain/data/preference.py). Chat and preference rows
    that train nothing or the wrong thing are an error unless `allow_degenerate` (meshtrain/data/degenerate.py)."""
    kind, parts = source_units(src, kind, shard_tokens, workers)
    with store.staged(out, stage) as local:
        return write_prepared(tokenized(parts, tok, text_field, workers, chat, preference), src, kind, tok,
                              local, text_field, shard_tokens, allow_dropped_text, chat, preference,
                              allow_degenerate=allow_degenerate)


def source_units(src: str, kind: str, shard_tokens: int, workers: int = 1) -> tuple[str, list[Unit]]:
    """(the source's kind, its units in document order), once the source and settings are checked."""
    kind = detect(src, kind)
    if kind not in RAW_KINDS:
        raise UserError(f"{src} holds {kind}, not documents; prepare reads text, jsonl, Parquet or a "
                        f"datasets save_to_disk folder")
    if shard_tokens < 1 or workers < 1:
        raise UserError(f"--shard-tokens {shard_tokens} and --workers {workers} must be >= 1")
    return kind, units(kind, src)


def check_documents(src, tokens: int, documents: int, tok) -> None:
    """One UserError where the source holds no document, or only empty ones (each would be its start
    and end tokens alone: nothing to learn)."""
    if not documents:
        raise UserError(f"{src} holds no documents; pass a source with text in it")
    empty = len(tok.encode_batch([""])[0]) + len(tokenizer_lib.document_end(tok))  # a start token, if any
    if tokens == documents * empty:
        raise UserError(f"{src} holds {documents:,} document(s), all empty: only their end tokens would be "
                        f"trained; pass a source with text in it")


def write_prepared(parts: Iterable[Tokenized], src: str, kind: str, tok, out: str | Path, text_field: str,
                   shard_tokens: int, allow_dropped_text: bool, chat: chat_lib.ChatFormat | None = None,
                   preference: bool = False, *, allow_degenerate: bool = False) -> dict:
    """The prepared folder `out` (shards, tokenizer, manifest written last) of the units' tokens
    `parts`, in order, whichever engine made them (`tokenized` here, meshtrain/data/cluster.py on
    Ray): written whole or not at all (writing_whole), `out` checked before the first part is asked
    for. Returns the manifest."""
    dropped = DroppedText(tok, src, allow_dropped_text, "pass --allow-dropped-text to prepare it without them")
    faults = degenerate.Degenerate(src, allow_degenerate)
    with writing_whole(out, "--out") as tmp:
        writer = ShardWriter(tmp, tok, shard_tokens)
        ends = []  # preference data: every document's end in the stream
        try:
            for part in parts:
                dropped.add(part)
                faults.add(part.faults)
                ends.append(part.ends + sum(s["tokens"] for s in writer.shards) + writer.tokens)
                writer.add(part.ids, part.ends, part.mask)
            shards = writer.close()
        finally:
            for file in (writer.file, writer.mask_file):
                if file is not None:
                    file.close()
        check_documents(src, sum(s["tokens"] for s in shards), sum(s["documents"] for s in shards), tok)
        dropped.warn()
        faults.warn()
        if writer.masked:
            degenerate.check_trained(src, writer.trained, "pairs' responses" if preference else "assistant turns")
        tokenizer_lib.record(tmp, tok)
        manifest = {**file_meta(tok, sum(s["tokens"] for s in shards), sum(s["documents"] for s in shards)),
                    "source": {"path": str(src), "kind": kind, "text_field": text_field,
                               **({"chat_template": chat.name} if chat else {}),
                               **({"preference": True} if preference else {})},
                    "sha256": writer.sha256.hexdigest(), "shards": shards}
        if writer.masked:  # chat data: the loss mask's own hash (the data's identity covers both)
            manifest.update(mask_sha256=writer.mask_sha256.hexdigest(), trained_tokens=writer.trained)
        if preference:
            manifest.update(preference_lib.write_pairs(tmp, np.concatenate(ends)))
        write_json(tmp / MANIFEST, manifest)
    return manifest
