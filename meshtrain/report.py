"""`python -m meshtrain.report RUN [RUN ...] [--out PNG]`: compare training runs.

Reads each run's metrics.jsonl (RUN is a run folder, the --out of a training run, or the file
itself; a torn last record is dropped with a warning, see meshtrain/core/jsonl.py), draws train
loss, eval loss and tokens/s against the step (a GRPO run's: its rollouts' reward and the held-out
prompts' eval_reward in place of the losses), one color per run, into one PNG
(default report.png in the current folder), and prints a table: steps, final loss, best eval loss
(a GRPO run's: final reward, best eval_reward) and the step it was reached at, median tokens/s (the
median: the first steps' warm-up does not count). For a run folder whose run.json holds goodput
accounts (meshtrain/run/goodput.py), it then prints where the run's wall time went, summed over its
starts: goodput (productive / wall) and each category's seconds and share, the largest first
(docs/operating.md, "Goodput"). A record that lacks a field (an earlier version's, an edited file)
costs only what it cannot show: each run's notes say what is missing, and the rest is drawn and
tabled.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.core import jsonl
from meshtrain.core.cli import Parser, arguments, command
from meshtrain.core.console import duration
from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_file
from meshtrain.planner.drawing import figure_suffixes
from meshtrain.run import goodput


@dataclass
class Run:
    name: str
    train: list[dict]  # records with a loss, by step
    evals: list[dict]  # records with an eval_loss (a GRPO run's: eval_reward), by step
    goodput: dict | None = None  # its starts' goodput accounts summed (goodput.total), None without
    notes: tuple[str, ...] = ()  # what its records lack, and what is not shown for it
    record_problems: tuple[str, ...] = ()  # what its run.json lacks or cannot be read of

    @property
    def rates(self) -> list[dict]:
        """The training records that hold a tokens/s figure."""
        return [r for r in self.train if _number(r, "tokens_per_sec")]

    @property
    def rewarded(self) -> bool:
        """A reinforcement-learning run (train.objective=grpo): its figures are rewards, higher better."""
        return any(_number(r, "reward") or _number(r, "clip_fraction") for r in self.train)

    @property
    def metric(self) -> str:
        return "reward" if self.rewarded else "loss"

    @property
    def drawn(self) -> list[dict]:
        """The training records drawn: a GRPO run's that sampled a rollout (its first updates)."""
        return [r for r in self.train if _number(r, self.metric)]

    def series(self, records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
        return np.array([r["step"] for r in records]), np.array([r[key] for r in records], float)


def load_run(path: str) -> Run:
    file = Path(path)
    if file.is_dir():
        file = file / "metrics.jsonl"
    if not file.is_file():
        raise UserError(f"{path}: no metrics.jsonl there; pass a run folder (the --out of a training run) "
                        f"or its metrics.jsonl")
    records = jsonl.read(file)  # a torn last record is dropped with a warning
    placed = [r for r in records if isinstance(r, dict) and _number(r, "step")]
    train = sorted((r for r in placed if _number(r, "loss")), key=lambda r: r["step"])
    if not train:
        raise UserError(f"{file} holds no training records yet (none with a numeric step and loss); pass a run "
                        f"that has logged a step")
    held_out = "eval_reward" if Run("", train, []).rewarded else "eval_loss"
    evals = sorted((r for r in placed if _number(r, held_out)), key=lambda r: r["step"])
    notes = []
    if len(placed) < len(records):
        notes.append(f"{len(records) - len(placed):,} of {len(records):,} records have no numeric step: left out")
    accounts, problems = run_goodput(file.parent)
    run = Run(path.rstrip("/"), train, evals, accounts, record_problems=tuple(problems))
    if len(run.rates) < len(train):
        shown = "not drawn" if not run.rates else f"drawn from the other {len(run.rates):,}"
        notes.append(f"{len(train) - len(run.rates):,} of {len(train):,} training records have no tokens_per_sec: "
                     f"tokens/s {shown}")
    run.notes = tuple(notes)
    return run


def _number(record: dict, key: str) -> bool:
    """Whether the record holds a real number under `key` (JSON's true/false are not one)."""
    value = record.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_goodput(folder: Path) -> tuple[dict | None, list[str]]:
    """The goodput of the run in `folder`, summed over the starts that recorded an account (None: none
    did), and what its run.json lacks or cannot be read of."""
    from meshtrain.run.run_dir import readable_record  # JAX: only when a report is made

    record, problems = readable_record(folder)
    accounts = [s["goodput"] for s in record.get("starts", []) if "goodput" in s]
    return (goodput.total(accounts) if accounts else None), problems


def goodput_table(run: Run) -> str:
    """`<run>: goodput 62% of 1m33s over 3 starts (2 restarts), 7 steps replayed`, then a line per
    category: seconds and share of the wall time, productive first, then the losses, largest first."""
    g = run.goodput
    if g is None and run.record_problems:
        return f"{run.name}: no goodput shown ({'; '.join(run.record_problems)})"
    if g is None:
        return f"{run.name}: no goodput recorded (no run.json account beside its metrics.jsonl: a run of an " \
               f"earlier version, or a copied file)"
    if g["goodput"] is None:
        return f"{run.name}: {goodput.line(g)}"
    head = (f"{run.name}: goodput {g['goodput']:.1%} of {duration(g['wall_s'])} over {g['starts']} start"
            f"{'s' * (g['starts'] > 1)} ({g['restarts']} restart{'s' * (g['restarts'] != 1)}), "
            f"{g['replayed_steps']} step{'s' * (g['replayed_steps'] != 1)} replayed")
    rows = [("productive", g["goodput"])] + goodput.losses(g)
    return "\n".join([head] + [f"  {goodput.LABELS[c]:<17} {g['seconds'][c]:>9.1f}s  {share:>6.1%}"
                                for c, share in rows])


def figure(runs: list[Run]):
    from matplotlib.figure import Figure
    from matplotlib.ticker import StrMethodFormatter

    fig = Figure(figsize=(13, 4), layout="constrained")
    panels = fig.subplots(1, 3)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        panels[0].plot(*run.series(run.drawn, run.metric), color=color, label=run.name, linewidth=1.2)
        if run.evals:
            panels[1].plot(*run.series(run.evals, f"eval_{run.metric}"), color=color, marker="o", markersize=3,
                           label=run.name, linewidth=1.2)
        panels[2].plot(*run.series(run.rates, "tokens_per_sec"), color=color, label=run.name, linewidth=1.2)
    metrics = " / ".join(dict.fromkeys(run.metric for run in runs))  # a GRPO run's: its rollouts' mean reward
    titles = (f"train {metrics}", f"eval {metrics}", "tokens/s")
    for ax, title in zip(panels, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if not any(run.evals for run in runs):
        panels[1].text(0.5, 0.5, "no eval records\n(train.eval_every)", ha="center", va="center",
                       transform=panels[1].transAxes, color="grey")
    panels[2].set_ylim(bottom=0)
    panels[2].yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    panels[0].legend(fontsize=8)
    return fig


def table(runs: list[Run]) -> str:
    width = max(len("run"), *(len(run.name) for run in runs))
    final = "final " + " / ".join(dict.fromkeys(run.metric for run in runs))
    lines = [f"{'run':<{width}}  {'steps':>6}  {final:>10}  {'best eval (step)':>18}  {'tokens/s':>10}"]
    for run in runs:
        key = f"eval_{run.metric}"
        if run.evals:  # the lowest loss; the highest reward
            best = (max if run.rewarded else min)(run.evals, key=lambda r: r[key])
            best_text = f"{best[key]:.4f} ({best['step']})"
        else:
            best_text = "-"
        rate = f"{np.median([r['tokens_per_sec'] for r in run.rates]):,.0f}" if run.rates else "-"
        last = f"{run.drawn[-1][run.metric]:.4f}" if run.drawn else "-"
        lines.append(f"{run.name:<{width}}  {run.train[-1]['step']:>6}  {last:>{len(final)}}  {best_text:>18}  "
                     f"{rate:>10}")
    return "\n".join(lines)


DEFAULT_OUT = "report.png"  # in the current folder: comparing runs never writes into one of them


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.report", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run folder (--out of a training run) or its metrics.jsonl")
    p.add_argument("--out", metavar="PNG",
                   help=f"where to write the plot (its suffix picks the format); a file named here is never "
                        f"replaced without --force (default {DEFAULT_OUT}, replaced by the next report)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    return p


@command
def main(argv=None) -> int:
    args = arguments(parser(), argv)
    out = Path(args.out or DEFAULT_OUT)  # the command's own default is its to replace; a named file is the user's
    with writing_file(out, "--out", args.force or args.out is None, figure_suffixes()) as tmp:
        runs = [load_run(path) for path in args.runs]
        figure(runs).savefig(tmp, dpi=100)
    print(table(runs))
    for run in runs:
        print(goodput_table(run))
        for note in run.notes:
            print(f"{run.name}: {note}")
    print(f"plot written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
