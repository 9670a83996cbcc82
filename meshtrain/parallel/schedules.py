"""Pipeline schedules as static timetables, timed the way SPMD runs them.

A schedule is, for each stage, the order of its slots. A slot is what one stage does in one tick:
one action or a few (`F(m, v)`: forward of chunk v of microbatch m; `B(m, v)`: its backward;
`W(m, v)`: its weight gradient, where the schedule splits it off). A device (stage s) holds `virtual`
chunks of layers; chunk v of stage s is model stage v * stages + s (circular placement, as in
Megatron's interleaved schedule), or under DualPipeV's V s and 2S-1-s (`model_stage`). `timetable`
places every slot at the earliest tick its inputs allow (an output sent at tick t is there at tick
t + 1, on the stage itself too; within a slot, actions run in order).

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
- DualPipeV (DeepSeek 2025, DualPipe cut in half): 2 chunks per device in a V (stage s holds model
  stages s and 2S-1-s, so activations go down the stages and back up), and in its steady ticks the
  forward of one chunk beside the full backward (B then W) of the other, of different microbatches:
  independent work in one tick (the executor still runs F and B one after the other, so only the
  sends overlap W). Its order places every W itself (`dualpipev_order`).

Idle fractions these give, lockstep (printed by `python -m meshtrain.plan --schedule ...`):
(S-1)/(V*M+S-1) for GPipe, 1F1B and interleaved (Narayanan et al. 2021, eq. 1 and 2),
(S-1)/(3M+S-1) for zb (ZB-H1's (S-1)(T_F+T_B-T_W) bubble with unit costs), and (5S-8)/(6M+5S-8)
for dualpipev, its units half a device's layers (the timetable's, for every S >= 2 and M >= 2S).

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
    interleaved: bool = False  # V >= 2 chunks of layers per device (parallel.virtual_stages), circular
    placement: str = "circular"  # which model stage chunk v of stage s holds (`model_stage`)
    chunks: int = 0  # the chunks per device the schedule is written for (0: parallel.virtual_stages)
    weight_grad_in_order: bool = False  # its order places each W itself (else `timetable` queues them, as zb)
    # a tick's F and B (of different microbatches) run as one scan over the layers, each layer's forward beside
    # another's backward, so one's all-to-alls can hide under the other's compute (meshtrain/engine/pipeline.py
    # `paired`; where: tick_tables.pairs_forward_backward): DualPipeV's overlap. (Not 1F1B: its last stage runs a
    # microbatch's B right after its F, and the tick's other stages wait for it: lockstep gains nothing.)
    pairs_forward_backward: bool = False

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


def model_stage(placement: str, stage: int, chunk: int, stages: int) -> int:
    """The model stage that chunk `chunk` of pipeline stage `stage` holds: `circular` v * S + s
    (Megatron's interleaved placement); `v`, chunks alternating direction, v * S + s for even v and
    (v + 1) * S - 1 - s for odd (DualPipeV's V: stage s holds model stages s and 2S - 1 - s, so the
    turn at the last device and the loss at the first cost no send)."""
    if placement == "v" and chunk % 2:
        return (chunk + 1) * stages - 1 - stage
    return chunk * stages + stage


def device_of(placement: str, k: int, stages: int) -> tuple[int, int]:
    """(stage, chunk) that holds model stage k: `model_stage`'s inverse."""
    chunk, rest = divmod(k, stages)
    return (stages - 1 - rest if placement == "v" and chunk % 2 else rest), chunk


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


def dualpipev_order(stages: int, micro: int, stage: int, virtual: int = 2) -> list[Slot]:
    """DualPipeV (DeepSeek's DualPipe cut in half, deepseek-ai/DualPipe): two chunks per device in a
    V (`model_stage`), eight steps per stage r: 2(S-1-r) forwards of chunk 0; r+1 of chunks 0 and 1;
    S-1-r of (chunk 1's input gradient, a deferred weight gradient, chunk 1's forward); the main step,
    M-2S+r+1 pairs of a forward of one chunk beside the full backward of the other, in both
    orders (independent work: another microbatch's); S-1-r
    of (backward of chunk 1, then chunk 1's forward beside chunk 0's backward); r+1 backwards of
    each chunk, the second half's weight gradients deferred; S-1-r of (a deferred W, chunk 0's input
    gradient); then the last deferred Ws. Every W is placed here (`weight_grad_in_order`)."""
    S, M, r = stages, micro, stage
    count = {(kind, v): 0 for kind in "FB" for v in (0, 1)}
    deferred: list[Action] = []

    def next_action(kind: str, chunk: int) -> Action:
        m = count[(kind, chunk)]
        count[(kind, chunk)] += 1
        return Action(kind, m, chunk)

    F = lambda v: next_action("F", v)

    def B(v, defer=False) -> Slot:
        """A backward: with its weight gradient at once, or (`defer`) its input gradient alone."""
        b = next_action("B", v)
        if defer:
            deferred.append(Action("W", b.micro, v))
            return (b,)
        return b, Action("W", b.micro, v)

    W = lambda: (deferred.pop(0),)
    slots: list[Slot] = [(F(0),) for _ in range(2 * (S - 1 - r))]
    for _ in range(r + 1):
        slots += [(F(0),), (F(1),)]
    for _ in range(S - 1 - r):
        slots += [B(1, defer=True), W(), (F(1),)]
    for i in range(M - 2 * S + r + 1):
        slots += [(F(0),), B(1)] if i == 0 and r == S - 1 else [(F(0), *B(1))]  # the turn: not overlapped
        slots += [(F(1), *B(0))]
    for _ in range(S - 1 - r):
        slots += [B(1), (F(1), *B(0))]
    half = (r + 1) // 2  # from here the weight gradients wait (the rank's parity picks which chunk first)
    for i in range(r + 1):
        slots += [B(1, defer=i > half or (i == half and r % 2 == 1)), B(0, defer=i >= half)]
    for _ in range(S - 1 - r):
        slots += [W(), B(0, defer=True)]
    slots += [W() for _ in range(len(deferred))]
    return slots


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
    # DualPipeV in lockstep: a stage's 2 chunks x M x (F + B + W) = 6M units (a unit: one chunk, half
    # a device's layers) and 5S-8 idle, which `dualpipev_order`'s timetable gives for every S >= 2, M >= 2S
    # (DeepSeek's (S-1)(F&B+B-3W) counts no tick waiting on a longer slot, as SPMD's lockstep does)
    Schedule(name="dualpipev", order=dualpipev_order, costs=SPLIT_BACKWARD,
             bubble_terms=lambda S, M, V: (5 * S - 8, 6 * M + 5 * S - 8), bubble_expression="(5S-8)/(6M+5S-8)",
             splits_weight_grad=True, placement="v", chunks=2, weight_grad_in_order=True, pairs_forward_backward=True),
)}


def forwards_of(schedule: str | Schedule) -> Schedule:
    """The schedule's forwards alone, in its order: a forward-only pass through the stages (DPO's
    reference log-probs, meshtrain/engine/pipeline_step.py `make_pipeline_scores`). Not a choice of
    parallel.schedule, so not in `SCHEDULES`."""
    sched = lookup(schedule)

    def order(stages: int, micro: int, stage: int, virtual: int = 1) -> list[Slot]:
        slots = [tuple(a for a in slot if a.kind == "F") for slot in sched.order(stages, micro, stage, virtual)]
        return [slot for slot in slots if slot]

    return Schedule(name=f"{sched.name} forwards", order=order, costs={"F": 1}, bubble_terms=narayanan_terms,
                    bubble_expression="(S-1)/(V*M+S-1)", interleaved=sched.interleaved, placement=sched.placement,
                    chunks=sched.chunks)


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
    if sched.chunks:
        if virtual != sched.chunks:
            raise UserError(f"parallel.schedule={sched.name} places {sched.chunks} chunks of layers on each stage: "
                            f"set parallel.virtual_stages={sched.chunks}")
        if micro < 2 * stages:
            raise UserError(f"parallel.schedule={sched.name} needs parallel.microbatches ({micro}) >= twice the "
                            f"pipeline size ({2 * stages}): its warm-up fills both arms of the V")
    elif sched.interleaved:
        if virtual < 2:
            raise UserError(f"parallel.schedule={sched.name} needs parallel.virtual_stages >= 2")
        if micro % stages:
            raise UserError(f"parallel.schedule={sched.name} needs parallel.microbatches ({micro}) to be a "
                            f"multiple of the pipeline size ({stages})")
    elif virtual != 1:
        interleaved = ", ".join(name for name, s in SCHEDULES.items() if s.interleaved or s.chunks)
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


def _input_of(action: Action, stage: int, stages: int, virtual: int, placement: str = "circular"):
    """(stage, action) whose output this action consumes, or None for the very first chunk."""
    m, v = action.micro, action.chunk
    if action.kind == "W":  # the weight gradient needs the backward's output cotangents
        return stage, Action("B", m, v)
    k = model_stage(placement, stage, v, stages)
    if action.kind == "F" and k == 0:
        return None
    if action.kind == "B" and k == stages * virtual - 1:  # the last chunk starts from its own loss
        return stage, Action("F", m, v)
    source, chunk, _ = destination(placement, stage, v, stages, -1 if action.kind == "F" else +1)
    return source, Action(action.kind, m, chunk)


def destination(placement: str, stage: int, chunk: int, stages: int, step: int) -> tuple[int, int, int]:
    """(stage, chunk, ring shift) of the model stage `step` (+1: a forward's output, -1: a backward's
    input gradient) away from chunk `chunk` of `stage`; the shift is the ppermute's (+1 the next
    stage, -1 the previous, 0 this stage itself)."""
    to, to_chunk = device_of(placement, model_stage(placement, stage, chunk, stages) + step, stages)
    shift = (to - stage) % stages  # on 2 stages either neighbour is both: the direction the data flows
    return to, to_chunk, 0 if shift == 0 else step if stages == 2 else 1 if shift == 1 else -1


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
    queues = schedule.splits_weight_grad and not schedule.weight_grad_in_order
    done: dict[tuple[int, Action], int] = {}
    position = [0] * stages
    queued: list[list[Action]] = [[] for _ in range(stages)]
    ticks = []
    while any(p < len(o) for p, o in zip(position, orders)) or any(queued):
        t = len(ticks)
        row = [_next_slot(orders[s], position[s], queued[s], s, stages, virtual, schedule.placement, done, t)
               for s in range(stages)]
        if not any(row):
            raise AssertionError(f"{schedule.name} schedule deadlocks at tick {t}")  # a bug in an order function
        for s, slot in enumerate(row):
            if slot and slot[0] is (queued[s] or [None])[0]:
                queued[s].pop(0)
            elif slot:
                position[s] += 1
                queued[s] += [Action("W", a.micro, a.chunk) for a in slot
                              if a.kind == "B" and queues]
            for a in slot:
                done[(s, a)] = t
        ticks.append(row)
    return Timetable(schedule, stages, micro, virtual, ticks, residuals)


def _next_slot(order, position, queued, s, stages, virtual, placement, done, t) -> Slot:
    slot = order[position] if position < len(order) else ()
    inside: set[Action] = set()
    ready = bool(slot)
    for a in slot:
        source = _input_of(a, s, stages, virtual, placement)
        ready &= source is None or done.get(source, t) < t or (source[0] == s and source[1] in inside)
        inside.add(a)
    if queued and (not ready or len(queued) > stages - 1):
        return (queued[0],)
    return slot if ready else ()


def layer_order(num_layers: int, stages: int, virtual: int, placement: str = "circular") -> np.ndarray:
    """Storage row r of the stacked layers holds model layer order[r]. Device s stores its chunks
    v = 0..V-1 in consecutive rows (so the `layers` axis shards over `pipeline` in plain blocks);
    chunk v of stage s is model stage `model_stage` (the schedule's placement). The identity unless
    virtual > 1."""
    per_chunk = num_layers // (stages * virtual)
    return np.array([model_stage(placement, s, v, stages) * per_chunk + j
                     for s in range(stages) for v in range(virtual) for j in range(per_chunk)])
