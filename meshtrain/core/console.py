"""One console: everything the library says goes through the standard `logging` module under the
`meshtrain` logger, so a notebook, a Ray job or a test can quiet, redirect or capture it
(`logging.getLogger("meshtrain").setLevel(logging.WARNING)`; pytest's `caplog`).

- `log.info(...)`: notices (resumed from, initialised from, preempted); `log.warning(...)`: problems the
  run survives (a NaN/Inf step, a loss spike). Messages carry no "warning:" prefix and no process guard:
  on a multi-process job only the primary process's info and warnings reach the console, the others'
  are debug records (`set_process` is told the process index when the job is joined).
- `ConsoleHandler`: what the commands install (`use_console`): info lines to stdout as they are, warnings
  and errors to stderr as `warning: ...` / `error: ...`, the format the commands always printed.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("meshtrain")
_process = {"index": 0}


def set_process(index: int) -> None:
    """The job's process index: from here on, only process 0's info and warnings reach the console."""
    _process["index"] = index


def primary() -> bool:
    return _process["index"] == 0


class _PrimaryOnly(logging.Filter):
    """Another process's info and warnings become debug records; errors always pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if primary() or record.levelno >= logging.ERROR:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return log.isEnabledFor(logging.DEBUG)


log.addFilter(_PrimaryOnly())


class ConsoleHandler(logging.Handler):
    """Info to stdout, warnings and errors to stderr with their prefix, each line flushed. `write`
    replaces the stdout writer (rich's live progress bar prints lines above itself)."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.write = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.levelno >= logging.WARNING:
                prefix = "error: " if record.levelno >= logging.ERROR else "warning: "
                print(prefix + message, file=sys.stderr, flush=True)
            elif self.write is not None:
                self.write(message)
            else:
                print(message, file=sys.stdout, flush=True)
        except Exception:  # logging's contract: a handler never raises into the caller
            self.handleError(record)


def use_console(level: int = logging.INFO) -> ConsoleHandler:
    """The commands' console: one ConsoleHandler on the `meshtrain` logger (installed once)."""
    for handler in log.handlers:
        if isinstance(handler, ConsoleHandler):
            return handler
    handler = ConsoleHandler(level)
    log.addHandler(handler)
    log.setLevel(min(level, log.level or logging.INFO))
    return handler


def default_console() -> None:
    """The library's entry points (Trainer) print as the commands do, unless the `meshtrain` logger has
    a handler already or `detach()` was called. Records also propagate to the root logger (pytest's
    caplog, a Ray job's logging)."""
    if not log.handlers and not _detached["yes"]:
        use_console()


_detached = {"yes": False}


def detach() -> None:
    """Route the library's lines only through the user's own logging set-up (root handlers): the console
    handler goes and the library adds it no more."""
    _detached["yes"] = True
    for handler in [h for h in log.handlers if isinstance(h, ConsoleHandler)]:
        log.removeHandler(handler)
