"""Mixtures: several sources, each row of a batch taken from one of them in proportion to its weight.

    data:
      sources:
        - {path: data/web, weight: 3}                          # a prepared folder
        - {path: data/code.jsonl, weight: 1, text_field: content}

Which source row r of batch k comes from is position g = k x batch_size + r of Grain's
`MapDataset.mix` over the sources (grain/_src/python/dataset/transformations/mix.py): a fixed
interleaving by the weights, read by position, with no seed and no state. Grain makes the weights
integer proportions (the smallest 100, so ratios hold to 1% of the smallest weight) and keeps every
source's share in every run of consecutive positions to within a few rows (2.3 at most for 2 to 5
random weights, tests/test_mixture.py): each batch holds the weights' shares up to rounding. The
row's window is then drawn as a single source's is (meshtrain/data/batches.py): its start uniform
over the source's training tokens, from `np.random.default_rng([seed, split, k])`. So the rows of
step k depend only on (seed, split, k): not on the mesh, the process that builds them, or resuming.
Each process builds only the rows its devices hold.

Each source holds out its own tail (data.val_fraction). Eval measures every source on its own
held-out windows (`eval_loss_<name>`, train.eval_batches batches each) and `eval_loss` is their
mean weighted by the shares: the loss the mixture expects. Source names come from the paths
(`names`). A config without data.sources is the one source data.path: a mixture of one, whose
batches and identity are exactly a single source's.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.data import store
from meshtrain.data.batches import Batches, split_tokens
from meshtrain.data.corpus import load_corpus
from meshtrain.data.sources import KINDS
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.data.tokens import MANIFEST

ENTRY_KEYS = ("path", "weight", "kind", "text_field")  # an entry's own keys; kind, text_field default to data.'s
MAX_WEIGHT_RATIO = 1e6  # Grain scales the smallest weight to 100 and makes integers of the rest


@dataclass(frozen=True)
class Source:
    name: str  # from the path, unique in the mixture: metrics' share_<name>, eval_loss_<name>
    path: str
    kind: str
    text_field: str
    weight: float
    share: float  # weight / the weights' sum


def sources(dcfg) -> list[Source]:
    """The sources of `dcfg` (the DataConfig): data.sources' entries, each checked, or the one source
    data.path. Every mistake is a UserError naming the entry and the fix."""
    if not dcfg.sources:
        name = "synthetic" if dcfg.kind == "synthetic" else names([dcfg.path])[0]
        return [Source(name, dcfg.path, dcfg.kind, dcfg.text_field, 1.0, 1.0)]
    if dcfg.path:
        raise UserError(f"data.path={dcfg.path!r} and data.sources are both set; put the path into data.sources "
                        f"as {{path: {dcfg.path}, weight: ...}}, or drop data.sources")
    if dcfg.kind == "synthetic":
        raise UserError("data.kind=synthetic has no tokens to mix; drop data.sources, or set data.kind=auto")
    entries = [_entry(i, e, dcfg) for i, e in enumerate(dcfg.sources)]
    paths = [os.path.normpath(e["path"]) if e["path"] and not store.is_uri(e["path"]) else e["path"]
             for e in entries]
    for i, p in enumerate(paths):
        if p in paths[:i]:
            raise UserError(f"data.sources[{i}] repeats data.sources[{paths.index(p)}]'s path {entries[i]['path']!r}; "
                            f"give each source once, with the weight of both")
    weights = [e["weight"] for e in entries]
    if max(weights) > MAX_WEIGHT_RATIO * min(weights):
        raise UserError(f"data.sources' weights range from {min(weights):g} to {max(weights):g}; keep the largest "
                        f"within {MAX_WEIGHT_RATIO:g}x the smallest (a source's share is its weight / their sum)")
    total = math.fsum(weights)
    return [Source(n, e["path"], e["kind"], e["text_field"], e["weight"], e["weight"] / total)
            for n, e in zip(names(paths), entries)]


def _entry(i: int, entry, dcfg) -> dict:
    """One data.sources entry, checked, with data.kind / data.text_field where it sets none."""
    key = f"data.sources[{i}]"
    if not isinstance(entry, dict):
        raise UserError(f"{key}={entry!r} is not a mapping; write each source as {{path: ..., weight: ...}}")
    unknown = [str(k) for k in entry if k not in ENTRY_KEYS]
    if unknown:
        raise UserError(f"{key} has unknown key {unknown[0]!r}; its keys are {', '.join(ENTRY_KEYS)}")
    if "path" not in entry:
        raise UserError(f"{key} has no path; give each source one: {{path: FILE_OR_FOLDER, weight: ...}}")
    out = {"path": entry["path"], "weight": entry.get("weight", 1.0), "kind": entry.get("kind", dcfg.kind),
           "text_field": entry.get("text_field", dcfg.text_field)}
    for name in ("path", "kind", "text_field"):
        if not isinstance(out[name], str):
            raise UserError(f"{key}.{name}={out[name]!r} is not text; quote it")
    weight = out["weight"]
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    out["weight"] = float(weight) if number and abs(weight) <= sys.float_info.max else math.nan  # not 10**400
    if not (math.isfinite(out["weight"]) and out["weight"] > 0):
        raise UserError(f"{key}.weight={weight!r} must be a finite number > 0 (a source's share is its weight / "
                        f"the weights' sum)")
    if out["kind"] == "synthetic" or out["kind"] not in KINDS:
        raise UserError(f"{key}.kind={out['kind']!r} is not one of {', '.join(k for k in KINDS if k != 'synthetic')}"
                        f" (synthetic data is a single source: data.kind=synthetic)")
    return out


def names(paths: list[str]) -> list[str]:
    """Short unique names for metrics: the last component of each path (a file without its suffix)
    if they tell the paths apart, else the folders above, one level at a time (web/train.bin and
    code/train.bin: web, code), else the whole paths joined by '_'. Characters other than letters,
    digits, '-' and '_' become '_'; the standard library ('') is stdlib."""
    parts = [Path(store.shown(p) if store.is_uri(p) else p).parts if p else ("stdlib",) for p in paths]
    clean = lambda pieces: re.sub(r"[^A-Za-z0-9_-]+", "_", "_".join(pieces)).strip("_") or "source"
    level = lambda p, back: Path(p[-1]).stem if back == 1 or len(p) == 1 else p[max(len(p) - back, 0)]
    for back in range(1, max(map(len, parts)) + 1):
        found = [clean([level(p, back)]) for p in parts]
        if len(set(found)) == len(found):
            return found
    found = [clean(p) for p in parts]
    return found if len(set(found)) == len(found) else [f"{n}_{i}" for i, n in enumerate(found)]


class Mixture(NamedTuple):
    sources: list[Source]
    tokens: list  # each source's `Tokens`; [None]: synthetic data (a single source)
    tokenizer: object | None  # the sources' one tokenizer; None: synthetic, or token files naming none
    kinds: tuple[str, ...] = ()  # what each source holds (tokens.DATA_KINDS)


def load(dcfg, vocab_size: int) -> Mixture:
    """Every source's token stream (corpus.load_corpus: memory-mapped where prepared) and their
    tokenizer, which must be one: a model reads one vocabulary."""
    found = sources(dcfg)
    corpora = [load_corpus(dataclasses.replace(dcfg, path=s.path, kind=s.kind, text_field=s.text_field, sources=[]),
                           vocab_size) for s in found]
    known = [(i, c.tokenizer) for i, c in enumerate(corpora) if c.tokenizer is not None]
    for i, tok in known[1:]:
        first, other = known[0]
        if not _same_tokenizer(tok, other):
            raise UserError(f"data.sources[{i}] ({found[i].path}) was tokenized by {tok.name} ({tok.vocab_size} ids), "
                            f"data.sources[{first}] ({found[first].path}) by {other.name} ({other.vocab_size} ids); "
                            f"a model reads one vocabulary: prepare every source with one tokenizer")
    return Mixture(found, [c.tokens for c in corpora], known[0][1] if known else None,
                   tuple(c.kind for c in corpora))


def trains_on_mask(dcfg) -> bool:
    """Whether training applies a loss mask: data.train_on=assistant and a source is a prepared
    folder of chat data (its manifest records a mask: meshtrain/data/prepare.py). Reads manifests only."""
    if dcfg.train_on != "assistant" or dcfg.kind == "synthetic":
        return False
    for s in sources(dcfg):
        if s.kind in ("auto", "prepared") and store.is_uri(s.path):
            if store.manifest(s.path).get("mask_sha256"):
                return True
            continue
        manifest = Path(s.path) / MANIFEST
        if s.kind in ("auto", "prepared") and manifest.is_file() and json.loads(manifest.read_text()).get(
                "mask_sha256"):
            return True
    return False


def _same_tokenizer(a, b) -> bool:
    if type(a) is not type(b) or (a.vocab_size, a.eos_id) != (b.vocab_size, b.eos_id):
        return False
    return isinstance(a, ByteTokenizer) or a.rust.to_str() == b.rust.to_str()  # copies in several folders


def batches(mix: Mixture, val_fraction: float, batch_size: int, seq_len: int, seed: int, sharding,
            vocab_size: int):
    """(training batches, {source name: validation batches}, empty without validation). One source:
    a plain `Batches` (split 0) and its held-out tail (split 1), as before mixtures existed."""
    make = lambda tokens, split: Batches(tokens, batch_size, seq_len, seed, split, sharding, vocab_size)
    if len(mix.sources) == 1:
        train, val = split_tokens(mix.tokens[0], val_fraction, seq_len)
        has_val = val_fraction > 0 or mix.tokens[0] is None
        return make(train, 0), ({mix.sources[0].name: make(val, 1)} if has_val else {})
    splits = []
    for i, (s, tokens) in enumerate(zip(mix.sources, mix.tokens)):
        try:
            splits.append(split_tokens(tokens, val_fraction, seq_len))
        except UserError as e:
            raise UserError(f"data.sources[{i}] ({s.path}): {e}") from None
    train = MixedBatches([t for t, _ in splits], mix.sources, batch_size, seq_len, seed, 0, sharding, vocab_size)
    return train, ({s.name: make(v, 1) for s, (_, v) in zip(mix.sources, splits)} if val_fraction > 0 else {})


def interleaving(weights: list[float]):
    """Grain's mix of one endless index per source, each element its source's number: position g
    -> the source of the g-th row of the mixed sequence."""
    import grain  # on first use: ~2 s to import, and a single source never needs it

    endless = sys.maxsize // 2
    parents = [grain.MapDataset.range(endless).map(lambda _, s=s: s) for s in range(len(weights))]
    return grain.MapDataset.mix(parents, weights)


class MixedBatches(Batches):
    """`batches(k)` -> step k's global [batch, seq_len + 1] array, each row a window of the source the
    interleaving gives its position k x batch_size + r. Each process builds only the rows it holds."""

    def __init__(self, parts, sources: list[Source], batch_size: int, seq_len: int, seed: int, split: int,
                 sharding, vocab_size: int):
        """`parts`: each source's training `Tokens`, in the order of `sources`."""
        super().__init__(None, batch_size, seq_len, seed, split, sharding, vocab_size)
        self.parts, self.sources = parts, sources
        self.highs_S = np.array([len(p) - seq_len - 1 for p in parts], np.int64)  # window starts < these
        self.order = interleaving([s.weight for s in sources])

    def sources_of(self, step: int, rows) -> np.ndarray:
        """The source of each of `rows` (global row numbers) of step k's batch."""
        return np.array([self.order[step * self.batch_size + int(r)] for r in rows], np.int64)

    def local_rows(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split, step])
        starts_SxB = rng.integers(0, self.highs_S[:, None], size=(len(self.parts), self.batch_size))
        source_N = self.sources_of(step, self.rows)
        rows_NxL = np.empty((len(self.rows), self.seq_len + 1), np.int32)
        for s in np.unique(source_N):
            mine = source_N == s
            rows_NxL[mine] = self.parts[s].windows(starts_SxB[s, self.rows[mine]], self.seq_len + 1)
        return self.checked(rows_NxL)

    def shares(self, step: int) -> dict[str, float]:
        """{'share_<name>': the fraction of step k's tokens from that source}: every row trains on
        seq_len tokens, so row shares are token shares."""
        counts_S = np.bincount(self.sources_of(step, range(self.batch_size)), minlength=len(self.sources))
        return {f"share_{s.name}": float(c / self.batch_size) for s, c in zip(self.sources, counts_S)}
