"""The step watchdog: a run that stops making progress ends, with the evidence, so that the scheduler
restarts it from its last checkpoint (docs/operating.md).

The training loop tells it what it is doing (`doing`: getting a batch, dispatching or waiting for
step k, evaluating, saving) and when a step completes (`beat`). Its thread looks every second: once
no step has completed for `train.step_timeout` seconds (auto: max(AUTO_FLOOR_S, AUTO_FACTOR x the
slowest logged step time); until the first step of a start completes, and during the first
evaluation and the first save, at least AUTO_FLOOR_S: one-time compiles, autotuning, communicator
and checkpointer set-up), this process
- writes <out>/stalls/process<i>-step<k>.txt: host, pid, what it was doing and for how long, the
  Python stack of every thread (`faulthandler`) and its local devices with their memory figures.
  Device stacks cannot be had: JAX has no API that reports where a running device program is (a
  profiler trace holds only what it recorded while active); the Python stacks show which call
  waits on the devices;
- with several processes, tells the others through JAX's coordination service (they dump at once),
  reads what each was doing (each publishes it there, at most once a second, from this thread) and
  names the process that stopped where that is knowable: one whose host is elsewhere while the
  others wait for the step on their devices;
- prints one `error:` line and exits EXIT_STALLED, the other processes first, then process 0, which
  hosts the coordination service.
A hang that holds the GIL stops this thread too: faulthandler's own C thread, armed for BACKSTOP_S past
the deadline (re-armed whenever a step completes or the timeout changes), then prints every thread's
Python stack on stderr and exits 1.
"""
from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import jax

from meshtrain.core.console import log
from meshtrain.run import multihost

EXIT_STALLED = 4
AUTO_FLOOR_S, AUTO_FACTOR = 600.0, 10.0
BACKSTOP_S = 30.0
PEERS_WAIT_S = 20.0  # how long a process that fired waits for the others' dumps
LEAVE_S = 0.5  # process 0's grace between the others' last word and its own exit
KEY = "meshtrain/watchdog"


def auto_timeout(slowest_step_s: float) -> float:
    """train.step_timeout=0: AUTO_FACTOR x the slowest logged step time, at least AUTO_FLOOR_S."""
    return max(AUTO_FLOOR_S, AUTO_FACTOR * slowest_step_s)


def _processes(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"process {ids[0]} is"
    return (f"processes {', '.join(map(str, ids))} are" if len(ids) <= 8 else f"{len(ids)} processes are")


def who_stopped(reports: dict[int, dict | None], now: float) -> str:
    """Which process stopped, from what each last published ({'done', 'doing', 'since', 'host'};
    None: nothing): one whose host is elsewhere while the others wait (for the step on their devices,
    or for the others at a gather)."""
    silent = sorted(i for i, r in reports.items() if r is None)
    known = {i: r for i, r in reports.items() if r is not None}
    waiting = sorted(i for i, r in known.items() if r["doing"].startswith("waiting for"))
    elsewhere = sorted(set(known) - set(waiting))
    groups: dict[str, list[int]] = {}
    for i in waiting:
        groups.setdefault(known[i]["doing"], []).append(i)
    waits = " and ".join(f"{_processes(ids)} {doing}" for doing, ids in groups.items())
    parts = [f"process {i} published nothing (it may be the one that stopped)" for i in silent]
    stopped = "; ".join(f"process {i} (host {known[i]['host']}) has been {known[i]['doing']} for "
                        f"{now - known[i]['since']:.0f} s" for i in elsewhere)
    if waiting and elsewhere:
        parts.append(f"{stopped}, while {waits}: {'it' if len(elsewhere) == 1 else 'they'} stopped")
    elif waiting:
        parts.append(f"{waits}: a device or a collective hangs, and the hosts cannot tell which (see the stacks)")
    elif elsewhere:
        parts.append(stopped)
    return "; ".join(parts)


class StepWatchdog:
    """`timeout_s`: train.step_timeout (0 = auto, negative = off). A context manager around the loop."""

    def __init__(self, timeout_s: float, out: Path, process: int = 0, processes: int = 1, first_step: int = 0):
        self.configured, self.out = timeout_s, Path(out)
        self.process, self.processes = process, processes
        self.enabled = timeout_s >= 0
        self.slowest = 0.0
        self.done, self._activity, self._since = first_step, "starting", time.monotonic()
        self.one_time = True  # the first step's (or evaluation's) one-time work: the floor applies
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._published = None
        self._backstop_at = None  # the monotonic time faulthandler's backstop is armed for
        self.fired = False
        self.host = socket.gethostname()

    # ---- what the loop calls (attribute writes only: nothing waits) ----
    def doing(self, activity: str) -> None:
        self._activity, self._since = activity, time.monotonic()

    def beat(self, step: int) -> None:
        """Step `step` completed (or an evaluation / save after it): progress."""
        self.done, self._last_beat, self.one_time = step, time.monotonic(), False

    def observe(self, step_time_s: float) -> None:
        self.slowest = max(self.slowest, step_time_s)

    def timeout(self) -> float:
        timeout = self.configured if self.configured > 0 else auto_timeout(self.slowest)
        return max(timeout, AUTO_FLOOR_S) if self.one_time else timeout

    # ---- the thread ----
    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="meshtrain-step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.fired:  # the loop failed because a peer left while dumping: the thread ends the process
            threading.Event().wait()
        self._stop.set()
        self._thread.join()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        poll = min(1.0, (self.configured if self.configured > 0 else AUTO_FLOOR_S) / 4)
        while not self._stop.wait(poll):
            stalled_for = time.monotonic() - self._last_beat
            peer = self._peer_fired()
            if stalled_for >= self.timeout() or peer is not None:
                try:
                    self._fire(stalled_for, peer)
                except BaseException:  # a full disk, say: the process still ends, with what went wrong
                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(EXIT_STALLED)
            self._publish()
            backstop_at = self._last_beat + self.timeout() + BACKSTOP_S
            if backstop_at != self._backstop_at:
                faulthandler.dump_traceback_later(backstop_at - time.monotonic(), exit=True, file=sys.__stderr__)
                self._backstop_at = backstop_at

    def _report(self) -> dict:
        """What this process is doing, on the shared (wall) clock."""
        return {"done": self.done, "doing": self._activity, "host": self.host,
                "since": time.time() - (time.monotonic() - self._since)}

    def _publish(self) -> None:
        if self.processes == 1 or self._published == (self.done, self._activity):
            return
        self._published = (self.done, self._activity)
        _kv("key_value_set", f"{KEY}/progress/{self.process}", json.dumps(self._report()), allow_overwrite=True)

    def _peer_fired(self) -> int | None:
        if self.processes == 1:
            return None
        fired = _kv("key_value_try_get", f"{KEY}/stalled")
        return None if fired is None else int(fired)

    def _fire(self, stalled_for: float, peer: int | None) -> None:
        self.fired = True
        faulthandler.cancel_dump_traceback_later()
        multihost.run_over()  # a peer that leaves from now on is not 'lost'
        multi = self.processes > 1
        if multi:
            self._published = None
            self._publish()
            if peer is None:
                _kv("key_value_set", f"{KEY}/stalled", str(self.process), allow_overwrite=True)
        path = self.dump(stalled_for)
        reports = {self.process: self._report()}
        if multi:
            _kv("key_value_set", f"{KEY}/dumped/{self.process}", "1", allow_overwrite=True)
            self._wait_for(lambda: len(_kv("key_value_dir_get", f"{KEY}/dumped/") or []) == self.processes)
            published = {int(key.rsplit("/", 1)[1]): json.loads(text)
                         for key, text in _kv("key_value_dir_get", f"{KEY}/progress/") or []}
            reports = {i: published.get(i) for i in range(self.processes)}
        who = who_stopped(reports, time.time()) if multi else f"this process was {self._activity}"
        cause = "" if peer is None else f" (process {peer} found it first)"
        log.error(f"no step completed for {stalled_for:.0f} s (train.step_timeout {self.timeout():.0f} s) after "
                  f"step {self.done}{cause}: {who}; stacks in {path.parent}; {multihost.RESUME_HINT}")
        sys.stdout.flush()
        if multi and self.process != 0:
            _kv("key_value_set", f"{KEY}/left/{self.process}", "1", allow_overwrite=True)
        elif multi:  # the coordination service leaves last
            self._wait_for(lambda: len(_kv("key_value_dir_get", f"{KEY}/left/") or []) == self.processes - 1)
            time.sleep(LEAVE_S)
        os._exit(EXIT_STALLED)

    @staticmethod
    def _wait_for(ready, limit_s: float = PEERS_WAIT_S) -> None:
        deadline = time.monotonic() + limit_s
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)

    def dump(self, stalled_for: float) -> Path:
        """<out>/stalls/process<i>-step<k>.txt (a later stall at the same step adds .2, .3, ...)."""
        folder = self.out / "stalls"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"process{self.process}-step{self.done}.txt"
        n = 1
        while path.exists():
            n += 1
            path = folder / f"process{self.process}-step{self.done}.{n}.txt"
        with open(path, "w") as f:
            f.write(f"meshtrain step watchdog: process {self.process} of {self.processes} (host {self.host}, "
                    f"pid {os.getpid()}), {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
                    f"no step completed for {stalled_for:.1f} s (train.step_timeout {self.timeout():.1f} s); "
                    f"last completed step {self.done}; {self._activity} for "
                    f"{time.monotonic() - self._since:.1f} s\n\n--- Python stacks (every thread, most recent call "
                    f"first) ---\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n--- devices ---\n" + _devices() + "\n--- device stacks ---\nnot available: JAX has no API "
                    "that reports where a running device program is; the Python stacks above show which call "
                    "waits on the devices\n")
        return path


def _devices() -> str:
    lines = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a wedged runtime: the dump goes on without it
            stats = {}
        memory = (f"{stats['bytes_in_use'] / 1e9:.2f} GB in use, peak {stats.get('peak_bytes_in_use', 0) / 1e9:.2f} GB"
                  if "bytes_in_use" in stats else "memory figures not reported")
        lines.append(f"{d} ({d.device_kind}, process {d.process_index}): {memory}")
    return "\n".join(lines) + "\n"


def _kv(method: str, *args, **kwargs):
    """A call of JAX's coordination-service client (key-value store; a folder's keys in one call, so a
    large job does not send one call per process); None when it fails (the key is not there, or a
    peer or the coordinator is gone: the watchdog goes on with what it has)."""
    try:
        from jax._src import distributed  # the client has no public handle

        return getattr(distributed.global_state.client, method)(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return None
