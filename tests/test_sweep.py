"""python -m meshtrain.sweep on the tiny config. One 4-trial study, 2 trials at a time on one CPU
device each, is killed (SIGKILL) while a trial trains and then run again with the same command; the
two tests read its results: it prunes the trial with an absurd learning rate and names the best in
best.json; the rerun retries the killed trial(s) in their own folders, resuming the checkpoint their
runs saved, and never reruns a finished trial. A failed run fails its trial with its `error:` line;
a bad space file or flag is one `error:` line, exit 2, nothing written.

Determinism: the trials are enqueued in the study before the sweep starts (Optuna runs WAITING trials
first, in order), so trial 2 always has lr=3.0, whose eval_loss at its first eval (step 100) is far
above the others' (6.0 against 3.5). The median pruner with --startup-trials 1 compares it with
the complete trials, and with 2 slots trial 2 starts only after trial 0 or 1 has completed, so it is
pruned at its first eval, as is its retry if the kill comes first. Trial 3 is a good run that may
complete or be pruned by the median rule; either way it finishes. The sweep is killed as soon as
trial 3 logs its first loss, 100 steps before its first eval (which alone could prune it).
The trials other than 2 differ in train.seed only: the learning rate is a constant of the compiled
step, so they share one program (and the session's compilation cache), which keeps the file fast."""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import optuna
import pytest
from conftest import ROOT, TINY

from meshtrain.sweep.__main__ import main

TRIALS = [{"optim.lr": 1e-2, "train.seed": 0}, {"optim.lr": 1e-2, "train.seed": 1},
          {"optim.lr": 3.0, "train.seed": 0}, {"optim.lr": 1e-2, "train.seed": 2}]
SETS = ["train.steps=200", "train.eval_every=100", "train.eval_batches=1", "parallel.mesh=1"]
SPACE = "optim.lr: {type: float, low: 1.0e-4, high: 3.0, log: true}\ntrain.seed: {type: int, low: 0, high: 1000}\n"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}  # trials on simulated CPU devices, also where GPUs are


def command(tmp_path, out, *flags):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return [sys.executable, "-m", "meshtrain.sweep", "--config", TINY, "--space", str(space), "--trials", "4",
            "--out", str(out), "--heartbeat", "2", *(a for s in SETS for a in ("--set", s)), *flags]


def enqueued_study(out, trials):
    """The study the sweep will find in <out>/study.db (its default), with these trials queued."""
    out.mkdir()
    study = optuna.create_study(storage=f"sqlite:///{out}/study.db", study_name=out.name, direction="minimize")
    for params in trials:
        study.enqueue_trial(params)
    return study


def records(run, key):
    path = run / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if key in r] if path.is_file() else []


def standing(trials):
    """Each original trial's number -> the trial that stands for it now (itself, or its last retry)."""
    return {t.system_attrs.get("failed_trial", t.number): t for t in trials
            if t.number not in {n for u in trials for n in u.system_attrs.get("retry_history", [])}}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    out = tmp / "sweep"
    enqueued_study(out, TRIALS)
    argv = command(tmp, out, "--parallel", "2", "--devices", "2", "--startup-trials", "1")
    first = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=open(tmp / "first.out", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not records(out / "trial-3", "loss"):
            assert first.poll() is None and time.time() < deadline, (tmp / "first.out").read_text()[-3000:]
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)  # while trial 3 trains (its run gets SIGTERM and checkpoints)
        first.wait()
    finally:
        first.kill()
    study = optuna.load_study(study_name=out.name, storage=f"sqlite:///{out}/study.db")
    before = study.get_trials()
    finished = {n: ((out / f"trial-{n}" / "metrics.jsonl").read_bytes(),
                    sorted(p.name for p in (out / f"trial-{n}" / "checkpoints").iterdir())) for n in (0, 1)}
    again = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    print((tmp / "first.out").read_text(), again.stdout, again.stderr)
    assert again.returncode == 0, again.stderr[-3000:]
    return SimpleNamespace(out=out, before=before, finished=finished, stdout=again.stdout, trials=study.get_trials())


def test_sweep_prunes_the_absurd_lr_and_names_the_best(sweep):
    now = standing(sweep.trials)
    assert sorted(now) == [0, 1, 2, 3] and [now[n].params for n in range(4)] == TRIALS
    assert all(t.state.is_finished() and t.state.name != "FAIL" for t in now.values())
    # Trial 2 (lr 3.0), or its retry, is pruned at its first eval; 0 and 1 complete.
    assert now[2].state.name == "PRUNED" and list(now[2].intermediate_values) == [100]
    assert now[2].intermediate_values[100] > 1.5 * max(now[n].intermediate_values[100] for n in (0, 1))
    assert now[0].state.name == now[1].state.name == "COMPLETE"
    # Two at a time, each on one CPU device: trial 1 started before trial 0 completed.
    assert now[1].datetime_start < now[0].datetime_complete
    for n, t in now.items():
        assert t.user_attrs["devices"] == "1 CPU device(s)" and t.user_attrs["run_dir"] == str(sweep.out / f"trial-{n}")
        assert " on 1 x " in (sweep.out / f"trial-{n}" / "config.yaml").read_text().splitlines()[0]
    # A complete trial's value is its run's final eval_loss; best.json names the lowest.
    complete = [t for t in now.values() if t.state.name == "COMPLETE"]
    for t in complete:
        final = records(sweep.out / f"trial-{t.system_attrs.get('failed_trial', t.number)}", "eval_loss")[-1]
        assert final["step"] == 200 and final["eval_loss"] == pytest.approx(t.value, rel=1e-12)
    best = min(complete, key=lambda t: t.value)
    saved = json.loads((sweep.out / "best.json").read_text())
    assert saved["trial"] == best.number and saved["eval_loss"] == best.value and saved["params"] == best.params
    assert saved["run"] == best.user_attrs["run_dir"]
    assert f"best: trial {best.number}, eval_loss {best.value:.4f}" in sweep.stdout
    assert len([line for line in sweep.stdout.splitlines() if " COMPLETE " in line]) == len(complete)  # the table


def test_a_killed_sweep_resumes_without_repeating_finished_trials(sweep):
    before = {t.number: t for t in sweep.before}
    assert before[0].state.name == before[1].state.name == "COMPLETE" and before[3].state.name == "RUNNING"
    # Finished trials stay as they were: same records, runs not retrained, no retry of them.
    for t in sweep.trials[:2]:
        assert (t.state, t.value, t.datetime_complete) == (before[t.number].state, before[t.number].value,
                                                           before[t.number].datetime_complete)
    assert {n: ((sweep.out / f"trial-{n}" / "metrics.jsonl").read_bytes(),
                sorted(p.name for p in (sweep.out / f"trial-{n}" / "checkpoints").iterdir()))
            for n in (0, 1)} == sweep.finished
    retries = [t for t in sweep.trials if "failed_trial" in t.system_attrs]
    assert {t.system_attrs["failed_trial"] for t in retries} <= {2, 3}
    assert all(before[t.system_attrs["failed_trial"]].state.name == "RUNNING" for t in retries)
    # Trial 3 was left RUNNING, failed as stale and retried in trial-3/, resuming its checkpoint, to the end.
    [retry] = [t for t in retries if t.system_attrs["failed_trial"] == 3]
    assert sweep.trials[3].state.name == "FAIL" and retry.params == TRIALS[3]
    assert not (sweep.out / f"trial-{retry.number}").exists()
    assert "preempted at step" in (sweep.out / "logs" / "trial-3.out").read_text()
    assert "resumed from step" in (sweep.out / "logs" / f"trial-{retry.number}.out").read_text()
    assert f"trial {retry.number} started: optim.lr=0.01 train.seed=2 -> " in sweep.stdout
    assert f"-> retry of trial 3, resuming {sweep.out / 'trial-3'}" in sweep.stdout
    steps = [r["step"] for r in records(sweep.out / "trial-3", "loss")]  # each step once, none skipped
    assert steps == list(range(1, len(steps) + 1))
    if retry.state.name == "PRUNED":  # by the median rule at its first eval (its run may end before the SIGTERM)
        assert list(retry.intermediate_values) == [100]
    else:  # it trained to the end and reported both evals
        assert retry.state.name == "COMPLETE" and steps[-1] == 200 and list(retry.intermediate_values) == [100, 200]
    # 4 trials stand for the study's 4: nothing more was started.
    assert len(sweep.trials) == 4 + len(retries) and len(standing(sweep.trials)) == 4


def test_a_failed_run_fails_its_trial_with_its_error_line(tmp_path):
    out = tmp_path / "sweep"
    argv = command(tmp_path, out, "--trials", "1", "--set", "parallel.mesh=2x2")  # 4 devices; a trial sees 8
    done = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    line = "error: mesh 2x2x1 needs 4 devices, found 8; change --mesh or --devices"
    assert done.returncode == 1 and f"trial 0 failed (exit 2): {line}" in done.stdout, done.stdout + done.stderr
    assert done.stderr == "error: no trial of study sweep completed; see the table above\n"
    [trial] = optuna.load_study(study_name="sweep", storage=f"sqlite:///{out}/study.db").get_trials()
    assert trial.state.name == "FAIL" and trial.user_attrs["error"] == line and not (out / "best.json").exists()


def test_a_rerun_draws_new_values(tmp_path):
    """The sampler is seeded with --seed plus the trials already in the study: a fresh study draws
    the same values every time, a rerun on a study with trials draws others."""
    from meshtrain.sweep.space import distribution, suggest
    from meshtrain.sweep.study import open_study

    space = {"optim.lr": distribution("optim.lr", {"type": "float", "low": 1e-4, "high": 1e-2, "log": True})}

    def draw(name, trials):
        _, study = open_study(f"sqlite:///{tmp_path}/study.db", name, 0, optuna.pruners.NopPruner(), 10)
        drawn = []
        for _ in range(trials):
            trial = study.ask()
            drawn.append(suggest(trial, "optim.lr", space["optim.lr"]))
            study.tell(trial, 1.0)
        return drawn

    first = draw("a", 2)
    assert draw("b", 2) == first  # a fresh study: the same draws
    assert not set(draw("a", 2)) & set(first)  # the rerun of "a" does not repeat them


@pytest.mark.parametrize("space, message", [
    ("optim.lrr: {type: float, low: 1.0e-4, high: 1.0e-2}", "unknown config key 'optim.lrr'"),
    ("optim.lr: {type: gaussian, low: 0, high: 1}", "optim.lr: type 'gaussian' is not one of float, int, categorical"),
    ("optim.lr: {type: float, low: 1.0e-2, high: 1.0e-4}", "optim.lr: low=0.01 is above high=0.0001"),
    ("optim.lr: {type: float, low: 0, high: 1, log: true}", "optim.lr: log needs low > 0, got 0"),
    ("optim.lr: {type: float, low: .nan, high: 1}", "optim.lr: low=nan must be a finite number"),
    ("optim.lr: {type: float, low: 0, high: .inf}", "optim.lr: high=inf must be a finite number"),
    ("optim.lr: {type: float, low: -1, high: 1}", "optim.lr=-1.0 must be >= 0"),
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


def test_parallel_trials_split_the_visible_gpus(monkeypatch):
    """Without a GPU here, the split of --parallel over GPUs is checked on a listed set of them."""
    from meshtrain.core.errors import UserError
    from meshtrain.sweep.devices import device_slots, visible_gpus

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert visible_gpus() == ["4", "5", "6", "7"]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert visible_gpus() == []
    slots = device_slots(2, None, ["4", "5", "6", "7"])
    assert [(s.env, s.args, s.label) for s in slots] == [({"CUDA_VISIBLE_DEVICES": "4,5"}, [], "GPU 4,5"),
                                                         ({"CUDA_VISIBLE_DEVICES": "6,7"}, [], "GPU 6,7")]
    [whole] = device_slots(1, None, ["4", "5"])  # one trial at a time keeps the environment's GPUs
    assert (whole.env, whole.label) == ({}, "GPU 4,5")
    with pytest.raises(UserError, match="--parallel 3 does not divide the 4 visible GPUs"):
        device_slots(3, None, ["4", "5", "6", "7"])


def test_the_example_space_passes_the_sweep_checks():
    """examples/sweep.yaml with the --set items of the command in its comment: every bound is a valid
    config and the base evaluates (what prepare() checks before any trial)."""
    from meshtrain.sweep.space import check_space, load_space

    path = str(ROOT / "examples" / "sweep.yaml")
    sets = ["data.kind=stdlib", "parallel.mesh=1", "train.steps=300", "train.eval_every=50",
            "train.batch_size=16", "train.seq_len=64"]
    space = load_space(path)
    assert sorted(space) == ["optim.lr", "optim.warmup_steps", "optim.weight_decay"]
    assert check_space(TINY, sets, space, path).train.eval_every == 50
