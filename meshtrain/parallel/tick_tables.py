"""The arrays the pipeline executor (meshtrain/engine/pipeline.py) indexes by (tick, stage), made from a
schedule's timetable (meshtrain/parallel/schedules.py): which action each stage runs, what it receives on
each channel at the end of the tick, how many buffer slots hold what waits, and the phases the ticks
run in (the planner counts the sends from them), and the names the executor gives its conditionals and
phases in the program (`tick_cond`, `phase_scope`), by which the planner's walk reads which table entry
decides each (meshtrain/planner/ticks.py)."""
from __future__ import annotations

import jax
import numpy as np

from meshtrain.parallel.schedules import Action, Timetable, destination, model_stage

KINDS = ("F", "B", "W")
# Under a schedule that pairs a tick's F and B (`Schedule.pairs_forward_backward`: DualPipeV), the branch of
# the one conditional that runs them (the `FB` table: F + 2 B). A pair acts on different microbatches or
# chunks, and neither reads what the other writes (the buffers' slots keep their spans apart, `_slots`).
IDLE, F_ONLY, B_ONLY, PAIRED = range(4)
# What a stage receives at the end of a tick: (table, the action kind whose output it is, the ring
# shift it travels: from stage s - shift). Activations go to the next stage and cotangents to the
# previous one; a V placement also sends each the other way (its second arm) and keeps some on the
# stage (its turn, shift 0: no send).
CHANNELS = (("recv_f", "F", 1), ("recv_f_back", "F", -1), ("recv_f_here", "F", 0),
            ("recv_b", "B", -1), ("recv_b_back", "B", 1), ("recv_b_here", "B", 0))


def pairs_forward_backward(schedule, expert: int) -> bool:
    """Whether the executor pairs a tick's F and B (meshtrain/engine/pipeline.py `act_pair`): under a
    schedule written so (`Schedule.pairs_forward_backward`: DualPipeV) where MoE layers exchange rows
    over an `expert` axis of `expert` > 1 devices, whose all-to-alls a pair hides under compute. A
    dense model's exchanges (FSDP's gathers) are hidden already: there the pair gains nothing, and its
    program copies more (planned slower on llama_1b cut to 16 layers, pipeline=4,fsdp=2)."""
    return schedule.pairs_forward_backward and expert > 1


def tick_cond(tag: str, pred, true_fun, false_fun, *operands):
    """`jax.lax.cond` named `tick_<tag>` in the program's op_name metadata: `tag` an action kind (F, B, W)
    or, inside an action, the stage's part (`first`: the embedding, `last`: the head), each taken where its
    table entry (or the stage) says so. (A channel's store is no conditional: it writes a spare slot where
    the table says none, under the name `tick_<channel>`.)"""
    with jax.named_scope(f"tick_{tag}"):
        return jax.lax.cond(pred, true_fun, false_fun, *operands)


def tick_switch(tag: str, index, branches, *operands):
    """`jax.lax.switch` named `tick_<tag>` (as `tick_cond`): a stage takes branch `index`, its table entry."""
    with jax.named_scope(f"tick_{tag}"):
        return jax.lax.switch(index, branches, *operands)


def phase_scope(trains: bool, phase: int) -> str:
    """The name of a phase's scan over its ticks: `ticks_train<i>`, or `ticks_forward<i>` for a
    forward-only pass (a reference model's, in the same step)."""
    return f"ticks_{'train' if trains else 'forward'}{phase}"


def executor_tables(tt: Timetable) -> dict[str, np.ndarray]:
    """int32 [ticks, stages] arrays: for each action kind K in F, B, W whether the stage runs one
    (`K`) and which (`K_micro`, `K_chunk`), and the branch its F and B take where a conditional pairs
    them (`FB`); what it receives at the end of the tick on each of the CHANNELS (`recv_f*`: an
    activation; `recv_b*`: a cotangent); and buffer sizes, in slots per chunk, that hold them without
    overwriting one still needed: received inputs (`input_slots`, until the forward, or the backward
    when it recomputes), saved residuals (`residual_slots`, until the backward, or W under zb),
    received cotangents (`cotangent_slots`, until the backward) and, under zb, what each layer's W
    reads (`deferred_slots`, from the backward until W)."""
    S, V, placement = tt.stages, tt.virtual, tt.schedule.placement
    T = len(tt.ticks)
    names = [f"{k}{suffix}" for k in KINDS for suffix in ("", "_micro", "_chunk")]
    names += [f"{name}{suffix}" for name, _, _ in CHANNELS for suffix in ("", "_micro", "_chunk")]
    arrays = {k: np.zeros((T, S), np.int32) for k in names}
    channel = {(kind, shift): name for name, kind, shift in CHANNELS}
    when = tt.when()
    split = tt.schedule.splits_weight_grad
    last_use = "W" if split else "B"
    backward = any(a.kind == "B" for row in tt.ticks for slot in row for a in slot)  # not `forwards_of`'s

    def receive(kind, t, s, a, step):
        """The output of `a` (stage s, tick t) at the model stage `step` away; its span in the buffer."""
        to, chunk, shift = destination(placement, s, a.chunk, S, step)
        name = channel[(kind, shift)]
        assert not arrays[name][t, to], f"two {name} to stage {to} at tick {t}"  # a bug in an order function
        arrays[name][t, to] = 1
        arrays[f"{name}_micro"][t, to], arrays[f"{name}_chunk"][t, to] = a.micro, chunk
        return (to, chunk, a.micro), (t + 1, when[(to, Action(kind, a.micro, chunk))])

    # (stage, chunk, micro) -> (first tick held, last tick needed)
    input_live, residual_live, cotangent_live, deferred_live = {}, {}, {}, {}
    for t, row in enumerate(tt.ticks):
        for s, slot in enumerate(row):
            assert len({a.kind for a in slot}) == len(slot), f"stage {s} runs two of a kind at tick {t}: {slot}"
            for a in slot:
                k = model_stage(placement, s, a.chunk, S)
                first, last = k == 0, k == S * V - 1
                arrays[a.kind][t, s] = 1
                arrays[f"{a.kind}_micro"][t, s], arrays[f"{a.kind}_chunk"][t, s] = a.micro, a.chunk
                if a.kind == "F" and backward:
                    residual_live[(s, a.chunk, a.micro)] = (t, when[(s, Action(last_use, a.micro, a.chunk))])
                if a.kind == "F" and not last:  # the output goes to the next model stage
                    key, span = receive("F", t, s, a, +1)
                    input_live[key] = span
                if a.kind == "B" and not first:  # the input's cotangent goes to the previous model stage
                    key, span = receive("B", t, s, a, -1)
                    cotangent_live[key] = span
                if a.kind == "F" and last and backward:  # the loss's cotangent, from this stage's own forward
                    cotangent_live[(s, a.chunk, a.micro)] = (t, when[(s, Action("B", a.micro, a.chunk))])
                if a.kind == "B" and split:  # what W reads (the stash), until W
                    deferred_live[(s, a.chunk, a.micro)] = (t, when[(s, Action("W", a.micro, a.chunk))])
    arrays["FB"] = arrays["F"] + 2 * arrays["B"]
    same = (arrays["FB"] == PAIRED) & (arrays["F_micro"] == arrays["B_micro"]) & (arrays["F_chunk"] ==
                                                                                arrays["B_chunk"])
    assert not (tt.schedule.pairs_forward_backward and same.any()), "a pair's B would read what its F writes"
    if tt.residuals == "recompute":  # a chunk's input is read again by its backward
        input_live = {key: (span[0], when[(key[0], Action("B", key[2], key[1]))]) for key, span in input_live.items()}
    arrays["input_slots"] = np.int32(_slots(input_live))
    arrays["residual_slots"] = np.int32(_slots(residual_live))
    arrays["cotangent_slots"] = np.int32(_slots(cotangent_live))
    arrays["deferred_slots"] = np.int32(_slots(deferred_live))
    return arrays


def tick_phases(tables: dict) -> list[tuple[int, int, frozenset]]:
    """[(first tick, end tick, what the phase uses)]: warm-up (before any backward), steady,
    cool-down (after the last forward). `uses` holds the action kinds and the CHANNELS that occur in
    the phase."""
    T = len(tables["F"])
    ticks_with = lambda name: np.flatnonzero(tables[name].any(axis=1))
    backward = ticks_with("B")
    steady_from, steady_to = (backward[0] if len(backward) else T), ticks_with("F")[-1] + 1
    bounds = sorted({0, min(steady_from, steady_to), max(steady_from, steady_to), T})
    phases = []
    for start, end in zip(bounds, bounds[1:]):
        uses = frozenset(n for n in ("F", "B", "W", *(name for name, _, _ in CHANNELS)) if tables[n][start:end].any())
        phases.append((start, end, uses))
    return phases


def sends_per_step(tables: dict) -> int:
    """ppermutes the executor runs in one step: each phase sends on the channels it uses (those
    between stages), every tick."""
    sending = {name for name, _, shift in CHANNELS if shift}
    return sum((end - start) * len(uses & sending) for start, end, uses in tick_phases(tables))


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
