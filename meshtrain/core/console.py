"""One console: everything the library says goes through the standard `logging` module under the
`meshtrain` logger, so a notebook, a Ray job or a test can quiet, redirect or capture it
(`logging.getLogger("meshtrain").setLevel(logging.WARNING)`; pytest's `caplog`).

- `log.info(...)`: what a run or command is doing (resumed from, initialised from, preempted, compiling);
  `log.log(NOTICE, ...)`: a note about the user's input or a repair the library made (a renamed config
  key, a leftover temporary folder removed), on stderr; `log.warning(...)`: problems the run survives (a
  NaN/Inf step, a loss spike, a damaged checkpoint skipped); `log.error(...)`: the last words of a
  process that is about to exit. Messages carry no "notice:"/"warning:"/"error:" prefix and no process
  guard: on a multi-process job only the primary process's info, notices and warnings reach the console,
  the others' are debug records (`set_process` is told the process index when the job is joined).
- `ConsoleHandler`: what the commands install (`use_console`): info lines to stdout as they are, notices,
  warnings and errors to stderr as `notice: ...` / `warning: ...` / `error: ...`, the format the commands
  always printed. While a live display owns the terminal (the rich progress bar,
  meshtrain/run/loggers.py `ProgressBar`), `live_display` makes it write every line through the display.

A notebook, a Ray job or a service quiets or redirects the library with the standard calls:
`logging.getLogger("meshtrain").setLevel(logging.WARNING)` (warnings and errors only), a handler of
its own on that logger or the root logger (then `Trainer` installs no console: see `default_console`).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable

log = logging.getLogger("meshtrain")
NOTICE = logging.INFO + 5  # between info and warning: quieted by setLevel(logging.WARNING), shown on stderr
logging.addLevelName(NOTICE, "NOTICE")
PREFIXES = ((logging.ERROR, "error: "), (logging.WARNING, "warning: "), (NOTICE, "notice: "))
_process = {"index": 0}
_noticed: set[str] = set()


def notice_once(message: str) -> None:
    """`log.log(NOTICE, message)` the first time this process says it: a note about a choice every
    program of a run (or of a planner's search) makes alike is said once."""
    if message not in _noticed:
        _noticed.add(message)
        log.log(NOTICE, message)


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


def prefixed(record: logging.LogRecord, message: str) -> str:
    """The line as the console shows it: info as it is, the others after their prefix."""
    return next((prefix for level, prefix in PREFIXES if record.levelno >= level), "") + message


class ConsoleHandler(logging.Handler):
    """Info to stdout, notices, warnings and errors to stderr with their prefix, each line flushed
    (the streams are looked up at each line: pytest's capsys and rich's redirection see them). `write`,
    when set, takes every line instead (`live_display`)."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.write = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = prefixed(record, self.format(record))
            if self.write is not None:
                self.write(line)
                return
            stream = sys.stderr if record.levelno >= NOTICE else sys.stdout
            stream.write(line + "\n")
            stream.flush()
        except Exception:  # logging's contract: a handler never raises into the caller
            self.handleError(record)


def live_display(write) -> Callable[[], None]:
    """While a live display owns the terminal (loggers.ProgressBar, rich's bar): every ConsoleHandler on
    the `meshtrain` logger hands its lines, each with its prefix, to `write`, which prints them above
    the display. A line written past the display to the terminal's stdout or stderr would be torn by
    its next refresh (rich also redirects sys.stdout and sys.stderr into the display while it is live,
    for other libraries' prints). Returns the function that ends it: the handlers write as before."""
    handlers = [h for h in log.handlers if isinstance(h, ConsoleHandler)]
    before = [h.write for h in handlers]
    for handler in handlers:
        handler.write = write

    def end() -> None:
        for handler, previous in zip(handlers, before):
            handler.write = previous
    return end


def use_console(level: int = logging.INFO) -> ConsoleHandler:
    """The commands' console: one ConsoleHandler on the `meshtrain` logger (installed once), the only
    output of its records: they no longer propagate to the root logger, where a handler that another
    library configures (any module-level `logging.warning(...)` calls `logging.basicConfig()` on an
    unconfigured root) would print each line a second time as `WARNING:meshtrain:...`."""
    for handler in log.handlers:
        if isinstance(handler, ConsoleHandler):
            return handler
    handler = ConsoleHandler(level)
    log.addHandler(handler)
    log.setLevel(min(level, log.level or logging.INFO))
    log.propagate = False
    return handler


def default_console() -> None:
    """The library's entry points (Trainer) print as the commands do, unless logging is configured
    already (a handler on the `meshtrain` logger or on the root logger: then the records go there) or
    `detach()` was called."""
    if not log.handlers and not logging.getLogger().handlers and not _detached["yes"]:
        use_console()


_detached = {"yes": False}


def detach() -> None:
    """Route the library's lines only through the user's own logging set-up, one configured after a
    Trainer installed the console: the console handler goes, the records propagate to the root logger
    again, and the library installs the console no more."""
    _detached["yes"] = True
    for handler in [h for h in log.handlers if isinstance(h, ConsoleHandler)]:
        log.removeHandler(handler)
    log.propagate = True


def duration(seconds: float) -> str:
    """Seconds as a person reads them: 4.2s, 3m05s, 2h07m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"
