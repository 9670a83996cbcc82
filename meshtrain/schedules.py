"""Pipeline schedules as static timetables.

A schedule is, for each stage, the order in which it runs its actions: `F(m, v)` runs chunk v of
microbatch m forward, `B(m, v)` runs it backward. A device (stage s) holds `virtual` chunks of
layers; chunk v of stage s is model stage v * stages + s (circular placement, as in Megatron's
interleaved schedule). One small function per schedule gives that order, written as
warm-up / steady / cool-down. `timetable` then places every action on a tick: each action takes one
tick and starts as soon as its stage is free and its input has arrived (an output sent at tick t
is there at tick t + 1). The executor in `meshtrain/pipeline.py` runs the resulting table.

Bubble: with unit-time forward and backward, each stage is busy 2 * M * V ticks of
2 * (M * V + S - 1), so the idle fraction is (S - 1) / (V * M + S - 1): (S - 1) / (M + S - 1) for
GPipe and 1F1B (Narayanan et al. 2021, eq. 1 and 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtrain.config import UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def gpipe_order(stages: int, micro: int, stage: int) -> list[Action]:
    """Every forward, then every backward (the backward of m needs all of m's activations)."""
    return [Action("F", m) for m in range(micro)] + [Action("B", m) for m in range(micro)]


def one_f_one_b_order(stages: int, micro: int, stage: int) -> list[Action]:
    """Warm up with stages - 1 - stage forwards, then alternate one forward and one backward, then
    drain the backwards: at most `stages` microbatches are ever in flight on a stage."""
    warmup = min(stages - 1 - stage, micro)
    order = [Action("F", m) for m in range(warmup)]
    for i in range(micro - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    return order + [Action("B", m) for m in range(micro - warmup, micro)]


def interleaved_order(stages: int, micro: int, stage: int, virtual: int) -> list[Action]:
    """1F1B over V chunks per device. Microbatches go in groups of `stages`: a group runs chunk 0,
    then chunk 1, ... forward, and the chunks in reverse backward. The longer warm-up fills the
    V-times-deeper circular pipeline."""
    total = micro * virtual

    def nth(k: int, kind: str) -> Action:
        group, rest = divmod(k, stages * virtual)
        chunk = rest // stages
        return Action(kind, group * stages + rest % stages, chunk if kind == "F" else virtual - 1 - chunk)

    warmup = min(2 * (stages - 1 - stage) + (virtual - 1) * stages, total)
    order = [nth(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        order += [nth(warmup + i, "F"), nth(i, "B")]
    return order + [nth(k, "B") for k in range(total - warmup, total)]


def stage_orders(schedule: str, stages: int, micro: int, virtual: int = 1) -> list[list[Action]]:
    check(schedule, stages, micro, virtual)
    if schedule == "gpipe":
        return [gpipe_order(stages, micro, s) for s in range(stages)]
    if schedule == "1f1b":
        return [one_f_one_b_order(stages, micro, s) for s in range(stages)]
    return [interleaved_order(stages, micro, s, virtual) for s in range(stages)]


def check(schedule: str, stages: int, micro: int, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise UserError(f"pipeline.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if micro < stages:
        raise UserError(f"pipeline.microbatches={micro} is fewer than the {stages} pipeline stages: stages "
                        f"would wait forever; use at least {stages}")
    if schedule == "interleaved":
        if virtual < 2:
            raise UserError("pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2")
        if micro % stages:
            raise UserError(f"pipeline.schedule=interleaved needs pipeline.microbatches ({micro}) to be a "
                            f"multiple of the pipeline size ({stages})")
    elif virtual != 1:
        raise UserError(f"pipeline.virtual_stages={virtual} needs pipeline.schedule=interleaved")


def _input_of(action: Action, stage: int, stages: int, virtual: int):
    """(stage, action) whose output this action consumes, or None for the very first chunk."""
    m, v = action.micro, action.chunk
    if action.kind == "F":
        if stage > 0:
            return stage - 1, Action("F", m, v)
        return (stages - 1, Action("F", m, v - 1)) if v > 0 else None
    if stage == stages - 1 and v == virtual - 1:  # the last chunk starts from its own loss
        return stage, Action("F", m, v)
    if stage < stages - 1:
        return stage + 1, Action("B", m, v)
    return 0, Action("B", m, v + 1)


@dataclass
class Timetable:
    schedule: str
    stages: int
    micro: int
    virtual: int
    ticks: list[list[Action | None]]  # ticks[t][s]

    @property
    def bubble(self) -> float:
        """Idle fraction of stage-ticks."""
        busy = sum(a is not None for row in self.ticks for a in row)
        return 1 - busy / (len(self.ticks) * self.stages)

    @property
    def bubble_formula(self) -> float:
        S, M, V = self.stages, self.micro, self.virtual
        return (S - 1) / (V * M + S - 1)

    def in_flight(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) pairs forwarded but not yet backwarded at once."""
        peaks = []
        for s in range(self.stages):
            live = peak = 0
            for row in self.ticks:
                if row[s] is not None:
                    live += 1 if row[s].kind == "F" else -1
                    peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def when(self) -> dict[tuple[int, Action], int]:
        return {(s, a): t for t, row in enumerate(self.ticks) for s, a in enumerate(row) if a is not None}


def timetable(schedule: str, stages: int, micro: int, virtual: int = 1) -> Timetable:
    """Place each stage's actions, in its order, at the earliest tick its input allows."""
    orders = stage_orders(schedule, stages, micro, virtual)
    done: dict[tuple[int, Action], int] = {}
    position = [0] * stages
    ticks = []
    while any(p < len(o) for p, o in zip(position, orders)):
        t = len(ticks)
        row = []
        for s in range(stages):
            action = orders[s][position[s]] if position[s] < len(orders[s]) else None
            source = action and _input_of(action, s, stages, virtual)
            ready = action is not None and (source is None or done.get(source, t) < t)
            row.append(action if ready else None)
        if all(a is None for a in row):
            raise AssertionError(f"{schedule} schedule deadlocks at tick {t}")  # a bug in an order function
        for s, action in enumerate(row):
            if action is not None:
                done[(s, action)] = t
                position[s] += 1
        ticks.append(row)
    return Timetable(schedule, stages, micro, virtual, ticks)


# ---- the arrays the executor indexes by (tick, stage) ----
IDLE, FORWARD, BACKWARD = range(3)


def executor_tables(tt: Timetable) -> dict[str, np.ndarray]:
    """int32 [ticks, stages] arrays: what each stage does at each tick (kind, micro, chunk), what it
    receives at the end of the tick from its neighbours, and the buffer sizes that hold received
    activations (`stash`, kept until the backward) and cotangents (`grads`) without overwriting."""
    S, V = tt.stages, tt.virtual
    T = len(tt.ticks)
    arrays = {k: np.zeros((T, S), np.int32) for k in
              ("kind", "micro", "chunk", "recv_f", "recv_f_micro", "recv_f_chunk", "recv_b", "recv_b_micro", "recv_b_chunk")}
    when = tt.when()
    stash_live, grad_live = {}, {}  # (stage, chunk, micro) -> (first tick held, last tick needed)
    for t, row in enumerate(tt.ticks):
        for s, a in enumerate(row):
            if a is None:
                continue
            first, last = (s == 0 and a.chunk == 0), (s == S - 1 and a.chunk == V - 1)
            kind = FORWARD if a.kind == "F" else BACKWARD
            arrays["kind"][t, s], arrays["micro"][t, s], arrays["chunk"][t, s] = kind, a.micro, a.chunk
            if a.kind == "F" and not last:  # the output goes to the next model stage
                to, chunk = (s + 1) % S, a.chunk + (s == S - 1)
                arrays["recv_f"][t, to], arrays["recv_f_micro"][t, to], arrays["recv_f_chunk"][t, to] = 1, a.micro, chunk
                stash_live[(to, chunk, a.micro)] = (t + 1, when[(to, Action("B", a.micro, chunk))])
            if a.kind == "B" and not first:  # the input's cotangent goes to the previous model stage
                to, chunk = (s - 1) % S, a.chunk - (s == 0)
                arrays["recv_b"][t, to], arrays["recv_b_micro"][t, to], arrays["recv_b_chunk"][t, to] = 1, a.micro, chunk
                grad_live[(to, chunk, a.micro)] = (t + 1, when[(to, Action("B", a.micro, chunk))])
    arrays["stash_slots"] = np.int32(_slots(stash_live))
    arrays["grad_slots"] = np.int32(_slots(grad_live))
    return arrays


def _slots(live: dict) -> int:
    """The fewest buffer slots such that microbatch m of a (stage, chunk) can use slot m % slots
    without overwriting one still needed."""
    slots = 1
    while True:
        busy = {}
        if all(_claim(busy, (s, v, m % slots), span) for (s, v, m), span in sorted(live.items(), key=lambda kv: kv[1])):
            return slots
        slots += 1


def _claim(busy: dict, slot, span) -> bool:
    if slot in busy and busy[slot] >= span[0]:
        return False
    busy[slot] = span[1]
    return True
