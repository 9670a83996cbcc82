"""`python -m meshtrain.plan`: look at a pipeline schedule before running it.

    python -m meshtrain.plan --schedule 1f1b --stages 4 --microbatches 8 --draw docs/1f1b.png

prints the timetable (stages x ticks), the bubble fraction next to the formula (S-1)/(V*M+S-1),
the microbatches in flight per stage and the activation buffers the executor allocates, and
optionally draws the timeline as a PNG.
"""
from __future__ import annotations

import argparse
import json
import sys

from meshtrain.config import UserError
from meshtrain.drawing import timeline_pixels, write_png
from meshtrain.schedules import SCHEDULES, executor_tables, timetable


def schedule_report(schedule: str, stages: int, micro: int, virtual: int) -> dict:
    tt = timetable(schedule, stages, micro, virtual)
    buffers = executor_tables(tt)
    return {"schedule": schedule, "stages": stages, "microbatches": micro, "virtual_stages": virtual,
            "ticks": len(tt.ticks), "bubble": tt.bubble, "bubble_formula": tt.bubble_formula,
            "in_flight": tt.in_flight(), "stash_slots": int(buffers["stash_slots"]),
            "timeline": [[str(a) if a else "." for a in row] for row in zip(*tt.ticks)], "_table": tt}


def format_schedule(r: dict) -> str:
    S, M, V = r["stages"], r["microbatches"], r["virtual_stages"]
    lines = [f"schedule {r['schedule']}: {S} stages x {M} microbatches, {V} virtual stage(s) per device",
             f"ticks: {r['ticks']} (one forward or backward of one chunk per tick)",
             f"bubble: {r['bubble']:.1%} of stage-ticks idle; formula (S-1)/(V*M+S-1) = {S - 1}/{V * M + S - 1} "
             f"= {r['bubble_formula']:.1%}",
             f"in flight per stage (microbatch chunks): {' '.join(map(str, r['in_flight']))}; "
             f"stashed inputs per stage: {r['stash_slots']}"]
    if r["ticks"] <= 80:
        width = max(len(c) for row in r["timeline"] for c in row) + 1
        lines += [f"stage {s}: " + "".join(c.rjust(width) for c in row) for s, row in enumerate(r["timeline"])]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meshtrain.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=SCHEDULES, required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--draw", metavar="PNG", help="write the timeline (stages x ticks) as a PNG image")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.stages < 1:
            raise UserError(f"--stages {args.stages} must be >= 1")
        report = schedule_report(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = report.pop("_table")
    print(json.dumps(report) if args.json else format_schedule(report))
    if args.draw:
        write_png(args.draw, timeline_pixels(table.ticks))
        if not args.json:
            print(f"timeline drawn to {args.draw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
