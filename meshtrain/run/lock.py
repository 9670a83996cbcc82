"""An exclusive lock on a folder, held by one process at a time: a run's `--out`, a sweep's folder.

The lock is `flock` on `<folder>/run.lock`, which the kernel releases when the holder exits in any
way (kill -9 included), so a lock never outlives its process. The file names the holder (host, pid,
start time): a second start reads it into its one-line error. A file that names a holder while no
process holds the lock was left by a killed run: it is taken over, with a notice. On a network
filesystem without working `flock`, a holder on the same host is still detected by its pid.
Within one process the lock is shared (counted): a notebook cell that builds a second Trainer on
the same folder works, as running one process's work one after the other does. No JAX here.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from meshtrain.core import exits
from meshtrain.core.errors import UserError

LOCK_FILE = "run.lock"
_HELD: dict[Path, list] = {}  # lock file -> [fd, holders] of the locks this process holds


class FolderLock:
    """`acquire()` takes the lock on `folder` (creating the folder and its lock file) or raises a
    `UserError` naming the holder; `release()` gives it back (idempotent). `flag` names the folder in
    errors (e.g. '--out')."""

    def __init__(self, folder: str | Path, flag: str = "--out"):
        self.folder, self.flag = Path(folder), flag
        self.path = self.folder / LOCK_FILE
        self.held = False
        self.taken_over: dict | None = None  # the holder a stale lock named, once acquired

    def acquire(self) -> FolderLock:
        if self.held:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in _HELD:  # this process holds it already
            _HELD[key][1] += 1
            self.held = True
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise UserError(self._in_use(_read(fd))) from None
            previous = _read(fd)
            if previous and _alive_here(previous):  # flock not shared (network fs), the pid still runs
                raise UserError(self._in_use(previous))
            self.taken_over = previous or None
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder()).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _HELD[key], self.held = [fd, 1], True
        exits.held()  # a signal now unwinds to release() instead of ending the process at once
        return self

    def release(self) -> None:
        """Empty the lock file (no holder) and unlock. The file stays: removing it would let a
        process that opened it just before lock a file no later process sees."""
        if not self.held:
            return
        self.held = False
        key = self.path.resolve()
        _HELD[key][1] -= 1
        if _HELD[key][1]:
            return
        fd = _HELD.pop(key)[0]
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing releases the flock
        exits.released()

    def stale_notice(self) -> str | None:
        """The notice (logged at NOTICE) for a lock taken over from a killed run (once), or None."""
        h, self.taken_over = self.taken_over, None
        if not h:
            return None
        return (f"{self.flag} {self.folder} was locked by pid {h.get('pid')} on {h.get('host')} "
                f"(since {h.get('since')}), which no longer runs; lock taken over")

    def _in_use(self, h: dict) -> str:
        who = f"pid {h.get('pid')} on {h.get('host')} (since {h.get('since')})" if h else "another process"
        return (f"{self.flag} {self.folder} is in use by {who}; wait for that run to end, stop it, or pick "
                f"another {self.flag}")


def holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "epoch": time.time()}


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"host": "?", "pid": "?", "since": "? (unreadable lock file)"}


def _alive_here(h: dict) -> bool:
    """The holder named in the file runs on this host (and is not this process)."""
    if h.get("host") != socket.gethostname() or not isinstance(h.get("pid"), int) or h["pid"] == os.getpid():
        return False
    try:
        os.kill(h["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    with contextlib.suppress(OSError, TypeError):  # a pid reused by a process started after the lock
        return os.stat(f"/proc/{h['pid']}").st_ctime <= h["epoch"] + 1
    return True
