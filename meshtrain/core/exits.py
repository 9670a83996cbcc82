"""How a command ends: its exit statuses, and what a Ctrl-C or SIGTERM does before the command has
anything to save.

`python -m meshtrain.<command>` takes both signals first thing (meshtrain/__init__.py, `take_signals`),
before any import a signal could cut with a traceback. From then on a signal ends the process at once
with its one line (130 for Ctrl-C, 143 for SIGTERM; `os._exit`: no interpreter shutdown, which with
XLA's threads mid-start-up could crash, a segfault after the line), unless the command is inside
`unwinding()` (a lock held, a file or folder being written): there the signal is raised as an
exception (KeyboardInterrupt, `Terminated`), so the `finally` blocks that release the lock and remove
the temporary run, and the command's wrapper (core/cli.py) prints the same line. Raising only there
also keeps the exception out of the C++ of an import or a compile that calls back into Python, where
it would abort the process. Training replaces both handlers from its first write to its summary (a
signal then finishes the step, checkpoints and exits 0: run/actions.py `preemption_signals`). Once the
command's work is done (`done`: it returned, or training's fit did) a signal ends the process at once
with the command's own status: its exit handlers and JAX's teardown take seconds on a loaded machine,
and a finished command is not "interrupted". Once its exit handlers have run, the interpreter's own
shutdown ignores both: Python resets its handlers to the default there, and a SIGTERM landing then
would kill a command that had finished, status -15 instead of its own."""
import atexit
import contextlib
import gc
import os
import signal
import sys
import threading

EXIT_USER_ERROR, EXIT_BUG, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 1, 130, 128 + signal.SIGTERM
INTERRUPTED = "interrupted (Ctrl-C); run the command again to redo it"
TERMINATED = "terminated (SIGTERM) before it had anything to save; run the command again to redo it"


class Terminated(KeyboardInterrupt):
    """SIGTERM where a command has nothing to save: unwound as a Ctrl-C is, with its own line."""


_as_process = False  # `python -m meshtrain.<command>` is this process (set by take_signals)
_result = None  # the status of a command whose work is done (`done`)
_unwinding = 0  # how many `unwinding()` blocks are open
line_fd = 2  # where the line goes: stderr, or where stderr was while it is redirected (core/cli.py)


@contextlib.contextmanager
def unwinding():
    """A block that a signal must unwind, not cut: a lock held, a file or folder being written."""
    global _unwinding
    _unwinding += 1
    try:
        yield
    finally:
        _unwinding -= 1


def held() -> None:
    """Something that `released()` gives back (a lock) is held: signals unwind until then."""
    global _unwinding
    _unwinding += 1


def released() -> None:
    global _unwinding
    _unwinding -= 1


def said(signum: int) -> int:
    """Write the line for this signal (SIGINT or SIGTERM) to stderr; return its exit status."""
    terminated = signum == signal.SIGTERM
    _write(TERMINATED if terminated else INTERRUPTED)
    return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def _write(line: str) -> None:
    """`line` to stderr, or where stderr was while it is redirected (`line_fd`)."""
    if line_fd == 2:
        print(line, file=sys.stderr, flush=True)
    else:
        os.write(line_fd, f"{line}\n".encode())


def end(signum: int) -> None:
    """The line for this signal, then the exit, at once."""
    status = said(signum)
    sys.stdout.flush()
    os._exit(status)


def done(status: int) -> None:
    """The command's work is done and its result stands (a training run: its last checkpoint durable):
    as a process, a signal from now on (its exit handlers, JAX's teardown, a barrier with its peers)
    ends it at once with `status`, not the signal's, since nothing is left to unwind or redo."""
    global _result
    _result = status


def fail_now(line: str) -> None:
    """As a process: `line` (an `error:` line) then exit 2 at once, where the interpreter's shutdown
    would print a native library's teardown after it (JAX's half-joined multi-host runtime)."""
    if _as_process:
        _write(line)
        sys.stdout.flush()
        os._exit(EXIT_USER_ERROR)


def on_signal(signum, frame):
    """The handler for SIGINT and SIGTERM (see the module doc). Where the signal is raised, not inside a
    garbage-collection callback (JAX registers one), where Python would print the exception as
    "Exception ignored" and go on: there it is sent again once the callback has returned."""
    if _as_process and _result is not None:
        sys.stdout.flush()
        os._exit(_result)
    if _as_process and not _unwinding:
        end(signum)
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def take_signals() -> None:
    """For `python -m meshtrain.<command>`: Ctrl-C and SIGTERM go to `on_signal` (where the process had
    Python's defaults: not where its parent made it ignore them)."""
    global _as_process
    _as_process = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(sig, on_signal)
    atexit.register(_ignore_signals_in_shutdown)  # registered first, so it runs last of the exit handlers


def _ignore_signals_in_shutdown() -> None:
    """The command has finished and its status stands: the rest of the shutdown is not cut by a signal
    (see the module doc)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is on_signal:
            signal.signal(sig, signal.SIG_IGN)
