"""`prepare --ray ADDRESS`: prepare's units tokenized by Ray tasks on a cluster's nodes, the same shards.

Each unit (meshtrain/data/sources.py: a file, a jsonl byte range, a Parquet row group, a run of Arrow
batches) is one Ray task, placed by Ray on any node with a free CPU: it reads and tokenizes the unit
(prepare.py `tokenize`) and writes the result into the work folder `.DIR.units` beside DIR, written
whole (a temporary file renamed). The driver takes the results in unit order and appends them to
the shards through prepare.py's `write_prepared`, the one-host code, so the shards, manifest and
content hash are the one-host prepare's byte for byte. DIR appears only complete (writing_whole);
the work folder is removed once it does.

Chat data (`--chat`) and preference pairs (`--preference`) are tokenized so too, each result holding
its loss mask beside the tokens; the driver writes the masks and `pairs.npy` as the one-host prepare does.

Resuming: a result's file name is a hash of everything it was made from (the unit, its file's size
and mtime, the tokenizer, the text field, the chat template and whether the rows are pairs), so a
rerun of the same command after a kill (a lost node, Ctrl-C, a bad file since fixed) reuses every
result still valid and tokenizes only the rest; results of changed files are removed. Nodes need the
source, the tokenizer and DIR's parent on a shared filesystem (the tasks read and write there), and
meshtrain installed, as for `ray_launch`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshtrain.core.console import duration, log
from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_file
from meshtrain.core.ray_cluster import connected
from meshtrain.data import store
from meshtrain.data.chat import ChatFormat
from meshtrain.data.prepare import SHARD_TOKENS, Tokenized, source_units, tokenize, write_prepared
from meshtrain.data.sources import Unit

FORMAT = 3  # of a unit's result file (`_tokenize_unit` writes it, `_load` reads it): bump when it changes
PROGRESS_S = 10.0  # seconds between the driver's progress lines


def prepare_on_ray(src: str, tok, out: str | Path, address: str = "auto", text_field: str = "text",
                   shard_tokens: int = SHARD_TOKENS, kind: str = "auto", allow_dropped_text: bool = False,
                   chat: ChatFormat | None = None, preference: bool = False, stage: str | None = None, *,
                   allow_degenerate: bool = False) -> dict:
    """prepare.py `prepare` (its `chat` and `preference` too, `out` a folder or an object-store URI
    staged under `stage`), its units tokenized on the Ray cluster at `address` (auto: the running
    one; local: one started on this machine; the one this process is connected to, if any). Returns
    the manifest."""
    kind, parts = source_units(src, kind, shard_tokens)
    with store.staged(out, stage) as local:
        work = work_folder(local)
        with connected(address, "--ray", logging_level=logging.WARNING):  # not Ray's start-up lines
            manifest = write_prepared(ray_tokenized(parts, tok, text_field, work, out, chat, preference), src, kind,
                                      tok, local, text_field, shard_tokens, allow_dropped_text, chat, preference,
                                      allow_degenerate=allow_degenerate)
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def work_folder(out: str | Path) -> Path:
    """Where the units' results wait: beside `out` (in its first existing parent, as writing_whole's
    temporary folder), hidden."""
    out = Path(out).absolute()
    return next(p for p in out.parents if p.is_dir()) / f".{out.name}.units"


def ray_tokenized(parts: list[Unit], tok, field: str, work: Path, out, chat: ChatFormat | None = None,
                  preference: bool = False) -> Iterator[Tokenized]:
    """`tokenize` of each unit, in order, by Ray tasks (at most a few per CPU of the cluster ahead of
    the one the driver waits for); results already in `work` are reused. A task's UserError is
    raised as it is, once the tasks still out have ended; on a Ctrl-C they are left running (their
    results land in `work` for a rerun; Ray ends them with the driver). None is cancelled: a
    `ray.cancel` that races a task's reply aborts the driver (Ray 2.60, "Check failed: it !=
    submissible_tasks_.end() Tried to complete task that was not pending")."""
    import ray

    names = [f"unit-{i:07d}-{key}.npz" for i, key in enumerate(unit_keys(parts, tok, field, chat, preference))]
    lock = _claim(work, set(names), out)
    done = [(work / n).is_file() for n in names]
    if any(done):
        log.info(f"resuming {out}: {sum(done):,} of {len(parts):,} units were tokenized by an earlier run; "
                 f"tokenizing the other {len(parts) - sum(done):,}")
    task = ray.remote(_tokenize_unit).options(num_cpus=1)
    tok_ref, ahead = ray.put((tok, chat, preference)), max(4, 2 * int(ray.cluster_resources().get("CPU", 1)))
    todo = iter([i for i in range(len(parts)) if not done[i]])
    refs: dict[int, object] = {}
    progress = Progress(parts, done)
    try:
        for i in range(len(parts)):
            while len(refs) < ahead and (j := next(todo, None)) is not None:
                refs[j] = task.remote(parts[j], tok_ref, field, str(work / names[j]))
            if i in refs:
                _result(refs.pop(i))
            part = _load(work / names[i])
            progress.add(i, part)
            yield part
        progress.line()
    except BaseException as stop:
        if refs and not isinstance(stop, KeyboardInterrupt):  # an error: the tasks out end first, so none
            ray.wait(list(refs.values()), num_returns=len(refs))  # writes into `work` after this returns
            refs.clear()
        raise
    finally:
        os.close(lock)
        if not refs and not any(work.iterdir()):
            work.rmdir()  # nothing to resume from, and no task out that would write there


def unit_keys(parts: list[Unit], tok, field: str, chat: ChatFormat | None = None,
              preference: bool = False) -> list[str]:
    """A hash per unit of what its result is made from: the unit, its file's size and mtime, the
    tokenizer (its file's bytes, vocabulary and EOS), the text field, the chat template (its text and
    special tokens) and whether the rows are preference pairs."""
    tok_file = tok.path
    made_with = [FORMAT, tok.name, tok.vocab_size, tok.eos_id, field,
                 hashlib.sha256(Path(tok_file).read_bytes()).hexdigest() if tok_file else None,
                 None if chat is None else [chat.template, sorted(chat.specials.items())], preference]
    stats = {f: os.stat(f) for f in {u.file for u in parts}}
    return [hashlib.sha256(json.dumps([*made_with, u.kind, u.file, u.lo, u.hi, stats[u.file].st_size,
                                       stats[u.file].st_mtime_ns]).encode()).hexdigest()[:20] for u in parts]


def _claim(work: Path, keep: set[str], out) -> int:
    """The work folder, created or resumed and locked (flock) by this driver: returns the lock. What
    no current unit uses (results of changed files, a killed task's temporary file) is removed."""
    work.mkdir(exist_ok=True)
    lock = os.open(work, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise UserError(f"another prepare is writing {out} (its work folder {work} is locked); wait for it to "
                        f"finish or pick another --out") from None
    for f in work.iterdir():  # a task still out from a Ctrl-C'd run may add or remove files meanwhile,
        if f.name not in keep and f.is_file():  # and its writable() probe is a folder it removes itself
            f.unlink(missing_ok=True)
    return lock


def _tokenize_unit(unit: Unit, how: tuple, field: str, path: str) -> None:
    """A Ray task: the unit's tokens (and loss mask), saved whole at `path`; `how`: (the tokenizer,
    the chat format or None, whether the rows are preference pairs)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per task: the tasks are the parallelism
    tok, chat, preference = how
    part = tokenize(unit, tok, field, chat, preference)
    mask = {} if part.mask is None else {"mask": part.mask}
    with writing_file(path, "the unit's result", force=True) as tmp, open(tmp, "wb") as f:  # a full disk: one line
        np.savez(f, ids=part.ids, ends=part.ends, **mask,
                 counts=np.array(json.dumps({"characters": part.characters, "dropped": part.dropped,
                                             "faults": part.faults})))


def _load(path: Path) -> Tokenized:
    with np.load(path) as saved:
        counts = json.loads(str(saved["counts"]))
        return Tokenized(saved["ids"], saved["ends"], counts["characters"], counts["dropped"],
                         saved["mask"] if "mask" in saved.files else None, counts["faults"])


def _result(ref) -> None:
    """Wait for a task; its UserError (a bad file) is raised as it is, not wrapped by Ray."""
    import ray

    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserError):
            raise e.cause from None
        raise


class Progress:
    """The driver's progress line every PROGRESS_S seconds: units, documents and tokens so far, the
    source's bytes/s and the ETA at the pace of the units tokenized by this run (a resumed unit's
    result is only read)."""

    def __init__(self, parts: list[Unit], done: list[bool]):
        self.sizes = unit_bytes(parts)
        self.fresh = [not d for d in done]
        self.left = sum(s for s, f in zip(self.sizes, self.fresh) if f)
        self.units = self.documents = self.tokens = self.fresh_bytes = 0
        self.started = self.shown = time.perf_counter()

    def add(self, i: int, part: Tokenized) -> None:
        self.units, self.documents, self.tokens = self.units + 1, self.documents + len(part.ends), \
            self.tokens + len(part.ids)
        if self.fresh[i]:
            self.fresh_bytes, self.left = self.fresh_bytes + self.sizes[i], self.left - self.sizes[i]
        if time.perf_counter() - self.shown >= PROGRESS_S and self.units < len(self.sizes):  # the last: `line`
            self.line()

    def line(self) -> None:
        self.shown = time.perf_counter()
        seconds = max(self.shown - self.started, 1e-9)
        rate = self.fresh_bytes / seconds
        eta = f", ETA {duration(self.left / rate)}" if rate and self.left else ""
        log.info(f"prepare: {self.units:,} of {len(self.sizes):,} units, {self.documents:,} documents, "
                 f"{self.tokens:,} tokens, {self.tokens / seconds:,.0f} tokens/s, {rate / 1e6:,.2f} MB/s{eta}")


def unit_bytes(parts: list[Unit]) -> list[int]:
    """Each unit's share of the source's bytes: a jsonl unit's byte range; otherwise its file's size
    over the units of that file (for the rate and the ETA)."""
    per_file: dict[str, int] = {}
    for u in parts:
        per_file[u.file] = per_file.get(u.file, 0) + 1
    return [u.hi - u.lo if u.kind == "jsonl" else os.stat(u.file).st_size // per_file[u.file] for u in parts]
