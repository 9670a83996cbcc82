"""The training loop's periodic actions (meshtrain/run/actions.py), each on its own with a stand-in
trainer: when it is due, what it writes, what it does to the clock, the watchdog and the run. The full
loop that drives them is tested by the runs of test_guard, test_operating, test_checkpoint."""
import logging
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from meshtrain.core.errors import UserError
from meshtrain.run import actions
from meshtrain.run.actions import (
    Evaluation,
    GradNorms,
    Guard,
    LocalSaving,
    Report,
    Saving,
    StepClock,
    StragglerCheck,
    TaskScoring,
    preemption_signals,
)

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)


class Dog:
    """A watchdog that records what it is told."""

    def __init__(self):
        self.events, self.one_time = [], None

    def doing(self, what):
        self.events.append(("doing", what))

    def beat(self, step):
        self.events.append(("beat", step))

    def observe(self, seconds):
        self.events.append(("observe", round(seconds, 3)))


class Log:
    def __init__(self):
        self.records, self.rewound = [], []

    def write(self, record):
        self.records.append(record)

    def rewind(self, step):
        self.rewound.append(step)


def trainer(**sections):
    cfg = {"train": dict(log_every=2, eval_every=4, batch_size=2, seq_len=8, grad_norms_every=0, straggler_every=0,
                         straggler_factor=2.0),
           "eval": dict(task_every=0), "guard": dict(spike_factor=0.0, spike_window=2, max_consecutive_bad=2,
                                                      max_rollbacks=1),
           "checkpoint": dict(every=0, every_minutes=0.0)}
    for name, values in sections.items():
        cfg[name] |= values
    return SimpleNamespace(cfg=SimpleNamespace(**{k: SimpleNamespace(**v) for k, v in cfg.items()}),
                           watchdog=Dog(), tasks=[], program=SimpleNamespace(tokens_per_step=2 * 8),  # batch x seq
                           preempted=False, skip_batches=[],
                           batch_index=lambda step: step + 100)


def clock(first=0, last=10):
    return StepClock(first, last, SimpleNamespace(waited=0.0), Dog())


def test_the_clock_measures_per_step_time_without_what_it_is_told_to_exclude(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(actions.time, "perf_counter", lambda: now[0])
    c = clock(first=4)
    now[0] += 8.0
    c.exclude(2.0)  # 2 s of tracing or saving: no step's
    c.prefetch.waited += 1.0
    c.device_wait += 3.0
    wall, data, host = c.per_step(6)  # two steps
    assert (wall, data, host) == (3.0, 0.5, 1.5)
    c.reset(6)
    now[0] += 1.0
    assert c.per_step(7) == (1.0, 0.0, 1.0)
    now[0] += 4.0
    c.exclude(4.0, "evaluation")  # an evaluation: its time is no step's, and the goodput account's evaluation
    now[0] += 0.5
    assert c.per_step(7)[0] == 1.5
    assert c.goodput.seconds["evaluation"] == 4.0
    assert c.is_last(10) and not c.is_last(9)


def test_the_clock_times_the_wait_for_the_devices_and_tells_the_watchdog():
    c = clock()
    assert c.wait(3, {"loss": 1.0}) == (3, {"loss": 1.0})
    assert c.device_wait >= 0 and c.watchdog.events == [("doing", "waiting for step 3"), ("beat", 3)]


def test_report_is_due_every_log_every_steps_and_at_the_last_and_merges_its_extras():
    t = trainer(train=dict(grad_norms_every=4))
    t.record = lambda step, metrics, tps, wall, data: {"step": step, "loss": metrics["loss"], "tokens_per_sec": tps}
    log, c = Log(), clock(last=5)
    report = Report(t, log)
    assert [s for s in range(1, 6) if report.due(s, c)] == [2, 4, 5]
    grad_norms = report.extras[1]
    grad_norms.run = lambda step, metrics, wall, host, data: {"grad_norm_layer_0": 0.5}
    report.run(4, {"loss": 2.0}, c)
    assert log.records[-1]["step"] == 4 and log.records[-1]["loss"] == 2.0
    assert log.records[-1]["grad_norm_layer_0"] == 0.5 and log.records[-1]["tokens_per_sec"] > 0
    report.run(5, {"loss": 1.0}, c)  # not a grad_norms_every step
    assert "grad_norm_layer_0" not in log.records[-1] and c.step == 5  # the clock starts a new interval
    assert any(kind == "observe" for kind, _ in t.watchdog.events)


def test_grad_norms_and_stragglers_are_due_on_their_own_period():
    t = trainer(train=dict(grad_norms_every=3, straggler_every=2))
    assert [s for s in range(1, 7) if GradNorms(t).due(s, clock())] == [3, 6]
    assert not GradNorms(trainer()).due(3, clock())
    assert not any(StragglerCheck(t).due(s, clock()) for s in range(1, 7))  # one process: nothing to compare


def test_evaluation_writes_its_record_keeps_its_time_out_of_the_steps_and_lets_the_first_compile():
    t = trainer()
    t.evaluation = lambda: {"eval_loss": 3.5}
    log, c = Log(), clock(last=6)
    ev = Evaluation(t, log)
    assert [s for s in range(1, 7) if ev.due(s, c)] == [4, 6]
    before = c.since
    time.sleep(0.01)
    ev.run(4, None, c)
    assert log.records == [{"step": 4, "eval_loss": 3.5}] and c.since > before
    assert c.goodput.seconds["evaluation"] == pytest.approx(c.since - before)  # booked as evaluation
    assert t.watchdog.events == [("doing", "evaluating after step 4"), ("beat", 4)]
    assert t.watchdog.one_time is True  # the first evaluation compiles: the watchdog's floor applies
    ev.run(6, None, c)
    assert t.watchdog.one_time is False
    t.evaluation = dict  # no validation data: nothing written
    ev.run(6, None, c)
    assert len(log.records) == 2
    assert not any(Evaluation(trainer(train=dict(eval_every=0)), log).due(s, c) for s in range(1, 7))


def test_task_scoring_has_its_own_period_and_runs_only_with_tasks():
    t = trainer(eval=dict(task_every=3))
    log, c = Log(), clock(last=7)
    scoring = TaskScoring(t, log)
    assert not any(scoring.due(s, c) for s in range(1, 8))  # no eval.tasks
    t.tasks = ["hellaswag"]
    t.task_evaluation = lambda: {"eval_acc_hellaswag": 0.25}
    assert [s for s in range(1, 8) if scoring.due(s, c)] == [3, 6, 7]
    scoring.run(3, None, c)
    assert log.records == [{"step": 3, "eval_acc_hellaswag": 0.25}]
    assert t.watchdog.events[0] == ("doing", "scoring the downstream tasks after step 3")


def saving_trainer(**checkpoint):
    t = trainer(checkpoint=checkpoint)
    t.guard = SimpleNamespace(bad_batches=[])
    saved = []
    t.save_checkpoint = lambda wait=False: saved.append(("save", wait)) or f"ckpt/{len(saved)}"
    t.checkpointer = SimpleNamespace(wait=lambda: saved.append("wait"), steps=lambda: [2])
    return t, saved


def test_saving_is_due_every_n_steps_on_a_signal_and_at_the_last_step():
    t, saved = saving_trainer(every=3)
    signalled = threading.Event()
    saving, c = Saving(t, Log(), signalled), clock(last=8)
    assert [s for s in range(1, 9) if saving.due(s, c) and saving.run(s, None, c) is False] == [3, 6, 8]
    assert saved == [("save", False), ("save", False), ("save", True)]
    assert not saving.due(4, c)
    signalled.set()
    assert saving.due(4, c) and saving.preempted


def test_saving_every_minutes_counts_from_the_last_save(monkeypatch):
    t, _ = saving_trainer(every_minutes=1.0)
    now = [1000.0]
    monkeypatch.setattr(actions.time, "monotonic", lambda: now[0])
    saving, c = Saving(t, Log(), threading.Event()), clock(last=100)
    assert not saving.due(1, c)
    now[0] += 61
    assert saving.due(2, c)
    saving.run(2, None, c)
    assert not saving.due(3, c)  # the save restarted the minutes


def test_a_periodic_save_writes_its_blocking_time_and_a_final_one_waits():
    t, saved = saving_trainer(every=2)
    log, c = Log(), clock(last=4)
    saving = Saving(t, log, threading.Event())
    assert saving.due(2, c) and saving.run(2, None, c) is False
    assert saved == [("save", False)] and log.records[0]["step"] == 2 and "checkpoint_blocking_s" in log.records[0]
    assert t.watchdog.one_time is True and not saving.owed  # the first save sets up the checkpointer
    assert saving.due(4, c) and saving.run(4, None, c) is False
    assert saved[-1] == ("save", True) and len(log.records) == 1  # the last: durable, no blocking record


def test_a_save_inside_a_nan_streak_is_owed_and_a_preempted_run_stops(caplog):
    t, saved = saving_trainer(every=2)
    t.guard.bad_batches = [103]
    signalled = threading.Event()
    saving, c = Saving(t, Log(), signalled), clock(last=10)
    assert saving.due(2, c) and saving.run(2, None, c) is False
    assert saved == [] and saving.owed  # waits for the streak to end
    t.guard.bad_batches = []
    assert saving.due(3, c)  # still owed
    signalled.set()
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        assert saving.due(3, c) and saving.run(3, None, c) is True
    assert t.preempted and saved == [("save", True)]
    assert "preempted at step 3: checkpoint saved to ckpt/1" in caplog.text


def test_the_local_tier_saves_between_the_persistent_saves_and_waits_for_a_streak_to_end(monkeypatch):
    t, _ = saving_trainer(local_dir="/nvme", local_every=2, local_every_minutes=1.0)
    local = []
    t.save_local = lambda: local.append(t.step)
    now = [1000.0]
    monkeypatch.setattr(actions.time, "monotonic", lambda: now[0])
    log, c = Log(), clock(last=100)
    saving = LocalSaving(t, log)
    for t.step in range(1, 7):
        if saving.due(t.step, c, persistent=t.step == 4):  # step 4: the persistent tier saves it
            saving.run(t.step, c)
    assert local == [2, 6] and [r["step"] for r in log.records] == [2, 6]
    assert "local_checkpoint_blocking_s" in log.records[0] and t.watchdog.one_time is False
    now[0] += 61  # local_every_minutes: at a step that is no multiple of local_every
    t.guard.bad_batches = [107]
    assert saving.due(7, c, persistent=False)
    saving.run(7, c)
    assert local == [2, 6] and saving.owed  # not inside a NaN/Inf streak
    t.guard.bad_batches = []
    assert saving.due(8, c, persistent=True) is False and not saving.owed  # the persistent save stands for it
    off, _ = saving_trainer(local_dir="")
    assert not LocalSaving(off, Log()).due(2, c, persistent=False)


def guard_trainer(**guard):
    t = trainer(guard=guard)
    t.checkpointer = SimpleNamespace(wait=lambda: None, steps=lambda: [], directory="ckpts")
    t.save_checkpoint = lambda wait=False: "ckpts/7"
    t.restore = lambda root, steps, verb: None  # neither tier holds a checkpoint
    return t


def test_the_guard_counts_a_nan_streak_and_stops_without_a_checkpoint(caplog):
    t = guard_trainer(max_consecutive_bad=2)
    guard, c = Guard(t), clock()
    assert guard.judge(None, c, Log()) is None  # nothing dispatched before
    assert guard.judge((5, {"finite": True, "loss": 1.0}), c, Log()) is None
    assert guard.judge((6, {"finite": False, "loss": float("nan")}), c, Log()) is None
    assert guard.bad_batches == [105] and "step 6: loss or gradients are NaN/Inf; update skipped (1 in a row)" \
        in caplog.text
    with pytest.raises(UserError, match="2 NaN/Inf steps in a row at step 7, no checkpoint to roll back to; "
                                        "state saved to ckpts/7"):
        guard.judge((7, {"finite": False, "loss": float("nan")}), c, Log())


def test_the_guard_rolls_back_to_the_newest_checkpoint_and_skips_the_bad_batches():
    t = guard_trainer(max_consecutive_bad=2)
    t.checkpointer.steps = lambda: [4]
    t.skip = lambda batches: t.skip_batches.extend(batches)
    t.restore = lambda root, steps, verb: {"step": 4, "verb": verb}
    guard, c, log = Guard(t), clock(), Log()
    guard.judge((6, {"finite": False, "loss": 0.0}), c, log)
    assert guard.judge((7, {"finite": False, "loss": 0.0}), c, log) == 4
    assert t.state["verb"] == "guard: 2 NaN/Inf steps in a row; rolled back to"
    assert t.skip_batches == [105, 106] and guard.rollbacks == 1 and guard.bad_batches == [] and log.rewound == [4]
    guard.judge((5, {"finite": True, "loss": 1.0}), c, log)  # a finite step ends a streak
    assert guard.bad_batches == []


def test_the_guard_rolls_back_at_once_after_a_loss_spike(caplog):
    t = guard_trainer(spike_factor=2.0, spike_window=2)
    t.checkpointer.steps = lambda: [2]
    t.skip = lambda batches: t.skip_batches.extend(batches)
    t.restore = lambda root, steps, verb: {"step": 2}
    guard, c = Guard(t), clock()
    for step, loss in [(1, 4.0), (2, 4.0), (3, 4.2)]:
        assert guard.judge((step, {"finite": True, "loss": loss}), c, Log()) is None
    assert guard.judge((4, {"finite": True, "loss": 40.0}), c, Log()) == 2
    assert guard.loss_spikes == 1 and t.skip_batches == [103] and "step 4: loss spike: 40.0000" in caplog.text


def test_preemption_signals_set_the_event_and_give_the_handlers_back():
    before = signal.getsignal(signal.SIGTERM)
    with preemption_signals() as signalled:
        assert not signalled.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert signalled.is_set()
    assert signal.getsignal(signal.SIGTERM) is before
