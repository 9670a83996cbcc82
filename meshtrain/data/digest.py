"""Content hashes of token streams: sha256 over every byte, read once per version of a file.

A stream held in files (a token file, a prepared folder's shards one after another) is hashed
through a cache, `sha256.json` in $XDG_CACHE_HOME/meshtrain (default ~/.cache/meshtrain), keyed by
each file's absolute path, size, mtime_ns, ctime_ns and inode. Any write changes mtime_ns and
ctime_ns, and setting the times back (`touch -d`, a copy keeping them) changes ctime_ns, so an entry
never vouches for changed bytes; a file whose times are within RACY_NS of the hash's start is not
cached at all (a write in the same tick of the filesystem's clock would keep its times: git's
"racy" case). Entries of files that are gone or changed are dropped at each write. The cache only
saves reading: when it cannot be read or written, the files are hashed again.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.core.folders import replace_file

CHUNK = 8 << 20  # bytes per read
RACY_NS = 2_000_000_000  # a file changed this close to its hash is not cached (FAT's 2 s clock, NFS skew)
MAX_ENTRIES = 4096


def cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtrain" / "sha256.json"


def arrays_sha256(arrays) -> str:
    """sha256 of the arrays' bytes one after another (a stream tokenized in memory)."""
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(np.ascontiguousarray(a).view(np.uint8))
    return digest.hexdigest()


def files_sha256(paths) -> str:
    """sha256 of the files' bytes one after another, from the cache when every file is as it was."""
    files = [_stat_key(p) for p in paths]
    known = next((e["sha256"] for e in _entries() if e["files"] == files), None)
    if known:
        return known
    start = time.time_ns()
    sha256 = read_sha256(paths)
    if all(max(f[2], f[3]) < start - RACY_NS for f in files):
        _remember(files, sha256)
    return sha256


def read_sha256(paths) -> str:
    """sha256 of the files' bytes one after another, read in CHUNK pieces."""
    digest, buffer = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buffer)
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    digest.update(view[:n])
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror}); check the data's files") from None
    return digest.hexdigest()


def _stat_key(path) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _current(files: list) -> bool:
    try:
        return all(_stat_key(f[0]) == f for f in files)
    except OSError:
        return False


def _entries() -> list[dict]:
    try:
        entries = json.loads(cache_file().read_text())["entries"]
        return [e for e in entries if isinstance(e.get("files"), list) and isinstance(e.get("sha256"), str)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _remember(files: list, sha256: str) -> None:
    """Add an entry, dropping those whose files are gone or changed (one writer at a time: a lock
    file beside the cache)."""
    path = cache_file()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kept = [e for e in _entries() if e["files"] != files and _current(e["files"])]
            entries = kept[-(MAX_ENTRIES - 1):] + [{"files": files, "sha256": sha256}]
            replace_file(path, json.dumps({"entries": entries}) + "\n")
