"""Output folders, checked before any work and written whole or not at all: a run's `--out`
(meshtrain/run_dir.py), and the outputs of convert, quantize and prepare. No JAX here: prepare's
worker processes import it."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from meshtrain.errors import UserError


def writable(path: Path, flag: str) -> Path:
    """`path`, once it is known that it can be created or written (`flag` names it in errors, e.g.
    '--out'); nothing is written."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{flag} {path}: {probe} is a file, not a folder; pick another {flag}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {probe} is not writable; pick another {flag}")
    try:  # access() can pass where creating fails (/proc, a read-only mount as root): create a folder
        os.rmdir(tempfile.mkdtemp(prefix=".meshtrain-probe-", dir=probe))  # of our own there, then remove it
    except OSError as e:
        raise UserError(f"{flag} {path} cannot be created ({e.strerror}); pick another {flag}") from None
    return path


def check_new(path: str | Path, flag: str) -> Path:
    """`path`, once it is known that it can be created and is new or empty; nothing is written."""
    path = writable(Path(path), flag)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{flag} {path} already exists and is not empty; pick a new folder or delete it")
    return path


@contextlib.contextmanager
def writing_whole(path: str | Path, flag: str):
    """Yield a hidden folder beside `path` to write into; it becomes `path` when the block succeeds
    and is removed when it fails, so the output is there whole or not at all."""
    path = check_new(path, flag)
    parent = next(p for p in path.absolute().parents if p.is_dir())  # nothing is created before the end
    tmp = parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not mkdtemp: the folder gets the umask's permissions, not 0700
    try:
        yield tmp
        if path.exists():
            path.rmdir()  # empty (checked)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
