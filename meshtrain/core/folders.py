"""Output folders and files, checked before any work and written whole or not at all: a run's
`--out` (meshtrain/run/run_dir.py), and the outputs of convert, quantize and prepare; and the one
`UserError` a full disk becomes wherever meshtrain writes. No JAX here: prepare's workers import it."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from meshtrain.core import exits
from meshtrain.core.console import NOTICE, log
from meshtrain.core.errors import UserError

URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?:/+|$)")  # s3://b/x, or as a Path keeps it: s3:/b/x


def local(path: str | Path, flag: str) -> Path:
    """`path` as a Path on this machine; a URI (s3://, gs://, https://, ...) is one UserError naming
    `flag`, not a folder named `s3:` in the working directory."""
    if URI.match(str(path)):
        shown = path if isinstance(path, str) else URI.sub(r"\1://", str(path), count=1)  # as typed, where known
        raise UserError(f"{flag} {shown} is a URI; {flag} takes a path on this machine, or on a filesystem "
                        f"mounted on it")
    return Path(path)


def writable(path: str | Path, flag: str) -> Path:
    """`path`, once it is known that it can be created or written (`flag` names it in errors, e.g.
    '--out'); nothing is written."""
    path = probe = local(path, flag)
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():  # dangling: creating `path` would fail on it
            raise UserError(f"{flag} {path}: {probe} is a link to {os.readlink(probe)}, which does not exist; "
                            f"create that folder or pick another {flag}")
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
    path = writable(path, flag)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{flag} {path} already exists and is not empty; pick a new folder or delete it")
    return path


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
FULL_DISK_TEXTS = ("No space left on device", "Disk quota exceeded", "database or disk is full")  # the last: SQLite


def is_full_disk(error: BaseException | None) -> bool:
    """A full disk or quota: an OSError with its errno, or a library's error that quotes one
    (TensorStore's, under Orbax), anywhere in the chain of causes."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in FULL_DISK or any(
                text in str(error) for text in FULL_DISK_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def full_disk_is_user_error(path: str | Path, what: str, then: str = "rerun"):
    """A full disk while the block writes `what` under `path` becomes one UserError naming the disk
    and the fix (`then`: what to do once there is space)."""
    try:
        yield
    except Exception as e:
        if not is_full_disk(e):
            raise
        raise UserError(f"the disk holding {path} is full (writing {what}); free space there or pick "
                        f"another folder, then {then}") from None


def file_target(path: str | Path, flag: str) -> Path:
    """`path`, once it is known that a file can be written there (not a folder, in a writable one);
    nothing is written."""
    path = local(path, flag)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file")
    writable(path.parent, flag)
    return path


@contextlib.contextmanager
def writing_file(path: str | Path, flag: str, force: bool = False, suffixes: tuple[str, ...] = ()):
    """Yield a hidden path beside `path`, with its suffix, to write one file into; it replaces `path`
    when the block succeeds and is removed when it fails, so `path` is whole or as it was. An existing
    `path` may be a file of the user's: refused unless `force` (--force). `suffixes`: the formats the
    writer knows (a file's type follows its suffix). Missing folders are made once the file is whole."""
    path = file_target(path, flag)
    if suffixes and path.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {path}: unknown file type {path.suffix or '(no suffix)'}; use one of "
                        f"{', '.join(suffixes)}")
    if path.exists() and not force:
        raise UserError(f"{flag} {path} already exists; pass --force to overwrite it, or pick another {flag}")
    parent = next(p for p in path.absolute().parents if p.is_dir())  # folders are made at the end
    tmp = parent / f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}{path.suffix}"
    try:
        with exits.unwinding(), full_disk_is_user_error(path, f"{flag} {path}"):
            yield tmp
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_file(path: Path, text: str) -> None:
    """`path` holds `text` whole, or keeps what it held: written beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with exits.unwinding():
            tmp.write_text(text)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)




@contextlib.contextmanager
def writing_whole(path: str | Path, flag: str):
    """Yield a hidden folder beside `path` to write into; it becomes `path` when the block succeeds
    and is removed when it fails (an error, Ctrl-C, a full disk: one UserError), so the output is
    there whole or not at all. A hidden folder that a killed process left for `path` is removed."""
    path = check_new(path, flag)
    parent = next(p for p in path.absolute().parents if p.is_dir())  # nothing is created before the end
    remove_abandoned(parent, path.name)
    tmp = parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    lock = None
    try:
        with exits.unwinding(), full_disk_is_user_error(path, f"{flag} {path}"):
            tmp.mkdir()  # not mkdtemp: the folder gets the umask's permissions, not 0700
            lock = os.open(tmp, os.O_RDONLY)  # the folder itself is flocked while this process writes it
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield tmp
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, path)  # rename(2): over an empty folder too, never over a filled one
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise
                raise UserError(f"{flag} {path} was filled by another process while this one wrote it (two "
                                f"commands writing one folder at once?); it is kept as that one wrote it: pick "
                                f"another {flag} and run this again") from None
    finally:
        if lock is not None:
            os.close(lock)
        shutil.rmtree(tmp, ignore_errors=True)


def remove_abandoned(parent: Path, name: str) -> None:
    """Remove the temporary folders of `writing_whole(parent / name)` whose process is gone (their
    lock, the folder's flock, is free); those of a live process are left alone."""
    for tmp in parent.glob(f".{glob.escape(name)}.tmp-*"):
        try:
            lock = os.open(tmp, os.O_RDONLY)
        except OSError:  # renamed or removed by its process right now
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process is still writing
        finally:
            os.close(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        log.log(NOTICE, f"removed {tmp}, left by an interrupted write of {parent / name}")
