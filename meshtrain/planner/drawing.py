"""Pipeline timelines drawn with matplotlib (`python -m meshtrain.plan --schedule ... --draw PNG`).

Rows are stages (stage 0 on top), columns are ticks as wide as their lockstep cost (a tick lasts as
long as its slowest stage's slot); each action is a box as wide as its own cost: forwards blue,
backwards green, zero-bubble weight gradients orange (darker for later virtual chunks), idle time
(the bubble) light grey; each box carries its microbatch number. The x axis is time, one forward = 1.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

IDLE = "#e4e4e4"
COLORS = {"F": ["#4285f4", "#1a56be", "#0c3482"],  # by chunk, then the last one
          "B": ["#34a853", "#187634", "#0a4e1e"],
          "W": ["#f4a000", "#c87800", "#965500"]}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
UNIT_INCHES, MAX_WIDTH_INCHES, ROW_INCHES, DPI = 0.26, 40.0, 0.34, 110


def shade(kind: str, chunk: int) -> int:
    """The palette index of a chunk's boxes: its own, or the last (darkest) one."""
    return min(chunk, len(COLORS[kind]) - 1)


def timeline_figure(tt) -> Figure:
    """A schedules.Timetable as a figure."""
    stages, time = tt.stages, tt.time
    unit = min(UNIT_INCHES, MAX_WIDTH_INCHES / time)
    left, right, bottom, top = 0.75, 0.25, 0.45, 0.55  # inches around the boxes: labels, legend, title
    width, height = time * unit + left + right, stages * ROW_INCHES + bottom + top
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((left / width, bottom / height, time * unit / width, stages * ROW_INCHES / height))
    font = 7 if unit >= 0.2 else 5
    edge = min(1.0, unit / UNIT_INCHES)  # the white lines between boxes, thinner when boxes are
    seen = set()  # (kind, shade) pairs drawn: the legend's entries
    x0 = 0
    for row, tick_cost in zip(tt.ticks, tt.tick_costs):
        for s, slot in enumerate(row):
            ax.add_patch(Rectangle((x0, s), tick_cost, 1, facecolor=IDLE, edgecolor="white", linewidth=edge))
            x = x0
            for action in slot:
                cost = tt.costs[action.kind]
                kind, chunk = action.kind, shade(action.kind, action.chunk)
                seen.add((kind, chunk))
                ax.add_patch(Rectangle((x, s), cost, 1, facecolor=COLORS[kind][chunk], edgecolor="white",
                                       linewidth=edge))
                if unit * cost >= 0.12:  # room for the number
                    ax.text(x + cost / 2, s + 0.5, str(action.micro), ha="center", va="center", color="white",
                            fontsize=font, fontweight="bold")
                x += cost
        x0 += tick_cost
    ax.set_xlim(0, time)
    ax.set_ylim(stages, 0)  # stage 0 on top
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)], fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("time (one forward = 1); numbers: microbatches", fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    chunks = tt.virtual > 1
    handles = [Patch(facecolor=COLORS[kind][chunk], label=NAMES[kind] + (f" (chunk {chunk})" if chunks else ""))
               for kind, chunk in sorted(seen, key=lambda key: ("FBW".index(key[0]), key[1]))]
    handles.append(Patch(facecolor=IDLE, label="idle"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(handles), frameon=False,
              fontsize=7, handlelength=1.2, columnspacing=1.0, borderaxespad=0.2)
    virtual = f" x {tt.virtual} virtual stages" if chunks else ""
    fig.text(left / width, 1 - 0.06 / height, f"{tt.schedule.name}: {stages} stages{virtual} x {tt.micro} "
             f"microbatches, {tt.bubble:.1%} idle in lockstep", fontsize=9, va="top")
    return fig


def save_timeline(tt, path: str | Path) -> None:
    """Write the timeline of a schedules.Timetable as a PNG."""
    timeline_figure(tt).savefig(path, dpi=DPI)


def figure_suffixes() -> tuple[str, ...]:
    """The file types matplotlib writes a figure as (a figure's type follows its file's suffix)."""
    from matplotlib.figure import Figure

    return tuple(f".{kind}" for kind in Figure().canvas.get_supported_filetypes())
