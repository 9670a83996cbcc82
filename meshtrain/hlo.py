"""Collective traffic of a compiled program, read from its HLO text.

Each collective's payload is its output size per device (`dtypes`: the same, by element type, e.g.
int8 gradients and their fp32 scales under compression); instructions inside a `while` body run
`known_trip_count` times (the layer scan, the pipeline ticks), so they are counted that often.
Branches of a conditional are counted as if taken, an upper bound. Link traffic per device uses
the ring algorithms' volumes for the group's size (meshtrain/formulas.py).
"""
from __future__ import annotations

import re
from collections import defaultdict

from meshtrain.formulas import ring_traffic

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_OP = re.compile(r"= (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLS = re.compile(r"(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"body=%?([\w.\-]+)")


def typed_array_bytes(shape: str) -> list[tuple[str, int]]:
    """(element type, bytes) of each array in an HLO shape (a tuple holds several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((dtype, n * DTYPE_BYTES[dtype]))
    return out


def group_size(line: str, default: int) -> int:
    """Devices per replica group: `replica_groups={{0,1,2,3},...}` or the iota form `[groups,size]<=[n]`."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed and listed.group(1):
        return len(listed.group(1).split(","))
    return default


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split("(")[0].split()
            name = head[-1].lstrip("%")
            if head[0] == "ENTRY":
                entry = name
            current = comps.setdefault(name, [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return comps, entry


def collectives(hlo_text: str, num_devices: int) -> dict[str, dict[str, float]]:
    """Per kind: executions per step, payload bytes and ring link traffic bytes, per device, and
    `dtypes`: payload bytes by element type."""
    comps, entry = _computations(hlo_text)
    times: dict[str, float] = defaultdict(float)

    def visit(name: str, factor: float, depth: int = 0) -> None:
        if name not in comps or depth > 50:
            return
        times[name] += factor
        for line in comps[name]:
            trip = _TRIP.search(line)
            body = _BODY.search(line)
            for callee in _CALLS.findall(line):
                visit(callee, factor * (int(trip.group(1)) if trip and body and callee == body.group(1) else 1), depth + 1)
            for group in _BRANCHES.findall(line):
                for callee in group.split(","):
                    visit(callee.strip().lstrip("%"), factor, depth + 1)

    visit(entry, 1.0)
    result = {k: {"count": 0.0, "payload_bytes": 0.0, "traffic_bytes": 0.0, "dtypes": defaultdict(float)}
              for k in KINDS}
    for name, factor in times.items():
        for line in comps[name]:
            op = _OP.search(line)
            if not op:
                continue
            shape, kind, started = op.groups()
            arrays = typed_array_bytes(shape)
            if started:  # (operands, outputs, ...): the largest array is the payload
                arrays = [max(arrays, key=lambda a: a[1])]
            payload = sum(nbytes for _, nbytes in arrays)
            r = result[kind]
            r["count"] += factor
            r["payload_bytes"] += factor * payload
            for dtype, nbytes in arrays:
                r["dtypes"][dtype] += factor * nbytes
            r["traffic_bytes"] += factor * ring_traffic(kind, payload, group_size(line, num_devices))
    for r in result.values():
        r["dtypes"] = dict(r["dtypes"])
    return result


def reduction_totals(found: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(executions, payload bytes) per step of the reductions and gathers: every kind but the
    pipeline's point-to-point collective-permutes."""
    kinds = [k for k in KINDS if k != "collective-permute"]
    return sum(found[k]["count"] for k in kinds), sum(found[k]["payload_bytes"] for k in kinds)
