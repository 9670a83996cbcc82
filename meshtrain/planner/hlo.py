"""Collective traffic of a compiled program, read from its HLO text.

Each collective's payload is its output size per device (`dtypes`: the same, by element type, e.g.
int8 gradients and their fp32 scales under compression); instructions inside a `while` body run
`known_trip_count` times (the layer scan), so they are counted that often (meshtrain/planner/loops.py).
A pipeline's ticks count each stage's branches (its table entries, meshtrain/planner/ticks.py): a
device's mean over the stages. Other conditionals' branches are counted as if taken, an upper bound.
Link traffic per device uses the ring algorithms' volumes for the group's size (meshtrain/core/formulas.py).

The planner compiles for GPUs on the CPU backend, which rewrites two things a GPU keeps
(`correct=True` undoes both and reports what it undid under `corrections`):
- bf16 collectives run in f32: the operand is a convert from bf16 (a bf16 value widened, alone or
  at the root of a fusion) and the result is converted back to bf16 (after elementwise arithmetic
  at most) wherever it goes. Such arrays are counted at their bf16 size. (A gradient the program
  casts to f32 before reducing it stays f32 after: it is not counted as widened.)
- A reduce-scatter runs as an all-reduce whose every use is a dynamic slice keeping 1/N of it (N
  the group size), through converts, copies and fusions. Such arrays are counted as the
  reduce-scatter of that 1/N slice: (N-1)/N x B on the links instead of the all-reduce's 2(N-1)/N x B.

`read(...)` lists every collective (`Collective`) with its replica groups as device ids, so its
traffic can be put on the mesh axes (and links) it crosses.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

from meshtrain.core.formulas import ring_traffic
from meshtrain.planner.loops import PARAMETER, Loops

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# read as an all-to-all of the smaller of its operand and output: the packed rows a device sends or gets back
RAGGED = "ragged-all-to-all"  # (meshtrain/ops/block_exchange.py: the rows its sizes name; a busy device may move more)
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "s16": 2,
               "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_INDEX = re.compile(r"index=(\d+)")
_LAYOUT = ("bitcast", "copy", "reshape", "transpose")  # the same values, laid out anew
_SAME_VALUES = ("convert",) + _LAYOUT  # the elements pass through (converted at most)
_DONE = {f"{k}-done" for k in KINDS}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "negate", "maximum", "minimum", "select", "broadcast",
                "dynamic-slice"}



@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    line: str

    @property
    def arrays(self) -> list[tuple[str, int]]:
        return typed_array_elements(self.shape)


@dataclasses.dataclass
class Collective:
    """One collective as it would run on a GPU: `kind` after the corrections, `times` per step,
    `arrays` (element type, bytes) per device, `groups` the device ids of each replica group."""
    kind: str
    name: str
    times: float
    arrays: list[tuple[str, int]]
    groups: list[list[int]]
    widened: int = 0  # bytes counted at bf16 that the CPU program moves as f32
    scattered: bool = False  # an all-reduce + dynamic slice counted as a reduce-scatter
    reassociated: float = 0.0  # bytes per step of all-reduces summed into this one's value, not counted

    @property
    def payload(self) -> int:
        return sum(nbytes for _, nbytes in self.arrays)

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    @property
    def traffic(self) -> float:
        return ring_traffic(self.kind, self.payload, self.group_size)


def typed_array_elements(shape: str) -> list[tuple[str, int]]:
    """(element type, element count) of each array in an HLO shape (a tuple holds several)."""
    return [(dtype, int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)))
            for dtype, dims in _ARRAY.findall(shape)]


# ---- replica groups as device ids ----
def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device ids of each group, from any of XLA's spellings: `{{0,1},{2,3}}`, the iota form
    `[G,S]<=[dims]T(perm)`, the mesh form `mesh['a'=2,'b'=4], device_ids=(...) {'b'}` (the groups
    vary the named axes of that device grid), and a permute's `source_target_pairs`. No groups
    means one group of every device."""
    pairs = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", line)
    if pairs:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([\d,]+)\}", pairs.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        return _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", line)
    if mesh:
        return _mesh_groups(*mesh.groups())
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if listed and re.findall(r"\{([\d,]+)\}", listed.group(1)):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", listed.group(1))]
    return [list(range(num_devices))]


def _mesh_groups(axes: str, device_ids: str | None, chosen: str) -> list[list[int]]:
    names, sizes = [], []
    for name, size in re.findall(r"'([^']+)'=(\d+)", axes):
        names.append(name)
        sizes.append(int(size))
    if device_ids:
        spec = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids.strip())
        ids = _iota(*spec.groups()) if spec else np.array([int(x) for x in device_ids.split(",")])
        grid = np.asarray(ids).reshape(sizes)
    else:
        grid = np.arange(int(np.prod(sizes))).reshape(sizes)
    if re.search(r"':\(", chosen):
        raise ValueError(f"sub-axis replica groups are not read yet: {chosen}")
    picked = [names.index(n) for n in re.findall(r"'([^']+)'", chosen)]
    rest = [i for i in range(len(names)) if i not in picked]
    size = int(np.prod([sizes[i] for i in picked]))
    return grid.transpose(rest + picked).reshape(-1, size).tolist()


# ---- the module's computations and the value flow between instructions ----
class Module(Loops):
    """A compiled program's computations and instructions, parsed from its HLO text."""

    def __init__(self, text: str, tick_plan: dict | None = None):
        self.ticks = tick_plan or {}  # a pipeline's phases (meshtrain/planner/ticks.py `tick_plan`)
        self.comps: dict[str, dict[str, Instr]] = {}
        self.roots: dict[str, str] = {}
        self.params: dict[str, dict[int, str]] = defaultdict(dict)  # computation -> parameter index -> name
        self.entry = None
        comp = None
        for line in text.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                head = line.split("(")[0].split()
                comp = head[-1].lstrip("%")
                if head[0] == "ENTRY":
                    self.entry = comp
                self.comps.setdefault(comp, {})
            elif line.startswith("}"):
                comp = None
            elif comp is not None:
                m = _INSTR.match(line)
                if m:
                    root, name, shape, op = m.groups()
                    self.comps[comp][name] = Instr(name, shape, op, _operands(line, m.end()), line)
                    if root:
                        self.roots[comp] = name
                    if op == "parameter":
                        self.params[comp][int(PARAMETER.search(line).group(1))] = name
        self._users: dict[str, dict[str, list[Instr]]] = {}

    def users(self, comp: str, name: str) -> list[Instr]:
        if comp not in self._users:
            table = defaultdict(list)
            for ins in self.comps[comp].values():
                for operand in set(ins.operands):
                    table[operand].append(ins)
            self._users[comp] = table
        return self._users[comp].get(name, [])

    def callee(self, ins: Instr) -> str | None:
        m = re.search(r"calls=%?([\w.\-]+)", ins.line)
        return m.group(1) if m else None

    def parameter(self, comp: str, index: int) -> str | None:
        return self.params[comp].get(index)

    def from_bf16(self, comp: str, name: str, depth: int = 0) -> bool:
        """Whether this f32 value is a bf16 value widened: a convert of a bf16 array, possibly
        under bitcasts, copies, reshapes and elementwise arithmetic, or the root of a fusion that is one."""
        ins = self.comps[comp].get(name)
        if ins is None or depth > 20:
            return False
        if ins.op == "convert":
            source = self.comps[comp].get(ins.operands[0])
            return source is not None and source.arrays[:1] == [("bf16", source.arrays[0][1])]
        if ins.op in _LAYOUT:
            return self.from_bf16(comp, ins.operands[0], depth + 1)
        if ins.op in _ELEMENTWISE:  # bf16 arithmetic the CPU runs in f32
            return any(self.from_bf16(comp, operand, depth + 1) for operand in ins.operands)
        if ins.op == "fusion" and (callee := self.callee(ins)) in self.comps:
            return self.from_bf16(callee, self.roots.get(callee), depth + 1)
        return False

    def uses_end_in(self, comp: str, name: str, accept, outer: tuple = (), depth: int = 0) -> bool:
        """Whether every use of this value ends in an instruction `accept(use, value)` approves of
        (True/False; None: not decided here, follow it). Undecided uses are followed through
        `_SAME_VALUES`, into fusions and out of them again (`outer`: the fusions we are inside of,
        innermost last)."""
        if depth > 30:
            return False
        uses = self.users(comp, name)
        here = all(self._use_ends_in(comp, name, u, accept, outer, depth) for u in uses)
        if self.roots.get(comp) == name and outer:  # a fusion's result: follow the fusion's own uses
            (outer_comp, fusion), rest = outer[-1], outer[:-1]
            return here and self.uses_end_in(outer_comp, fusion, accept, rest, depth + 1)
        return bool(uses) and here

    def _use_ends_in(self, comp, name, use: Instr, accept, outer, depth) -> bool:
        verdict = accept(use, name)
        if verdict is not None:
            return verdict
        if use.op in _SAME_VALUES or use.op in _DONE:
            return self.uses_end_in(comp, use.name, accept, outer, depth + 1)
        if use.op == "fusion" and (callee := self.callee(use)) in self.comps:
            params = [self.parameter(callee, k) for k, operand in enumerate(use.operands) if operand == name]
            inner = outer + ((comp, use.name),)
            return all(p and self.uses_end_in(callee, p, accept, inner, depth + 1) for p in params)
        return False

    def only_sliced(self, comp: str, name: str, elements: int, n: int) -> bool:
        """Whether every use of this value ends in a dynamic slice of elements/n elements."""
        def accept(use, value):
            if use.op == "dynamic-slice" and use.operands[0] == value:
                return typed_array_elements(use.shape)[0][1] * n == elements
            return None
        return self.uses_end_in(comp, name, accept)

    def narrowed_to_bf16(self, comp: str, values: list[str]) -> bool:
        """Whether a collective's result is converted back to bf16 before any other use: the
        other half of the CPU backend's widening of a bf16 collective."""
        def accept(use, value):
            if use.op == "convert":
                return use.arrays[0][0] == "bf16"
            passes = use.op in _LAYOUT or use.op in _DONE or use.op in _ELEMENTWISE or use.op == "fusion"
            return None if passes else False
        return bool(values) and all(self.uses_end_in(comp, v, accept) for v in values)

    def scattered(self, comp: str, values: list[str], elements: int, n: int) -> bool:
        """Whether these values (an all-reduce's result) are only ever sliced down to their 1/n
        share: a reduce-scatter."""
        if n <= 1 or elements % n:
            return False
        return bool(values) and all(self.only_sliced(comp, v, elements, n) for v in values)

    def element_values(self, comp: str, ins: Instr, index: int, count: int) -> list[str]:
        """The values standing for element `index` of a collective's (possibly tuple) result."""
        if count == 1 and not ins.shape.startswith("("):
            return [ins.name]
        return [u.name for u in self.users(comp, ins.name)
                if u.op == "get-tuple-element" and int(_INDEX.search(u.line).group(1)) == index]

    def only_layout(self, ins: Instr) -> bool:
        """A fusion that only converts or lays out its one operand anew (`wrapped_convert`)."""
        callee = self.callee(ins) if ins.op == "fusion" and len(ins.operands) == 1 else None
        return callee in self.comps and all(i.op in _SAME_VALUES or i.op == "parameter"
                                            for i in self.comps[callee].values())

    def summed_into(self, comp: str, values: list[str]) -> str | None:
        """The instructions these values all flow into (through converts, bitcasts and copies, alone
        or fused) when each of them adds: an `add`, or a fusion with an `add` inside (the CPU fuses
        the sum into each of its consumers), named together; None if any does not add."""
        sinks = set()
        for value in values:
            for use in self.users(comp, value):
                if use.op in _SAME_VALUES or self.only_layout(use):
                    sink = self.summed_into(comp, [use.name])
                    if sink is None:
                        return None
                    sinks.add(sink)
                else:
                    sinks.add(use.name)
        if not sinks or not all(self._adds(self.comps[comp][name]) for name in sinks if name in self.comps[comp]):
            return None
        return "+".join(sorted(sinks))

    def _adds(self, ins: Instr) -> bool:
        return ins.op == "add" or (ins.op == "fusion" and any(
            i.op == "add" for i in self.comps.get(self.callee(ins), {}).values()))

    def through(self, comp: str, name: str | None) -> Instr | None:
        """The instruction a value comes from, past copies, bitcasts and converts."""
        for _ in range(20):
            ins = self.comps[comp].get(name) if name else None
            if ins is None or ins.op not in ("copy", "bitcast", "convert"):
                return ins
            name = ins.operands[0]
        return None

def _operands(line: str, start: int) -> list[str]:
    depth, end = 1, start
    while end < len(line) and depth:
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return re.findall(r"%([\w.\-]+)", line[start:end - 1])


def read(hlo_text: str, num_devices: int, correct: bool = True, tick_plan: dict | None = None) -> list[Collective]:
    """Every collective of the program, once per instruction and (corrected) kind. A ragged
    all-to-all is an all-to-all of the smaller of its operand and its output (`RAGGED`): for the
    dropless dispatch, the packed side, the rows routed (meshtrain/ops/block_exchange.py)."""
    module = Module(hlo_text, tick_plan)
    found = []
    for comp, times in module.execution_counts().items():
        summed: dict[tuple, Collective] = {}  # all-reduced values added together, by their sum
        for ins in module.comps[comp].values():
            kind = ins.op.removesuffix("-start")
            if kind not in KINDS and kind != RAGGED:
                continue
            groups = replica_groups(ins.line, num_devices)
            n = len(groups[0])
            arrays = typed_array_elements(ins.shape)
            if ins.op.endswith("-start"):  # async: the payload is its -done's result (a combined one's every array)
                done = next((u for u in module.users(comp, ins.name) if u.op == f"{kind}-done"), None)
                arrays = done.arrays if done else [max(arrays, key=lambda a: a[1] * DTYPE_BYTES[a[0]])]
            if kind == RAGGED:
                sides = [typed_array_elements(module.comps[comp][name].shape)[0] for name in ins.operands[:2]]
                kind, arrays = "all-to-all", [min(sides, key=lambda a: a[1])]
            operands = ins.operands if len(ins.operands) == len(arrays) else [None] * len(arrays)
            parts: dict[str, Collective] = {}
            for index, ((dtype, elements), operand) in enumerate(zip(arrays, operands)):
                values = module.element_values(comp, ins, index, len(arrays))
                widened = (correct and dtype == "f32" and operand is not None and module.from_bf16(comp, operand)
                           and module.narrowed_to_bf16(comp, values))
                dtype = "bf16" if widened else dtype
                sum_key, part_kind = None, kind
                if correct and kind == "all-reduce":
                    if module.scattered(comp, values, elements, n):
                        part_kind, elements = "reduce-scatter", elements // n
                    sink = module.summed_into(comp, values)
                    sum_key = sink and (sink, part_kind, elements, dtype, str(groups))
                    if sum_key in summed:  # counted once, with the first value of that sum
                        summed[sum_key].reassociated += times * elements * DTYPE_BYTES[dtype]
                        continue
                part = parts.setdefault(part_kind, Collective(part_kind, ins.name, times, [], groups,
                                                              scattered=part_kind != kind))
                part.arrays.append((dtype, elements * DTYPE_BYTES[dtype]))
                part.widened += elements * DTYPE_BYTES[dtype] if widened else 0
                if sum_key:
                    summed[sum_key] = part
            found += parts.values()
    return found


def by_kind(records: list[Collective]) -> dict[str, dict]:
    """Per kind: executions per step, payload bytes and ring link traffic bytes, per device, and
    `dtypes`: payload bytes by element type."""
    result = {k: {"count": 0.0, "payload_bytes": 0.0, "traffic_bytes": 0.0, "dtypes": defaultdict(float)}
              for k in KINDS}
    for c in records:
        r = result[c.kind]
        r["count"] += c.times
        r["payload_bytes"] += c.times * c.payload
        r["traffic_bytes"] += c.times * c.traffic
        for dtype, nbytes in c.arrays:
            r["dtypes"][dtype] += c.times * nbytes
    for r in result.values():
        r["dtypes"] = dict(r["dtypes"])
    return result


def corrections(records: list[Collective]) -> dict[str, float]:
    """What reading the program as a GPU runs it changed, per step: the bytes counted at bf16 that
    the CPU program widens to f32, the all-reduces counted as reduce-scatters, and the bytes of
    all-reduces summed after reduction that are counted once."""
    return {"bf16_widened_bytes": sum(c.times * c.widened for c in records),
            "all_reduce_as_reduce_scatter": sum(c.times for c in records if c.scattered),
            "all_reduce_reassociated_bytes": sum(c.reassociated for c in records)}


def collectives(hlo_text: str, num_devices: int, correct: bool = True, tick_plan: dict | None = None) -> dict:
    """`by_kind` of the program's collectives (`read`)."""
    return by_kind(read(hlo_text, num_devices, correct, tick_plan))


def reduction_totals(found: dict) -> tuple[float, float]:
    """(executions, payload bytes) per step of the reductions and gathers: every kind but the
    pipeline's point-to-point collective-permutes."""
    kinds = [k for k in KINDS if k != "collective-permute"]
    return sum(found[k]["count"] for k in kinds), sum(found[k]["payload_bytes"] for k in kinds)
