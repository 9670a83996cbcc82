"""The training loop's periodic actions and its clock (Trainer._loop is the step driver that runs them).

After each step the driver asks every action `due(step, clock)` and, if so, calls its `run`:
- `Report`: the metric record every train.log_every steps and at the last (tokens/s, MFU, memory), with
  `StragglerCheck` (train.straggler_every) and `GradNorms` (train.grad_norms_every) adding their fields;
- `Evaluation` (train.eval_every) and `TaskScoring` (eval.task_every);
- `Saving`: checkpoint.every / every_minutes, a preemption signal, and the last step; `LocalSaving`:
  the local tier (checkpoint.local_every / local_every_minutes) at the steps between.
`Guard` judges each finished step (the NaN/Inf streak and the loss spike, with rollback) before the next is
dispatched and before any save. `StepClock` owns the timers: the wall time since the last record, the
host's waits for data and for the devices, and the time that is no step's (tracing, evaluation, saves);
it hands each to the start's goodput account (meshtrain/run/goodput.py).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import jax

from meshtrain.core.console import log as console
from meshtrain.core.errors import UserError
from meshtrain.run.goodput import Goodput
from meshtrain.run.health import CollectiveTimer, SpikeDetector, Stragglers, grad_norm_fields
from meshtrain.run.multihost import agree_with_process_0, preemption_reached


class StepClock:
    """Per-step figures since the last record: `reset(step)` starts an interval, `close(step)` ends it,
    `exclude(s, category)` takes time that is no step's out of it, `wait` times the host's wait for the
    devices. The intervals' and the excluded time go to `goodput`, the start's account (default: one
    kept here only), whose start-up ends when the loop builds its clock."""

    def __init__(self, first: int, last: int, prefetch, watchdog, goodput: Goodput | None = None):
        self.last, self.prefetch, self.watchdog = last, prefetch, watchdog
        self.goodput = goodput or Goodput(time.perf_counter(), 0.0, first)
        self.goodput.loop_started()
        self.device_wait = 0.0  # seconds the host waited for steps, in all
        self.reset(first)

    def reset(self, step: int) -> None:
        self.since, self.step = time.perf_counter(), step
        self.data_mark, self.device_mark = self.prefetch.waited, self.device_wait

    def exclude(self, seconds: float, category: str | None = None) -> None:
        """`seconds` just spent were no step's; the goodput account books them under `category`
        (meshtrain/run/goodput.py; None: other)."""
        self.since += seconds
        if category:
            self.goodput.spend(category, seconds)

    def is_last(self, step: int) -> bool:
        return step == self.last

    def wait(self, step: int, metrics) -> tuple[int, dict]:
        """(step, metrics) once the step is done on the devices: the wait is timed (the straggler
        figures' device wait) and the watchdog sees the step complete."""
        self.watchdog.doing(f"waiting for step {step}")
        started = time.perf_counter()
        metrics = jax.block_until_ready(metrics)
        self.device_wait += time.perf_counter() - started
        self.watchdog.beat(step)
        return step, metrics

    def per_step(self, step: int) -> tuple[float, float, float]:
        """(wall seconds, seconds waiting for data, host seconds outside the device wait) per step of the
        interval ending at `step`."""
        n = step - self.step
        wall = (time.perf_counter() - self.since) / n
        return wall, (self.prefetch.waited - self.data_mark) / n, max(0.0, wall - (self.device_wait -
                                                                                  self.device_mark) / n)

    def close(self, step: int) -> tuple[float, float, float]:
        """`per_step(step)`, the interval's steps booked in the goodput account."""
        wall, data, host = self.per_step(step)
        n = step - self.step
        self.goodput.steps(self.step, step, wall * n, data * n)
        return wall, data, host

    def rolled_back(self, reached: int, back: int, seconds: float) -> None:
        """The guard rolled back from step `reached` to `back` in `seconds`: the interval's steps were
        trained, the rollback and the steps back + 1 .. `reached`, to be trained again, are replayed."""
        self.exclude(seconds, "replayed")
        if reached > self.step:
            self.close(reached)
        else:  # recorded already: what followed (dispatching the dropped step) is lost
            self.goodput.spend("replayed", time.perf_counter() - self.since)
        self.goodput.rolled_back(reached)
        self.reset(back)


class StragglerCheck:
    """train.straggler_every: every process's host time per step, gathered on process 0 (run/health.py)."""

    def __init__(self, trainer):
        t = trainer.cfg.train
        self.stragglers = Stragglers(t.straggler_every, t.straggler_factor, jax.process_index(), jax.process_count())
        self.watchdog = trainer.watchdog

    def due(self, step: int, clock: StepClock) -> bool:
        return self.stragglers.due(step)

    def run(self, step: int, metrics, wall: float, host: float, data: float) -> dict:
        self.watchdog.doing(f"waiting for the other processes' step times at step {step}")
        return self.stragglers.gather(step, wall, host, data)


class GradNorms:
    """train.grad_norms_every: each layer's and kind's gradient norm, and the timed communication share
    of the step (run/health.py)."""

    def __init__(self, trainer):
        self.every, self.program, self.timer = trainer.cfg.train.grad_norms_every, trainer.program, None

    def due(self, step: int, clock: StepClock) -> bool:
        return bool(self.every) and step % self.every == 0

    def run(self, step: int, metrics, wall: float, host: float, data: float) -> dict:
        if self.timer is None:  # built at the first use: it compiles an all-reduce
            self.timer = CollectiveTimer(self.program.mesh, self.program.num_params)
        return grad_norm_fields(metrics["grad_norms"], self.program.layer_order) | self.timer.share(wall)


def check_trained(step: int, metrics, train) -> None:
    """A step whose batch trains no token (its loss and gradients 0: nothing learned, yet Adam's moments
    move the weights) stops the run: the data's loss mask leaves whole batches untrained."""
    if "trained_tokens" in metrics and int(metrics["trained_tokens"]) == 0:
        raise UserError(f"step {step}'s batch holds no trained token: the loss mask (data.train_on=assistant) "
                        f"marks none of its {train.batch_size} x {train.seq_len} tokens; train on data with more "
                        f"assistant text per window, a longer train.seq_len, or data.train_on=all")


class Report:
    """The metric record, every train.log_every steps and at the last step; `extras` add their fields."""

    judged = False  # needs no verdict of the guard on its step (see `Checkpointing`)

    def __init__(self, trainer, log):
        self.trainer, self.log, self.every = trainer, log, trainer.cfg.train.log_every
        self.extras = [StragglerCheck(trainer), GradNorms(trainer)]

    def due(self, step: int, clock: StepClock) -> bool:
        return step % self.every == 0 or clock.is_last(step)

    def run(self, step: int, metrics, clock: StepClock) -> None:
        metrics = jax.device_get(clock.wait(step, metrics)[1])
        check_trained(step, metrics, self.trainer.cfg.train)  # before its record: no "loss 0.0000" logged
        wall, data, host = clock.close(step)
        record = self.trainer.record(step, metrics, self.trainer.program.tokens_per_step / wall, wall, data)
        self.trainer.watchdog.observe(wall)
        for extra in self.extras:
            if extra.due(step, clock):
                record |= extra.run(step, metrics, wall, host, data)
        self.log.write(record)
        clock.reset(step)


class Evaluation:
    """train.eval_every: the validation loss (and a mixture's per-source losses)."""

    what = "evaluating"
    judged = False

    def __init__(self, trainer, log):
        self.trainer, self.log, self.first = trainer, log, True
        self.every = trainer.cfg.train.eval_every

    def due(self, step: int, clock: StepClock) -> bool:
        return bool(self.every) and (step % self.every == 0 or clock.is_last(step))

    def metrics(self) -> dict:
        return self.trainer.evaluation()

    def run(self, step: int, metrics, clock: StepClock) -> None:
        dog, started = self.trainer.watchdog, time.perf_counter()
        dog.doing(f"{self.what} after step {step}")
        dog.one_time, self.first = self.first, False  # the first compiles the program
        record = self.metrics()
        if record:
            self.log.write({"step": step, **record})
        dog.beat(step)
        clock.exclude(time.perf_counter() - started, "evaluation")


class TaskScoring(Evaluation):
    """eval.tasks, every eval.task_every steps (default train.eval_every) and at the last."""

    what = "scoring the downstream tasks"

    def __init__(self, trainer, log):
        super().__init__(trainer, log)
        self.every = trainer.cfg.eval.task_every or trainer.cfg.train.eval_every

    def due(self, step: int, clock: StepClock) -> bool:
        return bool(self.trainer.tasks) and (step % self.every == 0 or clock.is_last(step))

    def metrics(self) -> dict:
        return self.trainer.task_evaluation()


class Saving:
    """Checkpoints (checkpoint.every steps, checkpoint.every_minutes, the last step) and preemption (a
    signal, or JAX's preemption sync point with several processes). `due` decides once per step: it
    reads the signal and, with every_minutes on several processes, agrees with process 0."""

    def __init__(self, trainer, log, signalled: threading.Event):
        self.trainer, self.log, self.signalled = trainer, log, signalled
        self.owed = self.preempted = False  # owed: a save waits for a NaN/Inf streak to end
        self.first = True
        self.last_save = time.monotonic()

    def due(self, step: int, clock: StepClock) -> bool:
        processes = jax.process_count()
        self.preempted = self.signalled.is_set() if processes == 1 else preemption_reached(step)
        self.owed = self.owed or self._periodic(step, processes)
        return self.owed or self.preempted or clock.is_last(step)

    def _periodic(self, step: int, processes: int) -> bool:
        """With several processes, process 0's clock decides, at log steps only (one tiny broadcast)."""
        c = self.trainer.cfg.checkpoint
        if c.every and step % c.every == 0:
            return True
        return minutes_passed(self.last_save, c.every_minutes, step, self.trainer.cfg.train.log_every)

    def run(self, step: int, metrics, clock: StepClock) -> bool:
        """Save the judged step (not inside a NaN/Inf streak); True when the run stops here, preempted."""
        trainer, dog = self.trainer, self.trainer.watchdog
        final, path, started = self.preempted or clock.is_last(step), None, time.perf_counter()
        if trainer.guard.bad_batches:  # a periodic save waits for the streak to end
            self.owed = True
            if final:
                trainer.checkpointer.wait()  # earlier async saves are durable before the run ends
                console.warning(f"step {step} is inside a NaN/Inf streak: not saved; the newest checkpoint is step "
                                f"{max(trainer.checkpointer.steps(), default=0)}")
        else:
            dog.doing(f"saving step {step}")
            dog.one_time, self.first = self.first, False  # the first sets up the checkpointer
            path = trainer.save_checkpoint(wait=final)
            self.last_save = time.monotonic()
            dog.beat(step)
            if not final:  # async: the loop waited only for the device-to-host copy and checksums
                self.log.write({"step": step, "checkpoint_blocking_s": time.perf_counter() - started})
            self.owed = False
        clock.exclude(time.perf_counter() - started, "checkpoint")
        if self.preempted:
            trainer.preempted = True
            console.info(f"preempted at step {step}: " + (f"checkpoint saved to {path}" if path else
                                                          "not saved (inside a NaN/Inf streak)"))
        return self.preempted


class Checkpointing:
    """Both checkpoint tiers as one periodic action: the persistent save when it is due (it stands for
    a local one), else the local tier's. `judged`: the loop has the guard judge the step first, so a
    checkpoint never lands inside a NaN/Inf streak. `run` is True when the run stops here (preempted)."""

    judged = True

    def __init__(self, trainer, log, signalled: threading.Event):
        self.persistent, self.local = Saving(trainer, log, signalled), LocalSaving(trainer, log)
        self.saves = False

    def due(self, step: int, clock: StepClock) -> bool:
        self.saves = self.persistent.due(step, clock)
        return self.local.due(step, clock, self.saves) or self.saves

    def run(self, step: int, metrics, clock: StepClock) -> bool:
        if self.saves:
            return self.persistent.run(step, metrics, clock)
        self.local.run(step, clock)
        return False


def minutes_passed(since: float, minutes: float, step: int, log_every: int) -> bool:
    """`minutes` (0: never) passed since the monotonic time `since`; with several processes, process 0's
    clock decides, at log steps only (one tiny broadcast)."""
    if not minutes or (jax.process_count() > 1 and step % log_every):
        return False
    return agree_with_process_0(time.monotonic() - since >= 60 * minutes)


class LocalSaving:
    """The local tier (checkpoint.local_every / local_every_minutes, run/local_tier.py) at the steps the
    persistent tier does not save; never inside a NaN/Inf streak (owed until it ends)."""

    def __init__(self, trainer, log):
        self.trainer, self.log = trainer, log
        self.owed, self.last_save, self.first = False, time.monotonic(), True

    def due(self, step: int, clock: StepClock, persistent: bool) -> bool:
        """`persistent`: the persistent tier saves this step, which stands for a local save too."""
        c = self.trainer.cfg.checkpoint
        if not c.local_dir:
            return False
        by_time = minutes_passed(self.last_save, c.local_every_minutes, step, self.trainer.cfg.train.log_every)
        self.owed = self.owed or by_time or bool(c.local_every and step % c.local_every == 0)
        if persistent:
            self.owed, self.last_save = False, time.monotonic()
        return self.owed

    def run(self, step: int, clock: StepClock) -> None:
        trainer, dog = self.trainer, self.trainer.watchdog
        if trainer.guard.bad_batches:
            return  # still owed
        started = time.perf_counter()
        dog.doing(f"saving step {step} to the local tier")
        dog.one_time, self.first = self.first, False  # the first may compile the checksums
        trainer.save_local()  # returns once the shards are on the host; written in the background
        self.owed, self.last_save = False, time.monotonic()
        dog.beat(step)
        self.log.write({"step": step, "local_checkpoint_blocking_s": time.perf_counter() - started})
        clock.exclude(time.perf_counter() - started, "checkpoint")


@contextlib.contextmanager
def preemption_signals():
    """An Event set by SIGTERM/SIGINT while the block runs (the loop then finishes the step, saves and
    exits 0). With several processes JAX's runtime notes SIGTERM for its preemption sync point, and
    Ctrl-C becomes one. Off the main thread no handler can be set: the Event stays clear."""
    signalled, handlers = threading.Event(), {}
    if threading.current_thread() is threading.main_thread():
        if jax.process_count() == 1:
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, lambda *_: signalled.set())
        else:
            handlers[signal.SIGINT] = signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        yield signalled
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class Guard:
    """guard.*: a nonfinite step's update was already skipped inside the step; after
    guard.max_consecutive_bad in a row, or at once after a loss spike (guard.spike_factor, whose update
    was applied), the run rolls back to its newest intact checkpoint and skips the bad batches from then
    on. Every process judges the same replicated loss, so all of them roll back together."""

    def __init__(self, trainer):
        self.trainer, g = trainer, trainer.cfg.guard
        self.spikes = SpikeDetector(g.spike_factor, g.spike_window) if g.spike_factor else None
        self.bad_batches: list[int] = []  # the current run of nonfinite steps' batch indices
        self.rollbacks = 0
        self.loss_spikes = 0  # rolled back, this process's run

    def judge(self, pending: tuple[int, dict] | None, clock: StepClock, log) -> int | None:
        """Judge a dispatched step, `pending` (step, metrics), once it is done: the step rolled back to,
        or None."""
        if pending is None:
            return None
        step, metrics = clock.wait(*pending)
        started = time.perf_counter()
        back = self._verdict(step, metrics, log)
        if back is not None:
            clock.rolled_back(step, back, time.perf_counter() - started)
        return back

    def _verdict(self, step: int, metrics, log) -> int | None:
        check_trained(step, metrics, self.trainer.cfg.train)
        if bool(metrics["finite"]):
            self.bad_batches = []
            return self._spike(step, float(metrics["loss"]), log) if self.spikes is not None else None
        self.bad_batches.append(self.trainer.batch_index(step - 1))
        bad = len(self.bad_batches)
        console.warning(f"step {step}: loss or gradients are NaN/Inf; update skipped ({bad} in a row)")
        return self._roll_back(step, log) if bad >= self.trainer.cfg.guard.max_consecutive_bad else None

    def _spike(self, step: int, loss: float, log) -> int | None:
        mean = self.spikes.check(loss)
        if mean is None:
            return None
        self.bad_batches, self.loss_spikes = [self.trainer.batch_index(step - 1)], self.loss_spikes + 1
        console.warning(f"step {step}: loss spike: {loss:.4f} is {loss / mean:.2f}x the running mean {mean:.4f} "
                        f"(guard.spike_factor={self.trainer.cfg.guard.spike_factor}); loss spikes so far: "
                        f"{self.loss_spikes}")
        return self._roll_back(step, log, f"a loss spike at step {step}")

    def _roll_back(self, step: int, log, spike: str | None = None) -> int:
        """After a NaN/Inf streak ending at `step` (or `spike`, a loss spike's description): the state of
        the newest intact checkpoint, read as a resume reads it, the bad batches past it skipped from now
        on, and `log` rewound to it; returns that step, where the loop trains on. With no checkpoint, or
        after guard.max_rollbacks, the run stops with an error; after a NaN/Inf streak it first saves the
        state (no bad step changed it), after a spike it does not (the spike's update was applied)."""
        trainer = self.trainer
        trainer.watchdog.doing(f"rolling back from step {step}")
        trainer.checkpointer.wait()
        steps, bad = trainer.checkpointer.steps(), len(self.bad_batches)
        what = spike or f"{bad} NaN/Inf steps in a row"
        diverging = self.rollbacks >= trainer.cfg.guard.max_rollbacks
        # the newest of either tier (a local step alone too: every process agrees in restore)
        state = None if diverging else trainer.restore(trainer.checkpointer.directory, steps,
                                                       verb=f"guard: {what}; rolled back to")
        if state is None:
            why = f"still diverging after {self.rollbacks} rollbacks" if diverging else "no checkpoint to roll back to"
            if spike:
                raise UserError(f"{what}, {why}; the newest checkpoint is step {max(steps, default=0)}; lower "
                                f"optim.lr, check the data or raise guard.spike_factor, then rerun to resume")
            path = trainer.save_checkpoint(wait=True)  # the parameters are intact: bad steps changed nothing
            raise UserError(f"{what} at step {step}, {why}; state saved to {path}; "
                            f"lower optim.lr or check the data, then rerun to resume")
        trainer.state = state
        back = int(trainer.state["step"])
        resume_index = trainer.batch_index(back)
        skipped = [b for b in self.bad_batches if b >= resume_index]  # earlier ones precede the checkpoint
        trainer.skip(skipped)
        console.info(f"guard: skipping batches {skipped}")
        self.bad_batches, self.rollbacks = [], self.rollbacks + 1
        log.rewind(back)
        trainer.watchdog.beat(back)
        return back
