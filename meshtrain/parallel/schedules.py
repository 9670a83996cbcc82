"""Pipeline schedules as static timetables, timed the way SPMD runs them.

A schedule is, for each stage, the order of its slots. A slot is what one stage does in one tick:
one action or a few (`F(m, v)`: forward of chunk v of microbatch m; `B(m, v)`: its backward;
`W(m, v)`: its weight gradient, under zero-bubble only). A device (stage s) holds `virtual` chunks of
layers; chunk v of stage s is model stage v * stages + s (circular placement, as in Megatron's
interleaved schedule). `timetable` places every slot at the earliest tick its inputs allow (an
output sent at tick t is there at tick t + 1; within a slot, actions run in order).

Time is lockstep: in one SPMD program every stage advances one tick together, so a tick lasts as
long as its most expensive slot, and idle is what the other stages wait. Action costs, a forward
= 1: a backward does two matmuls per forward matmul (dX and dW), 2, plus 1 when it first recomputes
the forward (`parallel.residuals=recompute`); under zero-bubble B is dX alone (1) and W is dW (1).
So the schedules are written to balance ticks, not only to leave few idle slots:
- GPipe: every forward, then every backward; all stages do the same kind of work in a tick.
- 1F1B: after a warm-up of 2(S-1-s) forwards, each tick holds one forward *and* one backward on
  every stage. (The classic one-action-per-tick 1F1B with S-1-s warm-up forwards puts a 1-unit
  forward beside a 2-3-unit backward in most ticks: 45% idle at S=4, M=8 in lockstep.) The longer
  warm-up keeps up to 2S-1 microbatches in flight on stage 0, still independent of M.
- Interleaved: the same over V chunks per device, warm-up 2(S-1-s) + (V-1)S.
- Zero-bubble (ZB-H1, Qi et al. 2023): the classic 1F1B order of F and B, one action per tick (all
  cost 1 now); each W waits in a queue and runs in a tick where the stage's next F or B cannot, or
  when more than S-1 are queued (which bounds memory at 1F1B's plus S-1 deferred weight gradients).

Idle fractions these give, lockstep (printed by `python -m meshtrain.plan --schedule ...`):
(S-1)/(V*M+S-1) for GPipe, 1F1B and interleaved (Narayanan et al. 2021, eq. 1 and 2), and
(S-1)/(3M+S-1) for zb (ZB-H1's (S-1)(T_F+T_B-T_W) bubble with unit costs).

Each schedule is one `Schedule` entry in `SCHEDULES` (at the end of the orders): its order, its
action costs, its bubble formula and what sets it apart (a split weight gradient, virtual stages).
Everything else (the config's choices, the checks, the timetable, the executor's tables and
program, the planner) asks the entry, never the name: a new schedule is a new entry
(docs/pipeline.md, "Adding a schedule").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from meshtrain.core.errors import UserError


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


Slot = tuple[Action, ...]


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule, all the library knows of it (an entry of `SCHEDULES`)."""
    name: str  # the value of parallel.schedule and of `plan --schedule`
    order: Callable[[int, int, int, int], list[Slot]]  # (stages, micro, stage, virtual) -> the stage's slots
    costs: dict[str, int]  # time of each action ("F", "B", "W"), one forward = 1, with saved residuals
    bubble_terms: Callable[[int, int, int], tuple[int, int]]  # (S, M, V) -> lockstep idle as (numerator, denominator)
    bubble_expression: str  # the same in words, printed by the planner
    splits_weight_grad: bool = False  # B is the input gradient alone; a W action computes the weight gradient later
    interleaved: bool = False  # V >= 2 chunks of layers per device (parallel.virtual_stages)

    def action_costs(self, residuals: str = "save") -> dict[str, int]:
        """`costs`; under parallel.residuals=recompute a backward also reruns the forward (+1). (A
        schedule that splits the weight gradient refuses recompute: `check_residuals`.)"""
        if residuals == "recompute" and not self.splits_weight_grad:
            return {**self.costs, "B": self.costs["B"] + 1}
        return dict(self.costs)

    def bubble(self, stages: int, micro: int, virtual: int = 1) -> float:
        """The idle fraction its bubble formula gives."""
        idle, total = self.bubble_terms(stages, micro, virtual)
        return idle / total


def _singles(actions) -> list[Slot]:
    return [(a,) for a in actions]


def gpipe_order(stages: int, micro: int, stage: int, virtual: int = 1) -> list[Slot]:
    """Every forward, then every backward (the backward of m needs all of m's activations)."""
    return _singles([Action("F", m) for m in range(micro)] + [Action("B", m) for m in range(micro)])


def one_f_one_b_order(stages: int, micro: int, stage: int, virtual: int = 1) -> list[Slot]:
    """Warm up with 2(S-1-s) forwards, then one forward and one backward per tick, then drain the
    backwards. Forward m reaches stage s at tick m + s and its backward leaves the last stage with
    it, so backward i is back at stage s at tick i + 2(S-1) - s: a warm-up of 2(S-1-s) pairs them."""
    warmup = min(2 * (stages - 1 - stage), micro)
    pairs = [(Action("F", warmup + i), Action("B", i)) for i in range(micro - warmup)]
    return (_singles(Action("F", m) for m in range(warmup)) + pairs
            + _singles(Action("B", m) for m in range(micro - warmup, micro)))


def interleaved_order(stages: int, micro: int, stage: int, virtual: int) -> list[Slot]:
    """1F1B pairs over V chunks per device. Microbatches go in groups of `stages`: a group runs
    chunk 0, then chunk 1, ... forward, and the chunks in reverse backward. The warm-up also fills
    the V-times-deeper circular pipeline."""
    total = micro * virtual

    def nth(k: int, kind: str) -> Action:
        group, rest = divmod(k, stages * virtual)
        chunk = rest // stages
        return Action(kind, group * stages + rest % stages, chunk if kind == "F" else virtual - 1 - chunk)

    warmup = min(2 * (stages - 1 - stage) + (virtual - 1) * stages, total)
    pairs = [(nth(warmup + i, "F"), nth(i, "B")) for i in range(total - warmup)]
    return (_singles(nth(k, "F") for k in range(warmup)) + pairs
            + _singles(nth(k, "B") for k in range(total - warmup, total)))


def zero_bubble_order(stages: int, micro: int, stage: int, virtual: int = 1) -> list[Slot]:
    """ZB-H1's forwards and input-gradient backwards, in the classic 1F1B order (S-1-s warm-up
    forwards, then alternate); `timetable` slots the weight gradients into it."""
    warmup = min(stages - 1 - stage, micro)
    order = [Action("F", m) for m in range(warmup)]
    for i in range(micro - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    return _singles(order + [Action("B", m) for m in range(micro - warmup, micro)])


# ---- the registry: one entry per schedule ----
FUSED_BACKWARD = {"F": 1, "B": 2, "W": 0}  # a backward computes dX and dW: two matmuls per forward matmul
SPLIT_BACKWARD = {"F": 1, "B": 1, "W": 1}  # B computes dX alone, W computes dW later


def narayanan_terms(S: int, M: int, V: int) -> tuple[int, int]:
    """(S-1)/(V*M+S-1): Narayanan et al. 2021, eq. 1 (V = 1) and 2."""
    return S - 1, V * M + S - 1


SCHEDULES = {s.name: s for s in (
    Schedule(name="gpipe", order=gpipe_order, costs=FUSED_BACKWARD,
             bubble_terms=narayanan_terms, bubble_expression="(S-1)/(V*M+S-1)"),
    Schedule(name="1f1b", order=one_f_one_b_order, costs=FUSED_BACKWARD,
             bubble_terms=narayanan_terms, bubble_expression="(S-1)/(V*M+S-1)"),
    Schedule(name="interleaved", order=interleaved_order, costs=FUSED_BACKWARD,
             bubble_terms=narayanan_terms, bubble_expression="(S-1)/(V*M+S-1)", interleaved=True),
    # ZB-H1 (Qi et al. 2023): its (S-1)(T_F+T_B-T_W) bubble with unit costs
    Schedule(name="zb", order=zero_bubble_order, costs=SPLIT_BACKWARD,
             bubble_terms=lambda S, M, V: (S - 1, 3 * M + S - 1), bubble_expression="(S-1)/(3M+S-1)",
             splits_weight_grad=True),
)}


def forwards_of(schedule: str | Schedule) -> Schedule:
    """The schedule's forwards alone, in its order: a forward-only pass through the stages (DPO's
    reference log-probs, meshtrain/engine/pipeline.py `make_pipeline_scores`). Not a choice of
    parallel.schedule, so not in `SCHEDULES`."""
    sched = lookup(schedule)

    def order(stages: int, micro: int, stage: int, virtual: int = 1) -> list[Slot]:
        slots = [tuple(a for a in slot if a.kind == "F") for slot in sched.order(stages, micro, stage, virtual)]
        return [slot for slot in slots if slot]

    return Schedule(name=f"{sched.name} forwards", order=order, costs={"F": 1}, bubble_terms=narayanan_terms,
                    bubble_expression="(S-1)/(V*M+S-1)", interleaved=sched.interleaved)


def lookup(schedule: str | Schedule) -> Schedule:
    """The entry named `schedule` (an entry is returned as it is)."""
    if isinstance(schedule, Schedule):
        return schedule
    if schedule not in SCHEDULES:
        raise UserError(f"parallel.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule]


def stage_orders(schedule: str | Schedule, stages: int, micro: int, virtual: int = 1) -> list[list[Slot]]:
    check(schedule, stages, micro, virtual)
    return [lookup(schedule).order(stages, micro, s, virtual) for s in range(stages)]


def check(schedule: str | Schedule, stages: int, micro: int, virtual: int) -> None:
    sched = lookup(schedule)
    if micro < stages:
        raise UserError(f"parallel.microbatches={micro} is fewer than the {stages} pipeline stages: stages "
                        f"would wait forever; use at least {stages}")
    if sched.interleaved:
        if virtual < 2:
            raise UserError(f"parallel.schedule={sched.name} needs parallel.virtual_stages >= 2")
        if micro % stages:
            raise UserError(f"parallel.schedule={sched.name} needs parallel.microbatches ({micro}) to be a "
                            f"multiple of the pipeline size ({stages})")
    elif virtual != 1:
        interleaved = ", ".join(name for name, s in SCHEDULES.items() if s.interleaved)
        raise UserError(f"parallel.virtual_stages={virtual} needs parallel.schedule={interleaved}")


def check_residuals(schedule: str | Schedule, residuals: str, remat: str) -> None:
    sched = lookup(schedule)
    if residuals == "recompute" and sched.splits_weight_grad:
        raise UserError(f"parallel.schedule={sched.name} needs parallel.residuals=save: its weight gradients run "
                        f"after the backward, from the saved residuals")
    if residuals == "recompute" and remat != "none":
        raise UserError(f"parallel.residuals=recompute with parallel.remat={remat} would recompute each chunk "
                        f"twice; use parallel.residuals=save (it keeps only what parallel.remat saves) or "
                        f"parallel.remat=none")


def _input_of(action: Action, stage: int, stages: int, virtual: int):
    """(stage, action) whose output this action consumes, or None for the very first chunk."""
    m, v = action.micro, action.chunk
    if action.kind == "W":  # the weight gradient needs the backward's output cotangents
        return stage, Action("B", m, v)
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
    schedule: Schedule
    stages: int
    micro: int
    virtual: int
    ticks: list[list[Slot]]  # ticks[t][s]; () is idle
    residuals: str = "save"

    @property
    def costs(self) -> dict[str, int]:
        return self.schedule.action_costs(self.residuals)

    def slot_cost(self, slot: Slot) -> int:
        return sum(self.costs[a.kind] for a in slot)

    @property
    def tick_costs(self) -> list[int]:
        """Lockstep: a tick lasts as long as its most expensive slot."""
        return [max(self.slot_cost(slot) for slot in row) for row in self.ticks]

    @property
    def time(self) -> int:
        return sum(self.tick_costs)

    @property
    def bubble(self) -> float:
        """Idle fraction of stage-time in lockstep."""
        busy = sum(self.slot_cost(slot) for row in self.ticks for slot in row)
        return 1 - busy / (self.time * self.stages)

    @property
    def bubble_formula(self) -> float:
        return self.schedule.bubble(self.stages, self.micro, self.virtual)

    def in_flight(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) pairs whose residuals it holds at once (from the
        forward to the backward, or to the weight gradient when the schedule splits it off)."""
        release = "W" if self.schedule.splits_weight_grad else "B"
        peaks = []
        for s in range(self.stages):
            live = peak = 0
            for row in self.ticks:
                live += sum(a.kind == "F" for a in row[s])
                peak = max(peak, live)
                live -= sum(a.kind == release for a in row[s])
            peaks.append(peak)
        return peaks

    def when(self) -> dict[tuple[int, Action], int]:
        return {(s, a): t for t, row in enumerate(self.ticks) for s, slot in enumerate(row) for a in slot}


def timetable(schedule: str | Schedule, stages: int, micro: int, virtual: int = 1, residuals: str = "save",
              orders: list[list[Slot]] | None = None) -> Timetable:
    """Place each stage's slots, in order, at the earliest tick their inputs allow. When the
    schedule splits the weight gradient (zb), each backward queues its W, and a stage runs its oldest
    queued W instead when its next slot must wait, when its order is done, or when more than S-1 are
    queued. `orders` times other orders under a schedule's costs (benchmarks/pipeline.py times the
    classic 1F1B that way)."""
    schedule = lookup(schedule)
    orders = orders or stage_orders(schedule, stages, micro, virtual)
    done: dict[tuple[int, Action], int] = {}
    position = [0] * stages
    queued: list[list[Action]] = [[] for _ in range(stages)]
    ticks = []
    while any(p < len(o) for p, o in zip(position, orders)) or any(queued):
        t = len(ticks)
        row = [_next_slot(orders[s], position[s], queued[s], s, stages, virtual, done, t) for s in range(stages)]
        if not any(row):
            raise AssertionError(f"{schedule.name} schedule deadlocks at tick {t}")  # a bug in an order function
        for s, slot in enumerate(row):
            if slot and slot[0].kind == "W":
                queued[s].pop(0)
            elif slot:
                position[s] += 1
                queued[s] += [Action("W", a.micro, a.chunk) for a in slot
                              if a.kind == "B" and schedule.splits_weight_grad]
            for a in slot:
                done[(s, a)] = t
        ticks.append(row)
    return Timetable(schedule, stages, micro, virtual, ticks, residuals)


def _next_slot(order, position, queued, s, stages, virtual, done, t) -> Slot:
    slot = order[position] if position < len(order) else ()
    inside: set[Action] = set()
    ready = bool(slot)
    for a in slot:
        source = _input_of(a, s, stages, virtual)
        ready &= source is None or done.get(source, t) < t or (source[0] == s and source[1] in inside)
        inside.add(a)
    if queued and (not ready or len(queued) > stages - 1):
        return (queued[0],)
    return slot if ready else ()


# ---- the arrays the executor indexes by (tick, stage) ----
KINDS = ("F", "B", "W")


def executor_tables(tt: Timetable) -> dict[str, np.ndarray]:
    """int32 [ticks, stages] arrays: for each action kind K in F, B, W whether the stage runs one
    (`K`) and which (`K_micro`, `K_chunk`); what it receives at the end of the tick from its
    neighbours (`recv_f*`: an activation; `recv_b*`: a cotangent); and buffer sizes, in slots per
    chunk, that hold them without overwriting one still needed: received inputs (`input_slots`,
    until the forward, or the backward when it recomputes), saved residuals (`residual_slots`, until
    the backward, or W under zb), received cotangents (`cotangent_slots`, until the backward) and,
    under zb, each layer's output cotangent (`deferred_slots`, from the backward until W)."""
    S, V = tt.stages, tt.virtual
    T = len(tt.ticks)
    names = [f"{k}{suffix}" for k in KINDS for suffix in ("", "_micro", "_chunk")]
    names += [f"recv_{d}{suffix}" for d in "fb" for suffix in ("", "_micro", "_chunk")]
    arrays = {k: np.zeros((T, S), np.int32) for k in names}
    when = tt.when()
    split = tt.schedule.splits_weight_grad
    last_use = "W" if split else "B"
    backward = any(a.kind == "B" for row in tt.ticks for slot in row for a in slot)  # not `forwards_of`'s
    # (stage, chunk, micro) -> (first tick held, last tick needed)
    input_live, residual_live, cotangent_live, deferred_live = {}, {}, {}, {}
    for t, row in enumerate(tt.ticks):
        for s, slot in enumerate(row):
            for a in slot:
                first, last = (s == 0 and a.chunk == 0), (s == S - 1 and a.chunk == V - 1)
                arrays[a.kind][t, s] = 1
                arrays[f"{a.kind}_micro"][t, s], arrays[f"{a.kind}_chunk"][t, s] = a.micro, a.chunk
                if a.kind == "F" and backward:
                    residual_live[(s, a.chunk, a.micro)] = (t, when[(s, Action(last_use, a.micro, a.chunk))])
                if a.kind == "F" and not last:  # the output goes to the next model stage
                    to, chunk = (s + 1) % S, a.chunk + (s == S - 1)
                    arrays["recv_f"][t, to] = 1
                    arrays["recv_f_micro"][t, to], arrays["recv_f_chunk"][t, to] = a.micro, chunk
                    input_live[(to, chunk, a.micro)] = (t + 1, when[(to, Action("F", a.micro, chunk))])
                if a.kind == "B" and not first:  # the input's cotangent goes to the previous model stage
                    to, chunk = (s - 1) % S, a.chunk - (s == 0)
                    arrays["recv_b"][t, to] = 1
                    arrays["recv_b_micro"][t, to], arrays["recv_b_chunk"][t, to] = a.micro, chunk
                    cotangent_live[(to, chunk, a.micro)] = (t + 1, when[(to, Action("B", a.micro, chunk))])
                if a.kind == "F" and last and backward:  # the loss's cotangent, from this stage's own forward
                    cotangent_live[(s, a.chunk, a.micro)] = (t, when[(s, Action("B", a.micro, a.chunk))])
                if a.kind == "B" and split:  # each layer's output cotangent, until W
                    deferred_live[(s, a.chunk, a.micro)] = (t, when[(s, Action("W", a.micro, a.chunk))])
    if tt.residuals == "recompute":  # a chunk's input is read again by its backward
        input_live = {key: (span[0], when[(key[0], Action("B", key[2], key[1]))]) for key, span in input_live.items()}
    arrays["input_slots"] = np.int32(_slots(input_live))
    arrays["residual_slots"] = np.int32(_slots(residual_live))
    arrays["cotangent_slots"] = np.int32(_slots(cotangent_live))
    arrays["deferred_slots"] = np.int32(_slots(deferred_live))
    return arrays


def tick_phases(tables: dict) -> list[tuple[int, int, frozenset]]:
    """[(first tick, end tick, what the phase uses)]: warm-up (before any backward), steady,
    cool-down (after the last forward). `uses` holds the action kinds and the send directions
    ("recv_f", "recv_b") that occur in the phase."""
    T = len(tables["F"])
    ticks_with = lambda name: np.flatnonzero(tables[name].any(axis=1))
    backward = ticks_with("B")
    steady_from, steady_to = (backward[0] if len(backward) else T), ticks_with("F")[-1] + 1
    bounds = sorted({0, min(steady_from, steady_to), max(steady_from, steady_to), T})
    phases = []
    for start, end in zip(bounds, bounds[1:]):
        uses = frozenset(n for n in ("F", "B", "W", "recv_f", "recv_b") if tables[n][start:end].any())
        phases.append((start, end, uses))
    return phases



def sends_per_step(tables: dict) -> int:
    """ppermutes the executor runs in one step: each phase sends in the directions it uses, every tick."""
    return sum((end - start) * len(uses & {"recv_f", "recv_b"}) for start, end, uses in tick_phases(tables))

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
