"""Prepared folders in object stores: `prepare --out URI` uploads one, `data.path: URI` trains on one.

A URI is anything pyarrow's `FileSystem.from_uri` resolves (s3://, gs://, abfs://, hdfs://, file://),
query options included (`s3://bucket/web?endpoint_override=host:9000&scheme=http`).
- Writing (`staged`): prepare writes the folder locally, in a staging folder, with the one-host or
  Ray code (so the same bytes and content hash), then `upload`s it: each shard's data, then its
  sidecar (which names the shard's sha256), and manifest.json LAST, so a prefix without a manifest is
  never taken as prepared data. A rerun after a kill prepares again and skips every shard whose
  sidecar is up as written and whose files have their sizes; a prefix holding a manifest is refused,
  as a non-empty local --out is.
- Reading (`cached`): the prefix is copied once into the local cache, `data.cache_dir/<content hash>`
  (default ~/.cache/meshtrain/data), checked against the manifest (every shard there with its size,
  the stream's sha256 and the mask's), then memory-mapped as a local prepared folder. Each process
  keeps its own copy; processes sharing a cache folder share one.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np

from meshtrain.core import exits, schema, waits
from meshtrain.core.console import log
from meshtrain.core.errors import UserError, first_line
from meshtrain.core.folders import full_disk_is_user_error, is_full_disk, remove_abandoned, writable
from meshtrain.core.folders import local as local_path
from meshtrain.data import digest
from meshtrain.data.tokens import MANIFEST, MANIFEST_SCHEMA, MASK_SUFFIX, check_sha256, sidecar

T = TypeVar("T")
CHUNK = 8 << 20  # bytes a read or write moves
FIX = ("check the URI, that the store is reachable from here, and its credentials (AWS_ACCESS_KEY_ID and "
       "AWS_SECRET_ACCESS_KEY for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://, ...)")


def is_uri(path) -> bool:
    """Whether `path` names a store (scheme://...) rather than a local file or folder."""
    return bool(re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", str(path or "")))


def shown(uri: str) -> str:
    """The URI without its query options (metric names, folder keys): what it points to."""
    return urlsplit(uri)._replace(query="").geturl()


def cache_root() -> Path:
    """meshtrain's local cache: $XDG_CACHE_HOME/meshtrain, else ~/.cache/meshtrain."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtrain"


@contextlib.contextmanager
def reaching(uri: str, flag: str):
    """pyarrow's errors while the block talks to the store at `uri` (an unknown scheme, an
    unreachable endpoint, missing credentials) become one UserError naming `flag`, `uri` and the fix."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        if is_full_disk(e):
            raise  # the local disk's (a copy into the cache): full_disk_is_user_error says so
        raise UserError(f"{flag} {shown(uri)}: {first_line(e)}; {FIX}") from None


GCS_RETRY_S = 60  # pyarrow's GCS client retries an unreachable endpoint for 15 minutes by default


def bounded(uri: str) -> str:
    """`uri` with a bound on pyarrow's retries where its scheme retries without one: gs:// gets
    retry_limit_seconds=GCS_RETRY_S unless the URI sets its own (s3:// gives up after its client's 3
    attempts)."""
    if not uri.startswith("gs://") or "retry_limit_seconds=" in uri:
        return uri
    return f"{uri}{'&' if '?' in uri else '?'}retry_limit_seconds={GCS_RETRY_S}"


class Prefix:
    """A folder in a store: its filesystem and the path in it, from the URI."""

    def __init__(self, uri: str, flag: str):
        import pyarrow.fs as pafs

        self.uri, self.flag = uri, flag
        self.fs, path = self._talk("connecting", lambda: pafs.FileSystem.from_uri(bounded(uri)))
        self.path = path.rstrip("/")

    def _talk(self, doing: str | Callable[[], str], work: Callable[[], T]) -> T:
        """`work()` against the store: its errors one UserError (`reaching`); its wait says so every
        30 s and yields to Ctrl-C and SIGTERM (core/waits.py: pyarrow's calls hold signals while
        they retry)."""
        what = (lambda: f"{shown(self.uri)} ({doing()})") if callable(doing) else f"{shown(self.uri)} ({doing})"
        with reaching(self.uri, self.flag):
            return waits.interruptible(work, what)

    def files(self) -> dict[str, int]:
        """{name: size} of the files directly in the prefix ({} where there is none)."""
        import pyarrow.fs as pafs

        found = self._talk("listing", lambda: self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True)))
        return {Path(f.path).name: f.size for f in found if f.type == pafs.FileType.File}

    def check_root(self) -> None:
        """The prefix's bucket (container, or / of a filesystem) exists: a listing under a missing
        bucket is only empty, and the first upload would fail after the whole prepare."""
        import pyarrow.fs as pafs

        root = self.path.split("/")[0] or "/"
        if self._talk("finding its bucket", lambda: self.fs.get_file_info(root)).type == pafs.FileType.NotFound:
            raise UserError(f"{self.flag} {shown(self.uri)}: the bucket {root} does not exist; create it, or fix "
                            f"the URI")

    def read(self, name: str) -> bytes:
        def work():
            with self.fs.open_input_stream(f"{self.path}/{name}") as f:
                return f.read()
        return self._talk(f"reading {name}", work)

    def put(self, local: Path) -> None:
        """Upload the file `local` as the prefix's file of that name (an object appears whole)."""
        def work():  # the local file opened first: an output stream is published whenever it closes
            with open(local, "rb") as f:
                try:
                    out = self.fs.open_output_stream(f"{self.path}/{local.name}")
                except FileNotFoundError:  # a filesystem with folders (file://, hdfs://): make the prefix's
                    self.fs.create_dir(self.path, recursive=True)
                    out = self.fs.open_output_stream(f"{self.path}/{local.name}")
                with out:  # whole even if the wait is abandoned: a stream stopped early would publish a cut file
                    _copy(f, out, moved, stoppable=False)
        moved = [0]
        self._talk(lambda: f"uploading {local.name}: {_mb(moved[0])} of {_mb(local.stat().st_size)}", work)

    def get(self, name: str, local: Path, size: int) -> None:
        """Copy the prefix's file `name` (of `size` bytes) to `local`."""
        def work():
            with self.fs.open_input_stream(f"{self.path}/{name}") as f, open(local, "wb") as out:
                _copy(f, out, moved)
        moved = [0]
        self._talk(lambda: f"copying {name}: {_mb(moved[0])} of {_mb(size)}", work)


def _mb(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


def _copy(source, target, moved: list[int], stoppable: bool = True) -> None:
    """`source`'s bytes to `target`, CHUNK at a time, counted in `moved[0]`; `stoppable`: stopped where
    the wait for it was abandoned (a Ctrl-C: the caller has gone on to unwind)."""
    while (chunk := source.read(CHUNK)) and not (stoppable and waits.abandoned()):
        target.write(chunk)
        moved[0] += len(chunk)


# ---- writing: prepare --out URI

@contextlib.contextmanager
def staged(out, stage: str | Path | None = None, flag: str = "--out"):
    """Yield the local folder to prepare `out` into: `out` itself where it is local; for a URI, a
    staging folder under `stage` (default: meshtrain's cache, `staging/`), uploaded to `out` when the
    block succeeds and removed either way. The prefix is checked (reachable, no manifest) first."""
    if not is_uri(out):
        yield out
        return
    if stage is not None and (not str(stage) or is_uri(stage)):
        raise UserError(f"--stage {str(stage)!r}: name a local folder to write the data in before its upload "
                        f"(default: {cache_root() / 'staging'})")
    staging = writable(Path(stage or cache_root() / "staging"), "--stage")
    prefix = Prefix(str(out), flag)
    if MANIFEST in prefix.files():
        raise UserError(f"{flag} {shown(out)} already holds prepared data ({MANIFEST}); pick a new prefix or "
                        f"delete it")
    prefix.check_root()
    home = staging / hashlib.sha256(shown(out).encode()).hexdigest()[:16]
    home.mkdir(parents=True, exist_ok=True)
    lock = os.open(home, os.O_RDONLY)  # one prepare per URI on this machine: they share the folder
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another prepare is writing {flag} {shown(out)} (its staging folder {home} is "
                            f"locked); wait for it to finish") from None
        local = home / "prepared"  # Ray's work folder, .prepared.units, stays beside it for a rerun
        shutil.rmtree(local, ignore_errors=True)  # an interrupted upload's: prepared again, the same bytes
        try:
            yield local
            upload(local, prefix)
        finally:
            shutil.rmtree(local, ignore_errors=True)
    finally:
        os.close(lock)


def upload(folder: Path, prefix: Prefix) -> None:
    """The prepared `folder`'s files to `prefix`: each shard's data (.bin, .mask) before its sidecar,
    manifest.json last; a shard whose sidecar is already up as written, its files with their sizes,
    is skipped (an earlier, interrupted upload of the same data)."""
    there = prefix.files()
    names = sorted(p.name for p in folder.iterdir())
    if stray := sorted(set(there) - set(names)):
        raise UserError(f"{prefix.flag} {shown(prefix.uri)} holds files this prepare does not write "
                        f"({', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''}): an earlier prepare of "
                        f"other data? delete them or pick a new prefix")
    group = lambda name: name.split(".")[0]  # shard-00000: .bin, .mask, then .bin.json
    order = sorted(names, key=lambda n: (n == MANIFEST, group(n), n.endswith(".json")))
    up = {g for g in {group(n) for n in names if n.startswith("shard-")} if _is_up(folder, g, prefix, there)}
    skip = {n for n in names if group(n) in up}
    todo = [n for n in order if n not in skip]
    size, started = sum((folder / n).stat().st_size for n in todo), time.perf_counter()
    log.info(f"uploading {len(todo):,} files ({size / 1e6:,.1f} MB) to {shown(prefix.uri)}"
             + (f"; {sum(n.endswith('.bin') for n in skip):,} shard(s) are there from an earlier run" if skip else ""))
    for name in todo:
        prefix.put(folder / name)
    seconds = time.perf_counter() - started
    log.info(f"uploaded {shown(prefix.uri)}: {size / 1e6:,.1f} MB in {seconds:.1f} s "
             f"({size / 1e6 / max(seconds, 1e-9):,.1f} MB/s), {MANIFEST} last")


def _is_up(folder: Path, shard: str, prefix: Prefix, there: dict[str, int]) -> bool:
    """Whether the shard (`shard-00000`) is in `prefix` as in `folder`: its sidecar's bytes (naming
    its sha256) equal, its files (.bin, .mask) of their sizes."""
    note = sidecar(folder / f"{shard}.bin")
    if not note.is_file() or note.name not in there:
        return False
    files = [f for f in (folder / f"{shard}.bin", folder / f"{shard}{MASK_SUFFIX}") if f.is_file()]
    return all(there.get(f.name) == f.stat().st_size for f in files) and \
        prefix.read(note.name) == note.read_bytes()


# ---- reading: data.path URI

def manifest(uri: str, flag: str = "data.path") -> dict:
    """The prepared data's manifest at `uri` (checked as a local one is)."""
    return _listed(Prefix(uri, flag))[0]


def _listed(prefix: Prefix) -> tuple[dict, dict[str, int]]:
    """(the prefix's manifest, its files {name: size}): one error where there is no manifest (not
    prepared data, or an upload still under way: the manifest goes up last)."""
    there, where = prefix.files(), f"{prefix.flag} {shown(prefix.uri)}"
    if MANIFEST not in there:
        raise UserError(f"{where} holds no {MANIFEST}: not prepared data, or a prepare still uploading it (the "
                        f"manifest goes up last); prepare it with python -m meshtrain.data prepare SRC --out "
                        f"{shown(prefix.uri)}")
    fix = "prepare the data again"
    found = schema.parse_json(prefix.read(MANIFEST), f"{where}: {MANIFEST}", fix)
    schema.check(found, MANIFEST_SCHEMA, f"{where}: {MANIFEST}", fix)
    if found["sha256"] is None:
        raise UserError(f"{where}: {MANIFEST} records no sha256 (written before prepare did); {fix}")
    return found, there


def cached(uri: str, cache_dir: str | Path = "", flag: str = "data.path") -> Path:
    """The local copy of the prepared data at `uri`: `cache_dir` (default meshtrain's cache, `data/`)
    / its content hash, copied there first where it is not, and checked against its manifest."""
    prefix = Prefix(uri, flag)
    m, there = _listed(prefix)
    key = m["sha256"] + (f"-{m['mask_sha256'][:16]}" if m.get("mask_sha256") else "")
    root = local_path(cache_dir or cache_root() / "data", "data.cache_dir")
    folder = root / key
    if (folder / MANIFEST).is_file():
        _check_sizes(folder, m, f"the cached copy {folder} of {shown(uri)}", "delete it and run again")
        return folder
    _check_sizes(there, m, f"{flag} {shown(uri)}", "prepare it again")
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root, key)
    tmp = root / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
    log.info(f"copying {shown(uri)} ({sum(there.values()) / 1e6:,.1f} MB) into the cache {folder}")
    try:
        with exits.unwinding(), full_disk_is_user_error(folder, f"the cache of {shown(uri)}", "run again"):
            tmp.mkdir()
            lock = os.open(tmp, os.O_RDONLY)  # remove_abandoned leaves it while this process copies
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                for name in sorted(set(there) - {MANIFEST}):
                    prefix.get(name, tmp / name, there[name])
                check_sha256(tmp, m, f"data.path {shown(uri)}", "prepare it again", digest.read_sha256)
                (tmp / MANIFEST).write_bytes(prefix.read(MANIFEST))
                try:
                    os.replace(tmp, folder)
                except OSError as e:  # another process sharing the cache finished it first: use that copy
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (folder / MANIFEST).is_file():
                        raise
            finally:
                os.close(lock)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _shard_sizes(m: dict) -> dict[str, int]:
    """{file: bytes} of every shard (and loss mask) the manifest lists."""
    itemsize = np.dtype(m["dtype"]).itemsize
    sizes = {s["file"]: s["tokens"] * itemsize for s in m["shards"]}
    if m.get("mask_sha256"):
        sizes.update({Path(s["file"]).with_suffix(MASK_SUFFIX).name: s["tokens"] for s in m["shards"]})
    return sizes


def _check_sizes(found, m: dict, where: str, fix: str) -> None:
    """Every file the manifest lists is in `found` (a folder, or {name: size}) with its size."""
    for name, size in _shard_sizes(m).items():
        has = found.get(name) if isinstance(found, dict) else (
            (found / name).stat().st_size if (found / name).is_file() else None)
        if has != size:
            what = "is missing" if has is None else f"has {has:,} bytes, its manifest says {size:,}"
            raise UserError(f"{where}: {name} {what}; {fix}")
