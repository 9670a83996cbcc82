"""Waits on the network that say they are waiting, end, and yield to Ctrl-C and SIGTERM.

Python runs a signal's handler only in the main thread, between two bytecodes: a native call that
blocks there (a store's retries, JAX's multi-host rendezvous) holds Ctrl-C and SIGTERM until it
returns, minutes later. `interruptible(work, what)` runs `work` in a helper thread while the main
thread waits in short slices, so a signal's handler runs at once (the command's one line and exit
130/143, core/exits.py; a KeyboardInterrupt in a library), logs `waiting for WHAT: N s` every
`every_s`, and past `deadline_s` raises the error `timed_out()` gives. A native call cannot be
cancelled: an abandoned helper goes on until its call returns; work done in steps checks
`abandoned()` between them and stops.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from meshtrain.core.console import log

T = TypeVar("T")
PROGRESS_EVERY_S = 30.0  # seconds between two "waiting for" lines
SLICE_S = 0.25  # the longest a signal waits for its handler


class _Helper(threading.Thread):
    def __init__(self, work: Callable[[], T], what: str):
        super().__init__(name=f"meshtrain-wait: {what}"[:60], daemon=True)
        self.work, self.abandoned, self.outcome = work, threading.Event(), None

    def run(self) -> None:
        try:
            self.outcome = (True, self.work())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread as it is
            self.outcome = (False, e)


def abandoned() -> bool:
    """In `interruptible`'s work: whether its waiter has given up (a signal, the deadline): stop."""
    helper = threading.current_thread()
    return isinstance(helper, _Helper) and helper.abandoned.is_set()


def interruptible(work: Callable[[], T], what: str | Callable[[], str], *, every_s: float = PROGRESS_EVERY_S,
                  deadline_s: float | None = None, timed_out: Callable[[], BaseException] | None = None) -> T:
    """`work()`'s result (or its exception), waited for as the module doc says. `what` (a text, or a
    function giving the current one) names what is awaited in the progress lines. Off the main thread
    (no signal reaches it) `work` runs in place: no progress lines, no deadline."""
    if threading.current_thread() is not threading.main_thread():
        return work()  # signals reach the main thread only: nothing to keep responsive here
    said = (lambda: what) if isinstance(what, str) else what
    helper = _Helper(work, said())
    started = time.monotonic()
    helper.start()
    last_said = started
    try:
        while helper.is_alive():
            helper.join(SLICE_S)
            now = time.monotonic()
            if helper.is_alive() and deadline_s is not None and now - started >= deadline_s:
                raise timed_out() if timed_out else TimeoutError(f"waited {deadline_s:g} s for {said()}")
            if helper.is_alive() and now - last_said >= every_s:
                bound = f" of {deadline_s:g} s" if deadline_s is not None else ""
                log.info(f"waiting for {said()}: {now - started:.0f} s{bound} (Ctrl-C stops)")
                last_said = now
    except BaseException:
        helper.abandoned.set()
        raise
    done, value = helper.outcome
    if not done:
        raise value
    return value
