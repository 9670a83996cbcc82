"""Goodput (meshtrain/run/goodput.py): a start's account of its wall time by category, written into
run.json; replayed steps after a guard rollback and after a crash; the run's final line; `report`
over a run killed with SIGKILL and resumed twice."""
import contextlib
import io
import json
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY, tiny_config

from meshtrain import report
from meshtrain.run import goodput
from meshtrain.run.checkpoint import complete_steps
from meshtrain.run.goodput import Goodput
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.fast
def test_an_account_books_every_second_once_and_retrained_steps_as_replayed():
    clock, written = Clock(), []
    g = Goodput(begun=0.0, compile_s=2.0, first=0, write=written.append, clock=clock)
    clock.now = 5.0
    g.loop_started()  # 3 s of start-up besides the 2 s compile
    g.steps(0, 4, seconds=4.0, data_s=0.5)
    g.spend("checkpoint", 1.0)
    g.steps(4, 6, seconds=2.0, data_s=0.0)
    g.rolled_back(6)  # back to the step-4 checkpoint: steps 5 and 6 are trained again
    g.steps(4, 8, seconds=4.0, data_s=0.0)  # 2 of the 4 replayed
    clock.now = 18.0
    a = g.account()
    assert a["seconds"] == {"productive": 3.5 + 2.0 + 2.0, "startup": 3.0, "restarts": 0.0, "compile": 2.0,
                            "checkpoint": 1.0, "data": 0.5, "evaluation": 0.0, "replayed": 2.0, "other": 2.0}
    assert a["wall_s"] == 18.0 == sum(a["seconds"].values())
    assert (a["first"], a["reached"], a["replayed_steps"]) == (0, 8, 2)
    assert len(written) == 5 and written[-1]["reached"] == 8  # written at each change
    # a start that resumes at step 4 after a crash at step 7: its start-up is a restart's, steps 5-7 replayed
    again = Goodput(begun=0.0, compile_s=1.0, first=4, replay_until=7, clock=clock)
    clock.now = 3.0
    again.loop_started()
    again.steps(4, 10, seconds=6.0, data_s=0.0)
    assert again.seconds["restarts"] == 2.0 and again.seconds["replayed"] == 3.0 and again.replayed_steps == 3
    assert goodput.furthest([{"step": 0}, {"goodput": a}, {"goodput": again.account()}]) == 10


@pytest.mark.fast
def test_writing_the_account_takes_at_most_one_percent_of_the_time_but_saves_always_write():
    clock, written = Clock(), []

    def write(account):  # a write that takes 10 ms
        written.append(account["reached"])
        clock.now += 0.01

    g = Goodput(begun=0.0, compile_s=0.0, first=0, write=write, clock=clock)
    g.loop_started()
    for step in range(1, 11):  # a record every 0.3 s: the next write waits 10 ms / WRITE_SHARE = 1 s
        clock.now += 0.3
        g.steps(step - 1, step, seconds=0.3, data_s=0.0)
    g.spend("checkpoint", 0.0)
    assert written == [0, 4, 8, 10]  # start-up, then every 4th record (1.2 s), and the save at once


@pytest.mark.fast
def test_the_run_total_sums_its_starts_and_names_the_largest_losses():
    first = {"first": 0, "reached": 6, "replayed_steps": 0, "wall_s": 10.0,
             "seconds": {"productive": 6.0, "startup": 1.0, "compile": 2.0, "checkpoint": 0.5, "other": 0.5}}
    second = {"first": 4, "reached": 10, "replayed_steps": 2, "wall_s": 10.0,
              "seconds": {"productive": 4.0, "restarts": 3.0, "replayed": 2.0, "data": 0.04, "other": 0.96}}
    summed = goodput.total([first, second])
    assert (summed["wall_s"], summed["starts"], summed["restarts"], summed["replayed_steps"]) == (20.0, 2, 1, 2)
    assert summed["goodput"] == 0.5 and summed["seconds"]["other"] == pytest.approx(1.46)
    assert goodput.line(summed) == "goodput 50% over 2 starts (restarts 15%, compile 10%, replayed steps 10%)"
    assert goodput.line(goodput.total([first])) == "goodput 60% (compile 20%, start-up 10%, checkpoint 5%)"
    assert goodput.line({"goodput": 1.0, "wall_s": 1.0, "starts": 1, "seconds": {"productive": 1.0}}) == \
        "goodput 100%"
    assert report.goodput_table(report.Run("runs/x", [], [], summed)).splitlines()[:3] == [
        "runs/x: goodput 50.0% of 20.0s over 2 starts (1 restart), 2 steps replayed",
        "  productive steps       10.0s   50.0%",
        "  restarts                3.0s   15.0%"]
    assert report.goodput_table(report.Run("runs/x", [], [])).startswith("runs/x: no goodput recorded")


@pytest.mark.fast
def test_a_start_under_the_train_command_begins_at_the_process_start(monkeypatch):
    age = goodput.process_age()
    assert age is not None and 0 < age < time.monotonic()  # this process: started after the machine
    assert abs(goodput.start_time() - time.perf_counter()) < 0.1  # pytest's process: from now
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(
        name="meshtrain.train")))
    assert time.perf_counter() - goodput.start_time() == pytest.approx(goodput.process_age(), abs=0.1)


def test_a_run_accounts_for_its_wall_time_and_the_steps_a_rollback_replays(tmp_path, capsys):
    """10 steps on one device with an evaluation and a checkpoint every 4 steps; batch 5 is poisoned
    (NaN), so step 6 rolls back to step 4 at once and steps 5-6 are trained again."""
    cfg = tiny_config("parallel.mesh=1", "train.steps=10", "train.eval_every=5", "checkpoint.every=4",
                      "guard.max_consecutive_bad=1", out=str(tmp_path))
    began = time.perf_counter()
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    clean = trainer.train_batches

    def batches(index):  # a token outside the vocabulary: the embedding turns it into NaN
        tokens = np.array(clean(index))
        tokens[0, 0] = trainer.cfg.model.vocab_size if index == 5 else tokens[0, 0]
        return jax.device_put(tokens, trainer.program.batch_sharding)

    trainer.train_batches = batches
    trainer.fit(log=MetricsLog(tmp_path, primary=False))
    measured = time.perf_counter() - began
    assert trainer.skip_batches == [5] and trainer.guard.rollbacks == 1
    a = json.loads((tmp_path / "run.json").read_text())["starts"][-1]["goodput"]
    s, summary = a["seconds"], capsys.readouterr().out.strip().splitlines()[-1]
    print(f"wall {a['wall_s']:.2f} s of {measured:.2f} s measured: {s}")
    assert (a["first"], a["reached"], a["replayed_steps"]) == (0, 10, 2)
    assert sum(s.values()) == pytest.approx(a["wall_s"], abs=0.01)
    # the account's wall is the run's, construction to the end (less closing the logs and the summary line)
    assert measured - max(1.0, 0.03 * measured) < a["wall_s"] <= measured
    assert -0.01 <= s["other"] < 0.1 * a["wall_s"]  # no second counted twice (rounding aside), few left out
    assert min(s["productive"], s["startup"], s["compile"], s["checkpoint"], s["evaluation"], s["replayed"]) > 0
    assert s["restarts"] == 0
    assert summary.startswith("done: steps 1-10 in ")
    assert summary.endswith("; " + goodput.line(goodput.total([a])))


def train(out, *extra):
    return [sys.executable, "-m", "meshtrain.train", "--config", TINY, "--out", str(out), "--devices", "1",
            "--mesh", "1", "--set", "checkpoint.every=4", "--set", "train.log_every=1", *extra]


def starts(out) -> list[dict]:
    with contextlib.suppress(OSError, ValueError):  # being replaced, or not yet written
        return json.loads((out / "run.json").read_text())["starts"]
    return []


def kill_after_a_checkpoint(out) -> None:
    """Start the run and SIGKILL it once this start has a complete checkpoint and has recorded steps past it."""
    before = len(starts(out))
    proc = subprocess.Popen(train(out, "--steps", "100000"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        now = starts(out)[before:]  # this start's entry, once written
        saved = [s for s in complete_steps(out / "checkpoints") if now and s > now[0]["step"]]
        if saved and now[0].get("goodput", {}).get("reached", 0) > saved[0]:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def test_a_run_killed_and_resumed_twice_reports_its_restarts_and_replayed_steps(tmp_path):
    out = tmp_path / "run"
    kill_after_a_checkpoint(out)
    kill_after_a_checkpoint(out)
    last = starts(out)[-1]["goodput"]["reached"] + 2
    done = subprocess.run(train(out, "--steps", str(last)), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    recorded = starts(out)
    print("\n".join(json.dumps(s["goodput"]) for s in recorded))
    assert [s["step"] > 0 for s in recorded] == [False, True, True]
    for i in (1, 2):  # the steps an earlier start reached past the checkpoint this one resumed from
        furthest = max(s["goodput"]["reached"] for s in recorded[:i])
        assert recorded[i]["goodput"]["replayed_steps"] == furthest - recorded[i]["step"] > 0
        assert recorded[i]["goodput"]["seconds"]["restarts"] > 0 and recorded[i]["goodput"]["seconds"]["replayed"] > 0
    replayed = sum(s["goodput"]["replayed_steps"] for s in recorded)
    summed = goodput.total([s["goodput"] for s in recorded])
    assert done.stdout.strip().splitlines()[-1].endswith("; " + goodput.line(summed))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert report.main([str(out), "--out", str(tmp_path / "report.png")]) == 0
    print(printed.getvalue())
    lines = printed.getvalue().splitlines()
    head = next(line for line in lines if line.startswith(f"{out}: goodput "))
    assert head.endswith(f"over 3 starts (2 restarts), {replayed} steps replayed")
    rows = {line[2:19].strip(): line for line in lines[lines.index(head) + 1:] if line.startswith("  ")}
    assert set(rows) == set(goodput.LABELS.values())
    assert float(rows["restarts"].split()[-2].rstrip("s")) > 0
