"""How often each computation of a compiled program runs per step (`Loops`, mixed into
meshtrain/planner/hlo.py's `Module`): a `while` body its trip count, which XLA states or which is read
off the loop itself; a pipeline phase's tick once per stage through the branches that stage takes
(meshtrain/planner/ticks.py); any other conditional's branches as if taken."""
from __future__ import annotations

import re
from collections import defaultdict

from meshtrain.planner import ticks

TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
LOOP_BODY = re.compile(r"body=%?([\w.\-]+)")
PARAMETER = re.compile(r"parameter\((\d+)\)")
_CALLS = re.compile(r"(?:to_apply|calls|body|condition)=%?([\w.\-]+)")  # a conditional's: ticks.branches
_TUPLE_INDEX = re.compile(r"get-tuple-element\([^)]*\), index=(\d+)")


class Loops:
    """The trip counts and execution counts of `Module` (its `comps`, `roots`, `ticks`, `through`, `callee`)."""

    def trip_count(self, comp: str, ins) -> int:
        """Iterations of a `while` in `comp`: XLA's `known_trip_count`, or where a pass left none (XLA:GPU's
        collective pipelining peels an iteration off a loop and drops it), from the loop itself as XLA's
        while-loop analysis reads it: the induction variable's initial constant, the constant its body
        adds, and the constant its condition compares it with (i < n, i <= n, i > n, i >= n). 1 where the
        loop is not of that form."""
        if (known := TRIP_COUNT.search(ins.line)) is not None:
            return int(known.group(1))
        cond, body = re.search(r"condition=%?([\w.\-]+)", ins.line), LOOP_BODY.search(ins.line)
        index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', ins.line)
        if not (cond and body and index and ins.operands):
            return 1
        k = int(index.group(1))
        start = self._constant(comp, self._tuple_element(comp, ins.operands[0], k))
        step = self._increment(body.group(1), k)
        compare = self._compare(cond.group(1), k)
        if start is None or not step or compare is None:
            return 1
        direction, limit = compare
        span = {"LT": limit - start, "LE": limit - start + step, "GT": start - limit, "GE": start - limit - step}
        if direction not in span:
            return 1
        return max(0, -(-span[direction] // abs(step)))

    def _tuple_element(self, comp: str, name: str, k: int) -> str | None:
        ins = self.through(comp, name)
        return ins.operands[k] if ins is not None and ins.op == "tuple" and k < len(ins.operands) else None

    def _constant(self, comp: str, name: str | None) -> int | None:
        ins = self.through(comp, name)
        m = re.search(r"\bconstant\((-?\d+)\)", ins.line) if ins is not None and ins.op == "constant" else None
        return int(m.group(1)) if m else None

    def _induction(self, comp: str, name: str | None, k: int) -> bool:
        """Whether `name` is element k of `comp`'s parameter tuple."""
        ins = self.through(comp, name)
        element = _TUPLE_INDEX.search(ins.line) if ins is not None and ins.op == "get-tuple-element" else None
        if element is None or element.group(1) != str(k):
            return False
        source = self.through(comp, ins.operands[0])
        return source is not None and source.op == "parameter"

    def _scalar_op(self, comp: str, name: str | None, op: str):
        """(computation, instruction, the fusion it is in or None) of the `op` that computes `name`,
        looking into a fusion's root (`_side` maps the fusion's parameters back to its operands)."""
        ins = self.through(comp, name)
        if ins is not None and ins.op == "fusion" and (callee := self.callee(ins)) in self.comps:
            inner = self.through(callee, self.roots.get(callee))
            if inner is not None and inner.op == op:
                return callee, inner, ins
        return (comp, ins, None) if ins is not None and ins.op == op else None

    def _side(self, comp: str, fusion, outer: str, name: str) -> tuple[str, str | None]:
        """An operand inside a fusion's computation as (computation, name) outside it, where it is a
        parameter of the fusion; else as it is."""
        ins = self.through(comp, name)
        if fusion is not None and ins is not None and ins.op == "parameter":
            return outer, fusion.operands[int(PARAMETER.search(ins.line).group(1))]
        return comp, name

    def _increment(self, body: str, k: int) -> int | None:
        """The constant the body adds to tuple element k (i = i + c)."""
        found = self._scalar_op(body, self._tuple_element(body, self.roots.get(body), k), "add")
        if found is None:
            return None
        comp, add, fusion = found
        sides = [self._side(comp, fusion, body, operand) for operand in add.operands[:2]]
        for (c1, a), (c2, b) in (sides, sides[::-1]):
            if self._induction(c1, a, k) and (value := self._constant(c2, b)) is not None:
                return value
        return None

    def _compare(self, cond: str, k: int) -> tuple[str, int] | None:
        """(direction, the constant) of the condition's i <direction> constant, i = tuple element k."""
        found = self._scalar_op(cond, self.roots.get(cond), "compare")
        if found is None:
            return None
        comp, compare, fusion = found
        direction = re.search(r"direction=(\w+)", compare.line)
        (c1, a), (c2, b) = (self._side(comp, fusion, cond, operand) for operand in compare.operands[:2])
        flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
        if direction and self._induction(c1, a, k) and (value := self._constant(c2, b)) is not None:
            return direction.group(1), value
        if direction and self._induction(c2, b, k) and (value := self._constant(c1, a)) is not None:
            return flip.get(direction.group(1), direction.group(1)), value
        return None

    def execution_counts(self) -> dict[str, float]:
        """How often each computation runs per call of the entry: while bodies by their trip count, a
        pipeline phase's tick per stage through the branches it takes (ticks.py), other branches as if taken."""
        times: dict[str, float] = defaultdict(float)

        def visit(name: str, factor: float, depth: int = 0, cell=None) -> None:
            if name not in self.comps or depth > 50:
                return
            times[name] += factor
            for ins in self.comps[name].values():
                body = LOOP_BODY.search(ins.line) if ins.op == "while" else None
                trips = self.trip_count(name, ins) if body else 1
                cells = ticks.phase(self.ticks, ins.line, trips) if body else None
                for callee in _CALLS.findall(ins.line):
                    if cells is not None and callee == body.group(1):  # each (tick, stage) 1/S of a device's
                        for c, share in ticks.weighted(cells, trips / len(cells)):  # 1, unless a tick was peeled
                            visit(callee, factor * share, depth + 1, c)
                        continue
                    visit(callee, factor * (trips if body and callee == body.group(1) else 1), depth + 1, cell)
                if ins.op == "conditional" and cell is None and (tick := ticks.loose(self.ticks, ins.line)):
                    for c, share in ticks.weighted(tick, 1 / len(tick)):  # a mean tick of its phase
                        visit(ticks.chosen(ins.line, c), factor * share, depth + 1, c)
                elif ins.op == "conditional":
                    weights = ticks.taken(ins.line, cell) or [1.0] * len(ticks.branches(ins.line))
                    for callee, weight in zip(ticks.branches(ins.line), weights):
                        if weight:
                            visit(callee, factor, depth + 1, cell)

        visit(self.entry, 1.0)
        return times
