"""python -m meshtrain.sweep: a 4-trial study on the tiny config (2 trials at a time, one CPU device
each) prunes the trial with an absurd learning rate and names the best in best.json; a sweep killed
with SIGKILL during a trial and run again retries that trial in its own folder (resuming its
checkpoint) and never reruns a finished one; a bad space file is one `error:` line, exit 2, nothing
written.

Determinism: the trials are enqueued in the study before the sweep starts (Optuna runs WAITING trials
first, in order), so trial 2 always has lr=3.0, whose eval_loss at step 10 is about 50 against 5.5 for
the others. The median pruner with --startup-trials 1 compares it with the complete trials, and with
2 slots trial 2 starts only after trial 0 or 1 has completed: it is pruned at its first eval.
The other trials differ in train.seed only: the learning rate is a constant of the compiled step, so
they share one program (and the session's compilation cache), which keeps the file near a minute."""
import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest

from conftest import ROOT, TINY
from meshtrain.sweep import main

TRIALS = [{"optim.lr": 1e-2, "train.seed": 0}, {"optim.lr": 1e-2, "train.seed": 1},
          {"optim.lr": 3.0, "train.seed": 0}, {"optim.lr": 1e-2, "train.seed": 2}]
SETS = ["train.steps=100", "train.eval_every=10", "train.eval_batches=1", "parallel.mesh=1"]
SPACE = "optim.lr: {type: float, low: 1.0e-4, high: 3.0, log: true}\ntrain.seed: {type: int, low: 0, high: 1000}\n"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}  # trials on simulated CPU devices, also where GPUs are


def command(tmp_path, out, *flags):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return [sys.executable, "-m", "meshtrain.sweep", "--config", TINY, "--space", str(space), "--trials", "4",
            "--out", str(out), "--heartbeat", "2", *flags, *(a for s in SETS for a in ("--set", s))]


def enqueued_study(out, trials):
    """The study the sweep will find in <out>/study.db (its default), with these trials queued."""
    out.mkdir()
    study = optuna.create_study(storage=f"sqlite:///{out}/study.db", study_name=out.name, direction="minimize")
    for params in trials:
        study.enqueue_trial(params)
    return study


def records(run, key):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def test_sweep_prunes_the_absurd_lr_and_names_the_best(tmp_path):
    out = tmp_path / "sweep"
    study = enqueued_study(out, TRIALS)
    done = subprocess.run(command(tmp_path, out, "--parallel", "2", "--devices", "2", "--startup-trials", "1"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = study.get_trials()
    states = [t.state.name for t in trials]
    assert len(trials) == 4 and [t.params for t in trials] == TRIALS
    # Trial 2 (lr 3.0) is pruned at its first eval; 0 and 1 complete; 3 may go either way.
    assert states[:3] == ["COMPLETE", "COMPLETE", "PRUNED"] and states[3] in ("COMPLETE", "PRUNED")
    assert max(trials[2].intermediate_values) == 10 and trials[2].intermediate_values[10] > 10
    assert "trial 2 pruned at step 10" in done.stdout
    # Two at a time, each on one CPU device: trial 1 started before trial 0 completed.
    assert trials[1].datetime_start < trials[0].datetime_complete
    for t in trials:
        assert t.user_attrs["devices"] == "1 CPU device(s)"
        assert " on 1 x " in (out / f"trial-{t.number}" / "config.yaml").read_text().splitlines()[0]

    # The value of a complete trial is its run's final eval_loss; best.json names the lowest.
    for t in trials:
        if t.state.name == "COMPLETE":
            final = records(out / f"trial-{t.number}", "eval_loss")[-1]
            assert final["step"] == 100 and final["eval_loss"] == pytest.approx(t.value, rel=1e-12)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    best = min(complete, key=lambda t: t.value)
    saved = json.loads((out / "best.json").read_text())
    assert saved["trial"] == best.number and saved["eval_loss"] == best.value
    assert saved["params"] == best.params and saved["run"] == str(out / f"trial-{best.number}")
    assert f"best: trial {best.number}, eval_loss {best.value:.4f}" in done.stdout
    assert done.stdout.count(" COMPLETE ") == len(complete)  # the table, one row per trial


def test_killed_sweep_resumes_without_repeating_finished_trials(tmp_path):
    out = tmp_path / "sweep"
    enqueued_study(out, [{"optim.lr": 1e-2, "train.seed": seed} for seed in range(4)])
    argv = command(tmp_path, out, "--pruner", "none", "--devices", "1")
    first = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=open(tmp_path / "first.out", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while not ((out / "trial-2" / "metrics.jsonl").is_file() and records(out / "trial-2", "loss")):
            assert first.poll() is None and time.time() < deadline, (tmp_path / "first.out").read_text()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # during trial 2's training
        first.wait()
    finally:
        first.kill()
    finished = {n: (out / f"trial-{n}" / "metrics.jsonl").read_bytes() for n in (0, 1)}
    checkpoints = {n: sorted(p.name for p in (out / f"trial-{n}" / "checkpoints").iterdir()) for n in (0, 1)}
    before = optuna.load_study(study_name=out.name, storage=f"sqlite:///{out}/study.db").get_trials()
    assert [t.state.name for t in before] == ["COMPLETE", "COMPLETE", "RUNNING", "WAITING"]

    again = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    print((tmp_path / "first.out").read_text(), again.stdout)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = optuna.load_study(study_name=out.name, storage=f"sqlite:///{out}/study.db").get_trials()
    # 0 and 1 untouched; 2, left RUNNING, failed as stale and retried as 4 in trial-2/; 3 ran once.
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert [(t.value, t.datetime_complete) for t in trials[:2]] == [(t.value, t.datetime_complete) for t in before[:2]]
    assert trials[4].system_attrs["failed_trial"] == 2 and trials[4].params == trials[2].params
    assert trials[4].user_attrs["run_dir"] == str(out / "trial-2") and not (out / "trial-4").exists()
    assert sorted(t.params["train.seed"] for t in trials if t.state.name == "COMPLETE") == [0, 1, 2, 3]
    # Finished runs were not retrained; the retried one resumed from the checkpoint its run saved
    # when the killed sweep's SIGTERM reached it, and finished its 100 steps.
    assert {n: (out / f"trial-{n}" / "metrics.jsonl").read_bytes() for n in (0, 1)} == finished
    assert {n: sorted(p.name for p in (out / f"trial-{n}" / "checkpoints").iterdir()) for n in (0, 1)} == checkpoints
    assert "preempted at step" in (out / "logs" / "trial-2.out").read_text()
    assert "resumed from step" in (out / "logs" / "trial-4.out").read_text()
    steps = [r["step"] for r in records(out / "trial-2", "loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 100
    assert "trial 4 started: optim.lr=0.01 train.seed=2 -> " in again.stdout and "retry of trial 2" in again.stdout
    assert json.loads((out / "best.json").read_text())["trial"] == min(
        (t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value).number


@pytest.mark.parametrize("space, message", [
    ("optim.lrr: {type: float, low: 1.0e-4, high: 1.0e-2}", "unknown config key 'optim.lrr'"),
    ("optim.lr: {type: gaussian, low: 0, high: 1}", "optim.lr: type 'gaussian' is not one of float, int, categorical"),
    ("optim.lr: {type: float, low: 1.0e-2, high: 1.0e-4}", "optim.lr: low=0.01 is above high=0.0001"),
    ("optim.lr: {type: float, low: 0, high: 1, log: true}", "optim.lr: log needs low > 0, got 0"),
    ("optim.lr: {type: float, low: -1, high: 1}", "optim.lr=-1.0 must be >= 0.0"),
    ("optim.lr: {type: float, lo: 0, high: 1}", "optim.lr: unknown field 'lo'; float takes low, high, log, step"),
    ("train.steps: {type: int, low: 10, high: 20.5}", "train.steps: high=20.5 is not an integer"),
    ("model.d_model: {type: categorical, choices: []}", "model.d_model: choices must be a non-empty list"),
    ("optim.lr: 0.01", "optim.lr: expected a mapping with a type (float, int or categorical), got 0.01"),
    ("[optim.lr]", "must map config keys to distributions"),
    ("out: {type: categorical, choices: [a, b]}", "out is set by the sweep for each trial; use --out"),
    ("optim.lr: {type: float, low: 1, high: 2", "fix the YAML syntax"),
])
def test_a_bad_space_file_is_one_line_and_writes_nothing(tmp_path, capsys, space, message):
    (tmp_path / "space.yaml").write_text(space + "\n")
    out = tmp_path / "sweep"
    code = main(["--config", TINY, "--space", str(tmp_path / "space.yaml"), "--trials", "2", "--out", str(out),
                 "--set", "train.eval_every=10"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert not out.exists()


def test_cli_errors_exit_2_before_writing(tmp_path, capsys, monkeypatch):
    (tmp_path / "space.yaml").write_text(SPACE)
    out = tmp_path / "sweep"
    args = ["--config", TINY, "--space", str(tmp_path / "space.yaml"), "--trials", "2", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "meshtrain.sweep", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)  # tiny.yaml has no evals
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        "error: the sweep minimizes eval_loss, but train.eval_every is 0; set it, e.g. --set train.eval_every=50\n")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for extra, message in ((["--set", "optim.lr=0.1"], "optim.lr is in --space"),
                           (["--set", "devices=2"], "devices is set by the sweep for each trial; use --devices"),
                           (["--devices", "3", "--parallel", "2"], "--parallel 2 does not divide --devices 3"),
                           (["--devices", "2", "--set", "parallel.mesh=2x2"], "mesh 2x2 does not fit the 2 device(s)"),
                           (["--trials", "0"], "--trials 0 must be >= 1")):
        code = main([*args, "--set", "train.eval_every=10", *extra])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert not out.exists()
