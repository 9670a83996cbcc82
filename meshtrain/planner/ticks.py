"""A pipeline step's ticks, as the planner reads its program. XLA runs one program on every stage: each
phase of ticks is a `while` (the executor's scan, `ticks_train<i>`; `ticks_forward<i>` for a reference
model's forward-only pass) and every action and stage part in a tick is a `conditional` named
`tick_<tag>` (meshtrain/parallel/tick_tables.py `tick_cond`), whose true branch a stage takes
where the executor's table entry for (tick, stage) says so. Read without the tables, the branches are
alike; read with them (`tick_plan`: for each phase, the tags each stage takes at each tick):

- where the executor pairs F and B (DualPipeV with an expert axis: `pairs_forward_backward`), a
  phase that runs both holds them in one switch (`tick_FB`, meshtrain/engine/pipeline.py
  `act_pair`), whose branch each cell names (`FB=<i>`), F's embedding inside it `FB/F/first` (the head
  and the embedding's gradient follow it, `F/last` and `B/first`);
- a device's work and traffic in a phase is its stages' mean: each (tick, stage) cell counts 1/S of a
  run of the tick's body through the branches that cell takes (`counts`);
- the stages run a tick in lockstep (it ends with their sends), so it lasts as long as its slowest
  stage: a phase's time is the sum over its ticks of the most any stage's cell takes (the walk,
  meshtrain/planner/kernel_time.py).

XLA inlines a phase of one tick (a loop of one iteration) and may unroll a short one: a named
conditional outside its phase's loop (`loose`) stands for one tick of the phase, a mean one, each of
its conditionals priced at its slowest stage apart (a tick of several: a little more than the tick's)."""
from __future__ import annotations

import re
from collections import Counter

from meshtrain.core.errors import UserError
from meshtrain.parallel.schedules import forwards_of, lookup, model_stage, timetable
from meshtrain.parallel.tick_tables import (
    CHANNELS,
    KINDS,
    executor_tables,
    pairs_forward_backward,
    phase_scope,
    tick_phases,
)

Cells = tuple  # [tick][stage] -> frozenset of the tags that stage takes at that tick
_PHASE = re.compile(r'op_name="[^"]*?/(ticks_(?:train|forward)\d+)/while"')
_PHASE_NAMED = re.compile(r'op_name="[^"]*?/(ticks_(?:train|forward)\d+)/')
_TAGGED = re.compile(r'op_name="([^"]*/tick_[\w]+/cond)"')
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"\d+"\}')
_BRANCH_LIST = re.compile(r"branch_computations=\{([^}]*)\}")
_PRED_BRANCH = re.compile(r"(true|false)_computation=%?([\w.\-]+)")


def tick_plan(program) -> dict[str, Cells]:
    """{phase scope: its cells} of the train step's pipeline executors; {} without a pipeline. A cell
    holds the action kinds its stage runs at that tick (F, B, W), `<kind>/first` and `<kind>/last` where
    the action's chunk is the first model stage (it embeds) or the last (the head and the loss), the
    CHANNELS it stores what it received on, and where the executor pairs F and B the branch of their
    switch (`FB=<i>`) and `FB/F/first`."""
    plan, S = program.plan, program.sizes["pipeline"]
    if S == 1:
        return {}
    micro, V = plan.num_microbatches(S), plan.virtual_stages
    passes = [(True, timetable(plan.schedule, S, micro, V, plan.residuals))]
    if program.objective.forward_passes():  # DPO's reference's forward-only pass first, through the same stages
        passes.append((False, timetable(forwards_of(plan.schedule), S, micro, V)))
    placement, out = lookup(plan.schedule).placement, {}
    for trains, tt in passes:
        tables = executor_tables(tt)
        pairs = trains and pairs_forward_backward(tt.schedule, program.sizes.get("expert", 1))
        for i, (start, end, uses) in enumerate(tick_phases(tables)):
            out[phase_scope(trains, i)] = tuple(tuple(_cell(tables, uses, placement, S, V, t, s, pairs)
                                                      for s in range(S)) for t in range(start, end))
    return out


def _cell(tables: dict, uses: frozenset, placement: str, S: int, V: int, t: int, s: int, pairs: bool) -> frozenset:
    tags = {name for name, _, _ in CHANNELS if name in uses and tables[name][t, s]}
    for kind in KINDS:
        if kind in uses and tables[kind][t, s]:
            k = model_stage(placement, s, int(tables[f"{kind}_chunk"][t, s]), S)
            tags |= {kind, *([f"{kind}/first"] if k == 0 else []), *([f"{kind}/last"] if k == S * V - 1 else [])}
    if pairs and {"F", "B"} <= uses:  # one switch holds F and B (`act_pair`): its branch, F's and B's parts inside
        tags |= {f"FB={tables['FB'][t, s]}", *(["FB/F/first"] if "F/first" in tags else [])}  # F's embedding
    return frozenset(tags)


def check_named(plan: dict[str, Cells], text: str) -> None:
    """A pipeline's program names its phases (`ticks_train0` ...) in its metadata; an executable loaded
    from the compilation cache keeps the names of the program it was compiled from (JAX leaves metadata
    out of the cache key): one from before the executor named them cannot be read by its ticks."""
    if plan and next(iter(plan)) not in text:
        raise UserError("the compiled pipeline step carries no tick names: its executable came from the compilation "
                        "cache, compiled by an older meshtrain; plan with --compile-cache off, or remove the cache "
                        "folder (compile_cache in the config)")


def phase(plan: dict[str, Cells], line: str, trips: int) -> Cells | None:
    """The cells of the phase whose scan is this `while` instruction (its line; `trips` its iterations), or
    None. Where XLA states the loop's trip count, it is the phase's ticks, or the plan is not this
    program's; where a pass dropped it (XLA:GPU's collective pipelining peels an iteration off), the
    callers take each iteration as a mean tick of the phase (`trips / len(cells)` of it)."""
    m = _PHASE.search(line) if plan else None
    cells = plan.get(m.group(1)) if m else None
    if cells is not None and trips != len(cells) and _KNOWN_TRIPS.search(line):
        raise ValueError(f"the pipeline phase {m.group(1)} runs {trips} ticks in the program and {len(cells)} in "
                         "its tick plan: the plan was made for another program")
    return cells


def loose(plan: dict[str, Cells], line: str) -> Cells | None:
    """For a named conditional XLA took out of its phase's loop (inlined or unrolled), that phase's cells."""
    named = _PHASE_NAMED.search(line) if plan and _TAGGED.search(line) else None
    return plan.get(named.group(1)) if named else None


def counts(cells: Cells) -> Counter:
    """How many (tick, stage) cells of a phase take each set of tags."""
    return Counter(cell for row in cells for cell in row)


def weighted(cells: Cells, scale: float = 1.0):
    """(cell, its share of a device's work) for each set of tags a phase's cells take: its cells over the
    stages, x `scale` (1 for the phase's loop; the share of its ticks an iteration or a conditional XLA took
    out of the loop stands for)."""
    stages = len(cells[0])
    return [(cell, scale * k / stages) for cell, k in counts(cells).items()]


def lockstep(cells: Cells, seconds: dict) -> float:
    """A phase's seconds: each tick as long as its slowest stage's cell (`seconds`: per set of tags)."""
    return sum(max(seconds[cell] for cell in row) for row in cells)


def branches(line: str) -> list[str]:
    """A `conditional`'s branch computations in the order of its line: branch_computations {b0, b1, ...}
    (an index), or true_computation and false_computation as they appear (a predicate)."""
    found = _BRANCH_LIST.search(line)
    if found:
        return [b.strip().lstrip("%") for b in found.group(1).split(",")]
    return [name for _, name in _PRED_BRANCH.findall(line)]


def chosen(line: str, cell: frozenset) -> str:
    """The branch computation a stage in `cell` takes at a named conditional."""
    return next(b for b, w in zip(branches(line), taken(line, cell)) if w)


def taken(line: str, cell: frozenset | None) -> list[float] | None:
    """Per branch (`branches`' order), 1 for the one a stage in `cell` takes and 0 for the others, for a
    conditional the executor named (`tick_<tag>`, nested tags joined: `F/first`); None for any other, or
    without a cell. lax.cond's branches are [false, true] as an index; as a predicate, named; a
    switch's (`tick_switch`) in its order, the cell naming the index (`FB=3`)."""
    m = _TAGGED.search(line) if cell is not None else None
    if m is None:
        return None
    tag = "/".join(part[len("tick_"):] for part in m.group(1).split("/") if part.startswith("tick_"))
    index = next((int(t.rpartition("=")[2]) for t in cell if t.startswith(f"{tag}=")), None)
    if index is not None:
        return [float(i == index) for i in range(len(branches(line)))]
    found = _BRANCH_LIST.search(line)
    order = ["false", "true"] if found else [which for which, _ in _PRED_BRANCH.findall(line)]
    return [float(which == ("true" if tag in cell else "false")) for which in order]
