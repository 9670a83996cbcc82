"""Token files and token streams.

- A token file is a flat array of ids (`shard-00000.bin`, nanoGPT's `train.bin`). Its dtype follows
  the vocabulary (`token_dtype`): uint16 up to 65,536 ids, uint32 above. A sidecar `<file>.json`
  records dtype, tokenizer, vocabulary, EOS id, documents and tokens; a file without one is read
  as uint16 (nanoGPT's files).
- A prepared folder holds token files and `manifest.json` (the sidecar's fields for the whole corpus,
  its source, and the shards in order); `python -m meshtrain.data prepare` writes it.
- `Tokens` is one stream over several arrays (memory-mapped shards, or arrays in memory), read by
  windows; slicing it makes views, so a corpus is never loaded into memory.
- Content hash: `Tokens.sha256()` is the sha256 of the stream's bytes (meshtrain/data/digest.py).
  `prepare` writes it into the manifest (the whole stream's) and each sidecar (its shard's), and a
  reader takes it from there while no file it describes changed after it was written (a file's
  ctime later than the description's: the file is hashed again, through digest.py's cache).
- Loss masks (chat data, meshtrain/data/chat.py): a prepared folder may hold a `.mask` file beside
  each shard, a uint8 a token (1: trained). A masked stream's windows carry the mask in the ids
  themselves: an untrained token is stored as ~id = -1 - id (`with_mask`), so every executor moves
  it with the tokens; `token_ids` recovers the ids and a target < 0 adds no loss
  (meshtrain/ops/loss.py). Its content hash covers both streams (`Tokens.sha256`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from meshtrain.core import schema
from meshtrain.core.errors import UserError
from meshtrain.core.folders import replace_file
from meshtrain.data import digest

MANIFEST = "manifest.json"
MASK_SUFFIX = ".mask"  # a shard's loss mask: shard-00000.mask beside shard-00000.bin
PLAIN_DTYPE = np.dtype(np.uint16)  # a token file without a sidecar, as nanoGPT writes them
# What the readers use of a sidecar and of a manifest (meshtrain/core/schema.py); prepare writes more.
DTYPES = ("uint16", "uint32")
SIDECAR_SCHEMA = {"dtype": DTYPES, "tokens": schema.Optional(schema.Int()), "tokenizer": str,
                  "vocab_size": schema.Int(1, 1 << 32), "sha256": schema.Optional(str)}
# What a source holds, as an objective reads it (meshtrain/objectives/base.py `Objective.reads`).
DATA_KINDS = {"synthetic": "synthetic tokens", "plain": "plain text",
              "chat": "chat conversations (prepared with --chat)",
              "preference": "preference pairs (prepared with --preference)",
              "prompts": "prompts (prepared with --prompts)"}


def prepared_kind(manifest: dict) -> str:
    """What a prepared folder holds, from its manifest: preference pairs, chat data (a loss mask), or
    plain text."""
    return "preference" if "pairs" in manifest else "chat" if manifest.get("mask_sha256") else "plain"


MANIFEST_SCHEMA = {"dtype": DTYPES, "tokens": schema.Int(), "sha256": schema.Optional(str),
                   "shards": [{"file": schema.Name(), "tokens": schema.Int()}],
                   "mask_sha256": schema.Optional(str)}


def with_mask(ids, mask):
    """int32 ids with the loss mask folded in: a token with mask 0 becomes ~id (< 0)."""
    ids = np.asarray(ids, np.int32)
    return np.where(np.asarray(mask) > 0, ids, ~ids)


def token_ids(rows):
    """The ids of `with_mask`'s rows (numpy or jax int32): ~x for x < 0, i.e. x ^ (x >> 31)."""
    return rows ^ (rows >> 31)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids 0 .. vocab_size - 1 (uint16 or uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def file_meta(tok, tokens: int, documents: int) -> dict:
    """A token file's (or a whole prepared corpus's) description: what a sidecar holds."""
    return {"dtype": token_dtype(tok.vocab_size).name, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "documents": documents, "tokens": tokens}


def write_json(path: Path, obj: dict) -> None:
    """Written whole or not at all (a reader never sees half a manifest)."""
    replace_file(path, json.dumps(obj, indent=1) + "\n")


def _read_json(path: Path, kind: dict) -> dict:
    """A sidecar or manifest, checked against its schema."""
    return schema.read_json(path, kind, "prepare the data again")


def read_token_file(path: Path, meta: dict | None = None) -> tuple[np.memmap, dict | None]:
    """(memory-mapped ids, sidecar or None). `meta`: the description if the caller has it."""
    path = Path(path)
    meta = meta if meta is not None else (_read_json(sidecar(path), SIDECAR_SCHEMA) if sidecar(path).is_file()
                                          else None)
    dtype = np.dtype(meta["dtype"]) if meta else PLAIN_DTYPE
    if not path.is_file():
        raise UserError(f"token file {path} is not a file; pass a .bin token file, or set data.kind")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise UserError(f"token file {path} has {size} bytes, not a whole number of {dtype.itemsize}-byte "
                        f"({dtype.name}) tokens; write it as a flat {dtype.name} array (numpy's tofile) or "
                        f"prepare the data again")
    if meta and "tokens" in meta and size != meta["tokens"] * dtype.itemsize:
        raise UserError(f"token file {path} has {size // dtype.itemsize:,} tokens, its description says "
                        f"{meta['tokens']:,}; prepare the data again")
    return np.memmap(path, dtype=dtype, mode="r"), meta


def token_stream(path: Path) -> tuple[Tokens, dict | None]:
    """(the stream of one token file, its sidecar or None), its hash the sidecar's where it holds one."""
    part, meta = read_token_file(path)
    return Tokens([part], [path], vouched(meta, sidecar(path), [path])), meta


def read_prepared(folder: Path) -> tuple[Tokens, dict]:
    """(the corpus's token stream, its manifest) of a prepared folder; the shards stay on disk."""
    if not (Path(folder) / MANIFEST).is_file():
        raise UserError(f"{folder} is not a prepared folder (no {MANIFEST}); write one with python -m "
                        f"meshtrain.data prepare, or set data.kind")
    manifest = _read_json(Path(folder) / MANIFEST, MANIFEST_SCHEMA)
    files = [Path(folder) / s["file"] for s in manifest["shards"]]
    parts = [read_token_file(f, {"dtype": manifest["dtype"], "tokens": s["tokens"]})[0]
             for f, s in zip(files, manifest["shards"])]
    check_sha256(Path(folder), manifest, str(folder), "prepare the data again")  # sizes checked: now the bytes
    tokens = Tokens(parts, files, manifest.get("sha256"))
    if manifest.get("mask_sha256") is not None:
        mask_files = [f.with_suffix(MASK_SUFFIX) for f in files]
        masks = [read_token_file(f, {"dtype": "uint8", "tokens": s["tokens"]})[0]
                 for f, s in zip(mask_files, manifest["shards"])]
        tokens.masks = Tokens(masks, mask_files, manifest["mask_sha256"])
    return tokens, manifest


def check_sha256(folder: Path, manifest: dict, where: str, fix: str, read=digest.files_sha256) -> None:
    """Every byte a run reads is a byte prepare hashed: the shards' stream (and the loss mask's) against
    the manifest's sha256, read once per version of the files (`read`: digest.py's cache; a fresh copy
    passes digest.read_sha256). A mismatch names the shard (its own sha256, the manifest's row). A
    manifest written before prepare recorded hashes vouches for nothing and is not checked."""
    bins = [folder / s["file"] for s in manifest["shards"]]
    streams = [(bins, manifest.get("sha256"), [s.get("sha256") for s in manifest["shards"]])]
    if manifest.get("mask_sha256") is not None:
        streams.append(([b.with_suffix(MASK_SUFFIX) for b in bins], manifest["mask_sha256"], []))
    for files, sha256, each in streams:
        if sha256 is None:
            continue
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise UserError(f"{where}: {MANIFEST}'s sha256 must be 64 hex digits, not {schema.shown(sha256)}; {fix}")
        if read(files) == sha256:
            continue
        bad = next((f.name for f, h in zip(files, each) if h and digest.read_sha256([f]) != h), None)
        what = bad or f"the {files[0].suffix} files"
        raise UserError(f"{where}: the bytes of {what} are not the ones prepare wrote (their sha256 is not the one "
                        f"{MANIFEST} records: changed since); {fix}")


def vouched(meta: dict | None, described_in: Path, files: list[Path]) -> str | None:
    """The sha256 a sidecar or manifest (`meta`, read from `described_in`) records for `files`, if it
    records one and no file changed after it was written; else None (the files are hashed)."""
    sha256 = (meta or {}).get("sha256")
    if sha256 is None:
        return None  # written before prepare recorded hashes
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise UserError(f"{described_in}: sha256 must be 64 hex digits, not {schema.shown(sha256)}; prepare the "
                        f"data again")
    written = os.stat(described_in).st_ctime_ns
    return sha256 if all(os.stat(f).st_ctime_ns <= written for f in files) else None


class Tokens:
    """A token stream: `parts` (1-D integer arrays) one after another. `files`: the files the parts
    are, whole and in order (a token file, a prepared folder's shards), hashed through the cache;
    `sha256`: their hash where a sidecar or manifest vouches for it. `masks`: the loss mask, a
    uint8 `Tokens` of the same length, or None (every token trained)."""

    def __init__(self, parts, files=(), sha256: str | None = None, masks: Tokens | None = None):
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)  # where each part ends
        self.files, self._sha256, self.masks = list(files), sha256, masks

    def sha256(self) -> str:
        """sha256 of the stream's bytes (its files', or its parts' in memory), computed once; with a
        mask, the sha256 of the two streams' hashes ("<tokens>:<mask>")."""
        if self._sha256 is None:
            self._sha256 = digest.files_sha256(self.files) if self.files else digest.arrays_sha256(self.parts)
        if self.masks is None:
            return self._sha256
        return hashlib.sha256(f"{self._sha256}:{self.masks.sha256()}".encode()).hexdigest()

    def unmasked(self) -> Tokens:
        """The stream without its loss mask (data.train_on=all): every token trained."""
        return Tokens(self.parts, self.files, self._sha256)

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype if self.parts else PLAIN_DTYPE

    def __len__(self) -> int:
        return int(self.ends[-1]) if self.parts else 0

    def __getitem__(self, s: slice) -> Tokens:
        """A contiguous slice (views of the parts)."""
        lo, hi, step = s.indices(len(self))
        assert step == 1, "token streams slice contiguously"
        starts = self.ends - [len(p) for p in self.parts]
        return Tokens([p[max(lo - a, 0):max(hi - a, 0)] for p, a in zip(self.parts, starts)],
                      masks=None if self.masks is None else self.masks[s])

    def windows(self, starts_N: np.ndarray, length: int) -> np.ndarray:
        """[N, length] int32: the stream's `length` tokens from each start (across part boundaries),
        untrained tokens as ~id where the stream has a mask (`with_mask`)."""
        if self.masks is not None:
            return with_mask(self.unmasked().windows(starts_N, length), self.masks.windows(starts_N, length))
        if len(self.parts) == 1:
            return np.asarray(self.parts[0][starts_N[:, None] + np.arange(length)[None, :]], np.int32)
        out_NxL = np.empty((len(starts_N), length), np.int32)
        for n, start in enumerate(starts_N):
            i, filled = int(np.searchsorted(self.ends, start, side="right")), 0
            while filled < length:
                offset = start + filled - (self.ends[i] - len(self.parts[i]))
                piece = self.parts[i][offset:offset + length - filled]
                out_NxL[n, filled:filled + len(piece)] = piece
                filled, i = filled + len(piece), i + 1
        return out_NxL

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole stream in memory: for small streams (tests, decoding a sample)."""
        whole = np.concatenate(self.parts) if self.parts else np.zeros(0, np.uint16)
        return whole if dtype is None else whole.astype(dtype)
