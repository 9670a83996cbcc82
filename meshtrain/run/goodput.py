"""Goodput: where a run's wall time went. One account per start (a process's fit()), written into that
start's entry of run.json (meshtrain/run/run_dir.py) whenever it changes, at most WRITE_SHARE of the
time (a write that took w seconds waits w / WRITE_SHARE for the next; the start-up, each save and
each rollback always write), so a killed process loses the time since its last record, or since
that wait, whichever is longer; `total` sums the starts.

A start's wall time runs from its beginning to its last written account, and is split into
- `productive`: the step intervals the loop's clock measures (meshtrain/run/actions.py `StepClock`:
  dispatch, the devices' time, the host's work in between), less the data waits, for steps trained
  for the first time;
- `startup` (a start at step 0) or `restarts` (a start that resumes): its beginning to the loop's
  first step, less the compile: distributed init, building the model and data, the restore;
- `compile`: the train step's ahead-of-time compile;
- `checkpoint`: saves blocking the loop (an async save's device-to-host copy, the last save's wait);
- `data`: the loop's waits for batches (`Prefetcher.waited`);
- `evaluation`: validation (train.eval_every) and task scoring (eval.tasks), their compiles included;
- `replayed`: steps trained again, at the time they are retrained (those up to the step the run
  had reached before a guard rollback, or before a crash: the furthest step earlier starts recorded),
  and the rollbacks themselves;
- `other`: the rest (the records written, a profiler trace, the straggler and gradient-norm extras).
goodput = productive / wall. A start begins at the process's start under `python -m meshtrain.train`
(on Linux, where /proc tells; imports included), else at the Trainer's construction (a second fit() of
a Trainer: at its call). The time between a killed process and its rerun is no start's.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from meshtrain.core import schema

# category -> its name in a line, the losses in the order a tie lists them
LABELS = {"productive": "productive steps", "startup": "start-up", "restarts": "restarts", "compile": "compile",
          "checkpoint": "checkpoint", "data": "data waits", "evaluation": "evaluation",
          "replayed": "replayed steps", "other": "other"}
MEASURED = [c for c in LABELS if c != "other"]  # other = wall - the measured ones
# A start's account as run.json records it (`Goodput.account`), checked where it is read
ACCOUNT_SCHEMA = {"first": schema.Int(), "reached": schema.Int(), "replayed_steps": schema.Int(), "wall_s": float,
                  "seconds": schema.Table(float)}
ALWAYS_WRITTEN = ("startup", "restarts", "checkpoint", "replayed")  # once a start, each save and rollback
WRITE_SHARE = 0.01  # a rewrite of run.json takes milliseconds: at most 1% of the run's time


def process_age() -> float | None:
    """Seconds since this process started: /proc/self/stat's starttime (field 22, clock ticks after boot)
    against /proc/uptime; None where there is no /proc."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_time() -> float:
    """time.perf_counter() at this start's beginning: the process's start in `python -m meshtrain.train`,
    else now."""
    now = time.perf_counter()
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    age = process_age() if main is not None and main.name == "meshtrain.train" else None
    return now - age if age is not None and age > 0 else now


class Goodput:
    """One start's account. `begun`: its beginning (perf_counter seconds); `first`: the step it starts at;
    `replay_until`: the furthest step earlier starts reached (steps up to it are replayed); `write`:
    where the account goes whenever it changes (run.json's entry of this start; None: kept only here)."""

    def __init__(self, begun: float, compile_s: float, first: int, replay_until: int = 0, write=None,
                 clock=time.perf_counter):
        self.begun, self.first, self.write, self.clock = begun, first, write, clock
        self.seconds = dict.fromkeys(MEASURED, 0.0)
        self.seconds["compile"] = compile_s
        self.reached, self.replay_until, self.replayed_steps = first, replay_until, 0
        self.next_write = -float("inf")

    def loop_started(self) -> None:
        """The loop is about to dispatch its first step: the start-up is over."""
        self.spend("restarts" if self.first else "startup",
                   self.clock() - self.begun - self.seconds["compile"])

    def spend(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        self._changed(category in ALWAYS_WRITTEN)

    def steps(self, start: int, end: int, seconds: float, data_s: float) -> None:
        """Steps start + 1 .. end took `seconds` of loop time, `data_s` of them waiting for batches; those
        up to `replay_until` were trained before (their share of the time, by count, is replayed)."""
        n = end - start
        again = min(max(self.replay_until - start, 0), n)
        busy = max(seconds - data_s, 0.0)
        self.seconds["data"] += data_s
        self.seconds["replayed"] += busy * again / n
        self.seconds["productive"] += busy * (n - again) / n
        self.replayed_steps += again
        self.reached = max(self.reached, end)
        self._changed()

    def rolled_back(self, reached: int) -> None:
        """A guard rollback from step `reached`: the steps up to it will be trained again."""
        self.reached = max(self.reached, reached)
        self.replay_until = max(self.replay_until, reached)

    def account(self) -> dict:
        """What run.json records: wall_s, seconds by category (`other` the rest), the steps."""
        wall = self.clock() - self.begun
        seconds = {**self.seconds, "other": wall - sum(self.seconds.values())}
        return {"first": self.first, "reached": self.reached, "replayed_steps": self.replayed_steps,
                "wall_s": round(wall, 3), "seconds": {c: round(s, 3) for c, s in seconds.items()}}

    def _changed(self, always: bool = False) -> None:
        if always or self.clock() >= self.next_write:
            self.flush()

    def flush(self) -> None:
        """Write the account now."""
        if self.write is None:
            return
        started = self.clock()
        self.write(self.account())
        finished = self.clock()
        self.next_write = finished + (finished - started) / WRITE_SHARE


def furthest(starts: list[dict]) -> int:
    """The furthest step run.json's `starts` recorded reaching (0 where none has an account)."""
    return max((s["goodput"]["reached"] for s in starts if "goodput" in s), default=0)


def total(accounts: list[dict]) -> dict:
    """The accounts of a run's starts summed: wall_s, seconds by category, starts, restarts (starts that
    resumed), replayed_steps, goodput (productive / wall; None without wall time)."""
    seconds = {c: sum(a["seconds"].get(c, 0.0) for a in accounts) for c in LABELS}
    wall = sum(a["wall_s"] for a in accounts)
    return {"wall_s": wall, "seconds": seconds, "starts": len(accounts),
            "restarts": sum(1 for a in accounts if a["first"]), "goodput": seconds["productive"] / wall if wall > 0
            else None, "replayed_steps": sum(a["replayed_steps"] for a in accounts)}


def losses(summed: dict) -> list[tuple[str, float]]:
    """(category, share of the wall time) of every loss, the largest first."""
    shares = [(c, s / summed["wall_s"]) for c, s in summed["seconds"].items() if c != "productive"]
    return sorted(shares, key=lambda item: -item[1])


def line(summed: dict, named: int = 3) -> str:
    """`goodput 81% (compile 9%, checkpoint 5%, replayed steps 3%)`: the `named` largest losses of at
    least 0.5%."""
    if summed["goodput"] is None:
        return "goodput not measured"
    largest = [f"{LABELS[c]} {share:.0%}" for c, share in losses(summed)[:named] if share >= 0.005]
    starts = f" over {summed['starts']} starts" if summed["starts"] > 1 else ""
    return f"goodput {summed['goodput']:.0%}{starts}" + (f" ({', '.join(largest)})" if largest else "")
