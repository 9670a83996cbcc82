"""Append-only JSON-lines files (a run's metrics.jsonl): written so that a crash or a full disk tears
at most the last record, and read so that such a torn record costs nothing else.

Writing: a record is one line, encoded whole and handed to the OS in one `os.write` on an O_APPEND
descriptor; a write that fails or stops short (a full disk) is cut off again, so the file ends on a
whole line. A killed process loses only the record it was writing.

Reading: a record is a line that ends in a newline and decodes to a JSON object. The file's last
line may be torn (written by a process that died, or on a disk that filled, mid-record): it is
dropped with one `warning:` naming the file and line. Any other line that does not decode is damage
from outside (an edit, a bad disk), not a torn write: a `UserError` naming the line. A writer that
opens a file with a torn last line cuts it off first, so later records never follow half a record.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from meshtrain.core.console import log
from meshtrain.core.errors import UserError


def parse(data: bytes, path: Path, first_line: int = 1, tail_may_be_torn: bool = True) -> tuple[list[dict], int]:
    """(records, bytes they span) of `data`, lines of `path` numbered from `first_line`. With
    `tail_may_be_torn`, `data` runs to the end of the file and a torn last line is dropped with a
    warning; without, `data` must be whole lines."""
    lines = data.split(b"\n")  # the part after the last newline is unterminated ('' if none)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records, spanned = [], 0
    for index, line in enumerate(lines):
        terminated = index < len(lines) - 1
        if line.strip():
            try:
                record = json.loads(line) if terminated else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                if not (tail_may_be_torn and index == last):
                    why = ", and not the last line, which a crash may tear" if tail_may_be_torn else ""
                    raise UserError(f"{path} line {first_line + index} is not a JSON record{why}: the file was "
                                    f"damaged; repair or delete that line")
                log.warning(f"{path} line {first_line + index} is a torn record (written when a process died or the "
                            f"disk filled); dropped")
                break
            records.append(record)
        spanned += len(line) + terminated
    return records, spanned


def read(path: str | Path) -> list[dict]:
    """Every record of `path`; a torn last line is dropped with a warning."""
    path = Path(path)
    return parse(path.read_bytes(), path)[0]


class Appender:
    """Appends records to `path`, each in one write; a torn last line found at open is cut off."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self.fd).st_size
        if self.size:
            with open(self.path, "rb") as f:
                _, whole = parse(f.read(), self.path)
            if whole < self.size:
                self._cut(whole)

    def _cut(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        self.size = size

    def append(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        try:
            written = os.write(self.fd, data)
        except OSError:
            self._cut(self.size)  # a failed write may still have placed part of the record
            raise
        if written < len(data):  # a short write: the disk filled mid-record
            self._cut(self.size)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        self.size += written

    def close(self) -> None:
        os.close(self.fd)
