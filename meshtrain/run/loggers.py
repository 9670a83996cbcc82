"""What a run reports while it trains: its metric records, fanned out to sinks, and a profiler window.

A record is a dict with a `step`: a training step's metrics (loss, grad_norm, lr, tokens_per_sec,
..., the model's own such as router_aux_loss, fp16's loss_scale, a mixture's share_<source>), an
evaluation (`eval_loss`, a mixture's eval_loss_<source>), downstream tasks' accuracies (eval_acc_<task>,
eval_acc_norm_<task>) or an async checkpoint start (`checkpoint_blocking_s`; the local tier's
`local_checkpoint_blocking_s`). `MetricsLog` stamps
each with the wall time, keeps them in `history` and hands them to its sinks, each a `Logger`:
write(record), rewind(step) (a guard rollback is about to train the steps past `step` again: forget them), close().

Sinks: `Lines` (the console lines, the format the README's samples show), `ProgressBar` (rich: the
same lines above a live bar with ETA), `Jsonl` (<out>/metrics.jsonl), and the dashboards'
(meshtrain/run/dashboards.py): `TensorBoard` (event files under <out>/tensorboard, one scalar per
metric, tagged by `tag`), `WandB` (optional). Only process 0
writes; `for_run` builds the sinks of `logging:` (meshtrain/config/spec.py `LoggingConfig`).

The console sinks write the metric lines themselves, as `Jsonl` writes its file: they are the run's
metrics, chosen by `logging.progress` (lines, bar, none), not notices, so quieting the `meshtrain`
logger leaves them (set logging.progress=none for that). Everything else the run says (the `Ticker`,
the profile's notice) goes through the `meshtrain` logger (meshtrain/core/console.py); while the bar
is live, the console handler writes those lines above it too.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from meshtrain.core import jsonl
from meshtrain.core.console import duration, live_display, log
from meshtrain.core.errors import UserError
from meshtrain.core.folders import full_disk_is_user_error, replace_file
from meshtrain.core.metrics import LOW_PEAK_NAMES
from meshtrain.run.dashboards import TensorBoard, WandB, import_wandb


class Logger(Protocol):
    def write(self, record: dict) -> None: ...

    def rewind(self, step: int) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """The run's records (`history`), each also handed to every sink.

    `MetricsLog(out)`: console lines and <out>/metrics.jsonl; `primary=False` (another process, or
    a test that wants the history only): no sinks. `sinks=[...]` chooses them (see `for_run`)."""

    def __init__(self, out_dir: str | Path | None = None, primary: bool = True, keep_through: int | None = None,
                 *, sinks: list[Logger] | None = None):
        if sinks is None:
            sinks = [Lines(), Jsonl(out_dir, keep_through)] if primary else []
        self.sinks = list(sinks)
        self.history: list[dict] = []

    def write(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        self.history.append(record)
        for sink in self.sinks:
            sink.write(record)

    def rewind(self, step: int) -> None:
        self.history = [r for r in self.history if r.get("step", 0) <= step]
        for sink in self.sinks:
            sink.rewind(step)

    def close(self) -> None:
        """Close every sink, even after one fails (a full disk): the first failure is raised."""
        failure = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - raised below, after the other sinks are closed
                failure = failure or e
        if failure is not None:
            raise failure

    def locations(self) -> list[str]:
        """Where the sinks write (metrics.jsonl, the TensorBoard folder, ...)."""
        return [str(sink.path) for sink in self.sinks if getattr(sink, "path", None)]


# ---- console ----
def format_record(r: dict) -> str:
    """One console line: `step    300  loss 1.8700  grad_norm ...` (the README's samples parse these)."""
    if "eval_loss" in r:
        sources = ", ".join(f"{k.removeprefix('eval_loss_')} {v:.4f}"
                            for k, v in r.items() if k.startswith("eval_loss_"))
        dpo = (f"  reward accuracy {r['eval_reward_accuracy']:.1%} margin {r['eval_reward_margin']:.3f}"
               if "eval_reward_accuracy" in r else "")  # DPO's held-out pairs
        return f"step {r['step']:>6}  eval_loss {r['eval_loss']:.4f}" + (f" ({sources})" if sources else "") + dpo
    if "eval_reward" in r:  # GRPO's held-out prompts (meshtrain/engine/rollout.py)
        return (f"step {r['step']:>6}  eval_reward {r['eval_reward']:.4f}  response length "
                f"{r['eval_response_length']:.1f}")
    tasks = [k.removeprefix("eval_acc_") for k in r if k.startswith("eval_acc_") and not k.startswith("eval_acc_norm_")]
    if tasks:  # downstream tasks (eval.tasks)
        return f"step {r['step']:>6}  tasks: " + ", ".join(
            f"{t} acc {r['eval_acc_' + t]:.4f} acc_norm {r['eval_acc_norm_' + t]:.4f}" for t in tasks)
    if "checkpoint_blocking_s" in r:
        return f"step {r['step']:>6}  checkpoint started (blocked the loop {r['checkpoint_blocking_s'] * 1e3:.1f}ms)"
    if "local_checkpoint_blocking_s" in r:  # checkpoint.local_dir's tier
        return f"step {r['step']:>6}  local checkpoint started (blocked the loop " \
               f"{r['local_checkpoint_blocking_s'] * 1e3:.1f}ms)"
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}",
             f"lr {r['lr']:.2e}", f"tokens/s {r['tokens_per_sec']:,.0f}", f"step_time {r['step_time_s'] * 1e3:.1f}ms"]
    if "mtp_loss" in r:  # multi-token prediction (model.mtp_depth): the mean of its depths' losses
        parts.insert(2, f"mtp {r['mtp_loss']:.4f}")
    if "trained_tokens_per_sec" in r:  # a loss mask: the loss is over these tokens only
        parts.insert(4, f"trained tokens/s {r['trained_tokens_per_sec']:,.0f}")
    if "reward_accuracy" in r:  # DPO (meshtrain/objectives/dpo.py)
        parts.insert(2, f"reward acc {r['reward_accuracy']:.2f} margin {r['reward_margin']:.3f}")
    if "clip_fraction" in r:  # GRPO (meshtrain/objectives/grpo.py); its rollout's figures on its first update
        rollout = (f"reward {r['reward']:.3f} (std {r['reward_std']:.3f})  length {r['response_length']:.1f}  "
                   if "reward" in r else "")
        parts.insert(2, f"{rollout}kl {r['kl']:.4f}  clipped {r['clip_fraction']:.1%}  "
                        f"logp diff {r['logp_diff_max']:.1e}")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    if "loss_scale" in r:
        parts.append(f"loss_scale {r['loss_scale']:g} overflows {r['overflows']:.0f}")
    if "router_aux_loss" in r:
        parts.append(f"router aux {r['router_aux_loss']:.3f} z {r['router_z_loss']:.3f} dropped {r['dropped']:.1%} "
                     f"load max/mean {r['expert_load_max']:.2f}")
    if "batch_load_max" in r:  # the router bias update (model.router_bias_update_rate)
        parts.append(f"batch load max/mean {r['batch_load_max']:.2f}")
    if r.get("mfu") is not None:
        low = next((name for name in LOW_PEAK_NAMES.values() if r.get(f"mfu_{name}") is not None), None)
        fp8 = f"; {r[f'mfu_{low}']:.1%} of the {low} peak" if low else ""
        parts.append(f"MFU {r['mfu']:.1%} ({r['tflops_per_device']:.0f} TFLOP/s/device{fp8})")
    if "memory_bytes_in_use" in r:
        parts.append(f"memory {r['memory_bytes_in_use'] / 1e9:.2f} GB (peak {r['memory_peak_bytes_in_use'] / 1e9:.2f})")
    return "  ".join(parts)


class Pace:
    """How fast the run goes, for a person: the first training record covers the first steps'
    dispatch and warm-up; from the next one on, each record's step time times the steps left is
    the ETA, and the first such record also gets a `warm_line` of its own."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps, self.warm, self.told = first, steps, False, False

    def eta(self, record: dict) -> float | None:
        """Seconds left at this record's pace; None for the warm-up record, non-training ones and
        the last step."""
        if "loss" not in record:
            return None
        if not self.warm:
            self.warm, self.warm_from = True, record["step"]
            return None
        left = self.steps - record["step"]
        return left * record["step_time_s"] if left > 0 else None

    def warm_line(self, record: dict, eta: float | None) -> str | None:
        """`after warm-up: 12.3ms per step (steps 11-20); 980 steps left, ETA 12.1s`, once (not
        starting with `step `: the record lines do)."""
        if eta is None or self.told:
            return None
        self.told = True
        return (f"after warm-up: {record['step_time_s'] * 1e3:.1f}ms per step (steps {self.warm_from + 1}-"
                f"{record['step']}); {self.steps - record['step']} steps left, ETA {duration(eta)}")


class Lines:
    """A line per record on stdout (printed: the metric sink's own output); given the run's `first`
    and `steps`, training lines end with an ETA once warm (`Pace`)."""

    def __init__(self, first: int | None = None, steps: int | None = None):
        self.pace = Pace(first, steps) if steps is not None else None

    def write(self, record: dict) -> None:
        line = format_record(record)
        eta = self.pace.eta(record) if self.pace else None
        if eta is not None:
            warm = self.pace.warm_line(record, eta)
            if warm:
                print(warm, flush=True)
            line += f"  ETA {duration(eta)}"
        print(line, flush=True)

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressBar:
    """The lines, printed above a live rich bar: step of steps, elapsed time, ETA, the last loss.
    While it is live, whatever else the run says goes above the bar too: the console handler's lines
    through the bar's console (core/console.py `live_display`), other prints through rich's redirection
    of sys.stdout and sys.stderr."""

    def __init__(self, first: int, steps: int, console=None):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            TextColumn("{task.fields[last]}"), console=console)
        self.task = self.bar.add_task("train", total=steps, completed=first, last="")
        self.pace = Pace(first, steps)
        self.bar.start()
        self.end_live = live_display(self.print_line)

    def print_line(self, line: str) -> None:
        """A line above the bar, as it is (no rich markup or highlighting)."""
        self.bar.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def write(self, record: dict) -> None:
        warm = self.pace.warm_line(record, self.pace.eta(record))  # the bar shows the ETA itself
        for line in ([warm] if warm else []) + [format_record(record)]:
            self.print_line(line)
        if "loss" in record:
            self.bar.update(self.task, completed=record["step"], last=f"loss {record['loss']:.4f}")

    def rewind(self, step: int) -> None:
        self.bar.update(self.task, completed=step)

    def close(self) -> None:
        self.end_live()
        self.bar.stop()


def where(out: Path, tensorboard: bool) -> str:
    """The start-up line naming the run folder and, when written, the TensorBoard command."""
    line = f"run folder {out} (config.yaml, metrics.jsonl, checkpoints/)"
    return line + (f"; TensorBoard: tensorboard --logdir {out / 'tensorboard'}" if tensorboard else "")


class Ticker:
    """While something slow runs in the foreground (compiling the train step): a background thread
    says `compiling the train step (10 s so far)` every `every_s` seconds for the first minute,
    then every minute; on leaving, `compiled the train step in 42.1s` (`done`: the words, or a function
    that gives them then). `clock` and `print_line`
    are the thread's time source and output (default: info on the `meshtrain` logger: a notice, not a
    metric; a test passes its own); `enabled=False`: silent."""

    def __init__(self, doing: str, done: str, every_s: float = 10.0, enabled: bool = True,
                 clock=time.monotonic, print_line=None):
        self.doing, self.done, self.every_s, self.enabled, self.clock = doing, done, every_s, enabled, clock
        self.print_line = print_line or log.info
        self._stop = threading.Event()

    def __enter__(self):
        self.started = self.clock()
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="meshtrain-ticker", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        wait = self.every_s
        while not self._stop.wait(wait):
            elapsed = self.clock() - self.started  # one reading per line
            self.print_line(f"{self.doing} ({elapsed:.0f} s so far)")
            wait = self.every_s if elapsed < 60 else 60

    def __exit__(self, kind, *_) -> None:
        if not self.enabled:
            return
        self._stop.set()
        self._thread.join()
        if kind is None:
            done = self.done() if callable(self.done) else self.done
            self.print_line(f"{done} in {duration(self.clock() - self.started)}")


# ---- files ----
class Jsonl:
    """<out>/metrics.jsonl, one JSON object per record, appended as meshtrain/core/jsonl.py says (a crash
    or a full disk tears at most the last record; a torn one is dropped at the next open). A run that
    resumes from step k (or starts fresh: k = 0) first drops the file's records past k, written by
    the attempt it replaces, so the file holds each step once; a rewind drops them again. A full disk
    is one UserError: the run stops, its earlier checkpoints intact."""

    def __init__(self, out_dir: str | Path, keep_through: int | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        with self._full_disk():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if keep_through is not None and self.path.exists():
                self._drop_records_after(keep_through)
            self._file = jsonl.Appender(self.path)

    def _full_disk(self):
        return full_disk_is_user_error(self.path, "a metrics record", then="rerun the same command to resume")

    def _drop_records_after(self, step: int) -> None:
        kept = [r for r in jsonl.read(self.path) if r.get("step", 0) <= step]
        replace_file(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        with self._full_disk():
            self._file.append(record)

    def rewind(self, step: int) -> None:
        self._file.close()
        with self._full_disk():
            self._drop_records_after(step)
            self._file = jsonl.Appender(self.path)

    def close(self) -> None:
        self._file.close()


def for_run(out: Path, cfg, primary: bool, first: int, steps: int) -> MetricsLog:
    """The sinks `cfg.logging` asks for; none but on process 0. `first`: the step the run starts
    from (its files forget what earlier attempts logged past it)."""
    if not primary:
        return MetricsLog(sinks=[])
    lg = cfg.logging
    progress = lg.progress
    if progress == "auto":
        progress = "bar" if sys.stdout.isatty() else "lines"
    sinks: list[Logger] = [Jsonl(out, keep_through=first)]
    if lg.tensorboard:
        sinks.append(TensorBoard(out / "tensorboard", keep_through=first))
    if lg.wandb:
        from meshtrain.config.loader import to_dict

        sinks.append(WandB(out, lg.wandb_project, lg.wandb_mode, to_dict(cfg)))
    if progress == "lines":
        sinks.insert(0, Lines(first, steps))
    elif progress == "bar":
        sinks.insert(0, ProgressBar(first, steps))
    return MetricsLog(sinks=sinks)


def check(logging_cfg, steps: int) -> tuple[int, int] | None:
    """Before anything is built: wandb importable when asked for; the profile window parsed."""
    if logging_cfg.wandb:
        import_wandb()
    return parse_profile(logging_cfg.profile, steps)


# ---- device memory ----
def device_memory(devices) -> dict:
    """memory_bytes_in_use and memory_peak_bytes_in_use: the largest over `devices`, where the
    backend reports both (GPU, TPU; CPU reports nothing: then {})."""
    keys = ("bytes_in_use", "peak_bytes_in_use")
    stats = [s for d in devices if (s := d.memory_stats()) and all(key in s for key in keys)]
    return {f"memory_{key}": max(s[key] for s in stats) for key in keys} if stats else {}


# ---- profiler ----
def parse_profile(text: str, steps: int) -> tuple[int, int] | None:
    """'START:STOP' (or 'STEP') -> (START, STOP): steps as the log numbers them (the first is 1),
    both included; '' -> None."""
    if not text:
        return None
    parts = text.split(":")
    fix = (f"pass START:STOP with 1 <= START <= STOP <= {steps} (the steps as logged, both traced), "
           f"e.g. --profile 10:12")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise UserError(f"--profile {text} (logging.profile): {fix}")
    start, stop = int(parts[0]), int(parts[-1])
    if not 1 <= start <= stop <= steps:
        raise UserError(f"--profile {text} (logging.profile) is outside steps 1-{steps}: {fix}")
    return start, stop


class ProfileWindow:
    """A jax.profiler trace of steps START..STOP into `directory` (plugins/profile/<time>/ holds the
    .xplane.pb of TensorBoard's profile plugin and a perfetto_trace.json.gz for ui.perfetto.dev).
    Process 0 traces. The device work of the traced steps finishes (`state()` is waited for) before
    the trace stops: after STOP, or on leaving the `with` block, whichever comes first."""

    def __init__(self, window: tuple[int, int] | None, directory: Path, primary: bool, state):
        self.window = window if primary else None  # None once traced
        self.directory, self.state = directory, state
        self.active = False

    def before(self, step: int) -> float:
        """Step `step` (as logged) is about to be dispatched. Returns the seconds spent starting a
        trace (not the step's time)."""
        if self.active or not self.window or not self.window[0] <= step <= self.window[1]:
            return 0.0
        import jax

        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active = True
        return time.perf_counter() - started

    def after(self, step: int) -> float:
        """Step `step` was dispatched. Returns the seconds spent writing the trace."""
        return self.stop() if self.active and step >= self.window[1] else 0.0

    def stop(self, wait: bool = True) -> float:
        if not self.active:
            return 0.0
        import jax

        if wait:
            jax.block_until_ready(self.state())
        started = time.perf_counter()
        jax.profiler.stop_trace()
        log.info(f"profile of steps {self.window[0]}-{self.window[1]} written to {self.directory}")
        self.active, self.window = False, None
        return time.perf_counter() - started

    def __enter__(self):
        return self

    def __exit__(self, kind, *_) -> None:
        self.stop(wait=kind is None)  # after an error the state may be gone (donated to a failed step)


# ---- the end of a run ----
def mean_tokens_per_sec(history: list[dict], first: int) -> float | None:
    """Tokens trained / seconds in steps over the records of steps past `first` (each covers the
    steps since the previous one; evaluations and checkpoint saves are not step time)."""
    tokens = seconds = 0.0
    previous = first
    for r in history:
        if "loss" in r and r["step"] > previous:
            n = r["step"] - previous
            tokens += n * r["tokens_per_sec"] * r["step_time_s"]
            seconds += n * r["step_time_s"]
            previous = r["step"]
    return tokens / seconds if seconds else None


def summary_line(history: list[dict], first: int, last: int, steps: int, wall_s: float,
                 checkpoint: str | None, logs: list[str]) -> str:
    """`done: steps 1-60 in 42.1s; loss 1.8700, eval_loss 1.9000; 12,345 tokens/s mean; ...`"""
    head = "done" if last >= steps else f"stopped at step {last} of {steps}"
    parts = [f"{head}: steps {first + 1}-{last} in {duration(wall_s)}"]
    train = [r for r in history if "loss" in r]
    evals = [r for r in history if "eval_loss" in r]
    figures = ([f"loss {train[-1]['loss']:.4f}"] if train else []) + (
        [f"eval_loss {evals[-1]['eval_loss']:.4f}"] if evals else [])
    if figures:
        parts.append(", ".join(figures))
    rate = mean_tokens_per_sec(history, first)
    if rate is not None:
        parts.append(f"{rate:,.0f} tokens/s mean")
    parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint")
    if logs:
        parts.append("logs " + ", ".join(logs))
    return "; ".join(parts)
