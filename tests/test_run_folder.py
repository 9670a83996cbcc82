"""A run folder belongs to one run: the lock (meshtrain/run/lock.py), the record of what defines the run
(run.json, meshtrain/run/run_dir.py), the schedule's horizon, and folders that are not runs."""
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from meshtrain.config.loader import UserError
from meshtrain.data.tokens import Tokens
from meshtrain.run import run_dir
from meshtrain.run.lock import LOCK_FILE, FolderLock
from meshtrain.testing import ROOT, tiny_config

HOLD = ("import sys, time; from meshtrain.run.lock import FolderLock; FolderLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(60)")


@pytest.fixture
def holder_process(tmp_path):
    """Another process holding the lock on tmp_path/run (imports no JAX: starts in a fraction of a second)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def write_lock(folder, **holder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps(holder) if holder else "")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid  # exited and reaped: no process has it (until the kernel reuses it)


# (case, lock file before, outcome): None = acquired silently, "notice" = stale lock taken over, "error" = refused
LOCK_CASES = [
    ("fresh folder", None, None),
    ("released lock (empty file)", {}, None),
    ("killed holder (pid gone)", "dead", "notice"),
    ("holder on another host, no flock held", {"host": "elsewhere", "pid": 1, "since": "then", "epoch": 0}, "notice"),
    ("unreadable lock file", "garbage", "notice"),
    ("live holder on this host, flock not shared (network fs)", "alive", "error"),
]


@pytest.mark.parametrize("case,before,outcome", LOCK_CASES, ids=[c[0] for c in LOCK_CASES])
def test_lock_takes_over_only_what_no_process_holds(tmp_path, case, before, outcome):
    folder = tmp_path / "run"
    if before == "dead":
        write_lock(folder, host=socket.gethostname(), pid=dead_pid(), since="then", epoch=time.time())
    elif before == "alive":
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        write_lock(folder, host=socket.gethostname(), pid=sleeper.pid, since="then", epoch=time.time())
    elif before == "garbage":
        folder.mkdir()
        (folder / LOCK_FILE).write_bytes(b"\xff\x00 not json")
    elif before is not None:
        write_lock(folder, **before)
    lock = FolderLock(folder)
    try:
        if outcome == "error":
            with pytest.raises(UserError, match=rf"^--out {folder} is in use by pid {sleeper.pid} on "
                                                rf"{socket.gethostname()} \(since then\); wait for that run"):
                lock.acquire()
            return
        lock.acquire()
        notice = lock.stale_notice()
        assert (notice is not None) == (outcome == "notice"), notice
        if notice:
            assert notice.startswith(f"--out {folder} was locked by pid ") and "lock taken over" in notice
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
        if before == "alive":
            sleeper.kill()
    assert (folder / LOCK_FILE).read_text() == ""  # released: no holder named


def test_a_second_process_is_refused_at_once_and_one_process_shares_its_lock(tmp_path, holder_process):
    with pytest.raises(UserError, match=rf"^--out {tmp_path / 'run'} is in use by pid {holder_process.pid} on "):
        FolderLock(tmp_path / "run").acquire()
    holder_process.kill()
    holder_process.wait()  # killed: the kernel dropped its flock, the file still names it
    first, second = FolderLock(tmp_path / "run").acquire(), FolderLock(tmp_path / "run").acquire()
    assert "no longer runs" in first.stale_notice() and second.stale_notice() is None
    first.release()
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()  # second holds it
    second.release()


def test_trainer_refuses_a_locked_out_before_building_anything(tmp_path, holder_process):
    from meshtrain.run.trainer import Trainer

    out = tmp_path / "run"
    (out / "run.json").write_text("{}")  # the running run's files
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n' * 300)
    started = time.perf_counter()
    with pytest.raises(UserError, match="is in use by pid"):
        Trainer(tiny_config(out=str(out)))
    assert time.perf_counter() - started < 10  # no data, no compile (each tens of seconds)
    assert (out / "metrics.jsonl").read_text().count("\n") == 300  # the running run's records intact


# ---- what is not a run folder ----
EARLIER = yaml.safe_dump({"model": {"family": "llama"}, "parallel": {}, "optim": {}, "train": {}, "data": {},
                          "checkpoint": {}})  # an earlier version's config.yaml, without the header
FOLDER_CASES = [
    ("new folder", [], None),
    ("empty folder", ["."], None),
    ("only a lock file", [LOCK_FILE], None),
    ("a run (run.json)", ["run.json", "notes.txt"], None),
    ("a run of an earlier version (its config.yaml)", [("config.yaml", EARLIER), "metrics.jsonl"], None),
    ("a run with meshtrain's header", [("config.yaml", "# written by meshtrain 0.1.0 at the start of training\n"),
                                       "checkpoints/x"], None),
    ("a user's folder", ["thesis.tex", "data.csv"],
     "is a folder that is not a meshtrain run (it holds data.csv and 1 more)"),
    ("metrics alone", ["metrics.jsonl"], "is a folder that is not a meshtrain run (it holds metrics.jsonl)"),
    ("a user's notes named config.yaml", [("config.yaml", "notes: my experiment\n")],
     "is a folder that is not a meshtrain run (it holds config.yaml)"),
    ("another tool's config and checkpoints", [("config.yaml", "model: {}\ntrain: {}\ndata: {}\n"), "checkpoints/x"],
     "is a folder that is not a meshtrain run (it holds checkpoints and 1 more)"),
    ("a config.yaml that is not YAML", [("config.yaml", "a: [\n")],
     "is a folder that is not a meshtrain run (it holds config.yaml)"),
]


@pytest.mark.parametrize("case,files,error", FOLDER_CASES, ids=[c[0] for c in FOLDER_CASES])
def test_out_must_be_new_empty_or_a_run(tmp_path, case, files, error):
    out = tmp_path / "out"
    for name, text in (f if isinstance(f, tuple) else (f, "x") for f in files):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        if name != ".":
            (out / name).write_text(text)
    if error:
        with pytest.raises(UserError, match="^" + re.escape(f"--out {out} {error}; pick a new or empty folder") + "$"):
            run_dir.checked(str(out))
        assert all((out / name).read_text() == text for name, text in (f for f in files if isinstance(f, tuple)))
    else:
        assert run_dir.checked(str(out)) == out
    made = {(f[0] if isinstance(f, tuple) else f).split("/")[0] for f in files if f != "."}
    assert sorted(p.name for p in out.iterdir()) == sorted(made) if out.exists() else True  # nothing written


# ---- what defines a run ----
def test_fingerprint_follows_the_tokens_not_the_file():
    a = Tokens([np.arange(5000) % 251])
    assert run_dir.data_fingerprint(a) == run_dir.data_fingerprint(Tokens([np.arange(2000) % 251,
                                                                           np.arange(2000, 5000) % 251]))
    changed = np.arange(5000) % 251
    changed[4321] += 1
    assert run_dir.data_fingerprint(Tokens([changed])) != run_dir.data_fingerprint(a)
    assert run_dir.data_fingerprint(Tokens([np.arange(5001) % 251])) != run_dir.data_fingerprint(a)
    assert run_dir.data_fingerprint(None) == "synthetic"
    assert run_dir.data_fingerprint(a) == f"5000:int64:sha256:{hashlib.sha256(np.asarray(a).tobytes()).hexdigest()}"


def data_start(out, path, allow_change=False, earlier=True):
    """(config, mixture, identity, changes) of a start in `out` on the token file `path`, as Trainer makes it."""
    from meshtrain.data import mixture

    cfg = tiny_config(f"data.path={path}", "data.kind=auto", out=str(out))
    mix = mixture.load(cfg.data, 256)
    mine, changes = run_dir.continued(out, cfg, run_dir.mixture_fingerprint(mix), allow_change,
                                      earlier=lambda: run_dir.mixture_fingerprint(mix, run_dir.windows_fingerprint))
    return cfg, mix, mine, changes


def first_start(out, path):
    out.mkdir()
    cfg, mix, mine, changes = data_start(out, path)
    run_dir.record_start(out, mine, cfg, 0, changes, run_dir.data_files(out, mix))
    return mix


@pytest.mark.fast
def test_a_10kb_change_inside_a_1mb_file_is_refused_at_resume(tmp_path, monkeypatch):
    """The bug: the fingerprint hashed 64 windows of 1,024 tokens, so a change between them resumed in
    silence. Now it is the sha256 of every byte."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, out = tmp_path / "train.bin", tmp_path / "run"
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 19).astype(np.uint16)  # 1 MiB
    tokens.tofile(path)
    before = first_start(out, path).tokens[0]
    assert data_start(out, path)[3] == []
    n = len(tokens)
    lo = int(np.unique(np.linspace(0, n - 1024, 64).astype(np.int64))[31]) + 1024 + 100  # between two windows
    with open(path, "r+b") as f:
        f.seek(2 * lo)
        f.write((tokens[lo:lo + 5120] + 1).tobytes())  # 10 KiB
    _, mix, _, _ = data_start(out, path, allow_change=True)
    assert run_dir.windows_fingerprint(mix.tokens[0]) == run_dir.windows_fingerprint(before)  # the old blind spot
    sha = lambda t: f"{n}:uint16:sha256:{t.sha256()[:12]}..."
    refusal = (f"the run in {out} trained on other data (fingerprint {sha(before)}, from {path}), this start's is "
               f"{sha(mix.tokens[0])} (from {path}); use a new --out")
    with pytest.raises(UserError, match=f"^{re.escape(refusal)}"):
        data_start(out, path)
    with pytest.raises(UserError, match=f"^{path} holds other data than the run in {out} trained on"):
        run_dir.check_run_data(out, mix)


@pytest.mark.fast
def test_a_run_json_of_an_earlier_version_resumes_and_is_upgraded(tmp_path, monkeypatch, caplog):
    """A run.json with the earlier windowed fingerprint: the same data resumes (compared like with like)
    and the record is upgraded with a notice; other data is refused, in the earlier format."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, other, out = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "run"
    (np.arange(5000) % 251).astype(np.uint16).tofile(path)
    (np.arange(5000) % 241).astype(np.uint16).tofile(other)
    mix = first_start(out, path)
    record = json.loads((out / "run.json").read_text())
    record["identity"]["data"] = old = run_dir.windows_fingerprint(mix.tokens[0])
    del record["data_files"]
    (out / "run.json").write_text(json.dumps(record))  # as an earlier version wrote it
    run_dir.check_run_data(out, mix)
    with pytest.raises(UserError, match=rf"^the run in {out} trained on other data \(fingerprint {old}, from {path}\), "
                                        rf"this start's is 5000:[0-9a-f]{{16}} \(from {other}\)"):
        data_start(out, other)
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        cfg, mix, mine, changes = data_start(out, path)
    assert changes == [] and f"records its data by an earlier version's fingerprint ({old})" in caplog.text
    run_dir.record_start(out, mine, cfg, 10, changes, run_dir.data_files(out, mix))
    upgraded = json.loads((out / "run.json").read_text())["identity"]["data"]
    assert upgraded == f"5000:uint16:sha256:{mix.tokens[0].sha256()}"


# (change at the second start, config overrides, data fingerprint, the refusal's first words)
IDENTITY_CASES = [
    ("nothing", [], "fp", None),
    ("more steps (the horizon stays)", ["train.steps=50"], "fp", None),
    ("how it runs and learns", ["parallel.mesh=fsdp=2", "optim.lr=0.01", "train.batch_size=4"], "fp", None),
    ("other data", [], "other", "the run in {out} trained on other data (fingerprint fp, from synthetic data), "
                                "this start's is other (from synthetic data)"),
    ("seed", ["train.seed=7"], "fp", "the run in {out} has train.seed=0, this start 7"),
    ("schedule horizon", ["optim.schedule_steps=50"], "fp", "the run in {out} has optim.schedule_steps=20, "
                                                            "this start 50"),
    ("seed and data", ["train.seed=7"], "other", "the run in {out} trained on other data .* (and 1 more)"),
]


@pytest.mark.parametrize("case,overrides,data,refusal", IDENTITY_CASES, ids=[c[0] for c in IDENTITY_CASES])
def test_a_start_that_changes_what_defines_the_run_is_refused(tmp_path, case, overrides, data, refusal):
    out = tmp_path / "run"
    out.mkdir()
    first = tiny_config("train.steps=20", out=str(out))
    mine, changes = run_dir.continued(out, first, "fp", allow_change=False)
    assert first.optim.schedule_steps == 20 and changes == []
    run_dir.record_start(out, mine, first, 0, changes)
    again = tiny_config("train.steps=20", *overrides, out=str(out))
    if refusal is None:
        assert run_dir.continued(out, again, data, allow_change=False)[1] == []
        assert again.optim.schedule_steps == 20  # a resume with more --steps continues the recorded curve
        return
    pattern = ".*".join(map(re.escape, refusal.format(out=out).split(".*")))  # literal text but for .*
    with pytest.raises(UserError, match=f"^{pattern}; use a new --out for a new run, or pass --allow-change to "
                                        f"continue this one with the change$"):
        run_dir.continued(out, again, data, allow_change=False)
    allowed = tiny_config("train.steps=20", *overrides, out=str(out))
    mine, changes = run_dir.continued(out, allowed, data, allow_change=True)
    assert changes and run_dir.record_start(out, mine, allowed, 10, changes) is None
    record = json.loads((out / "run.json").read_text())
    assert record["identity"] == mine and record["starts"][-1]["changes"] == changes  # the new phase, recorded
    assert run_dir.continued(out, tiny_config("train.steps=20", *overrides, out=str(out)), data, False)[1] == []


@pytest.mark.parametrize("allow_change", [False, True])
def test_another_model_is_another_run_even_with_allow_change(tmp_path, allow_change):
    first = tiny_config(out=str(tmp_path))
    run_dir.record_start(tmp_path, run_dir.continued(tmp_path, first, "fp", False)[0], first, 0, [])
    wider = tiny_config("model.d_model=64", "model.head_dim=0", out=str(tmp_path))
    with pytest.raises(UserError, match="^" + re.escape(f"the run in {tmp_path} has model.d_model=32, this start has "
                                                        f"64; use a new --out for a new run, or the model section of "
                                                        f"{tmp_path / 'config.yaml'}") + "$"):
        run_dir.continued(tmp_path, wider, "fp", allow_change)


def test_an_unreadable_record_is_an_error(tmp_path):
    (tmp_path / "run.json").write_text('{"identity": ')
    with pytest.raises(UserError, match=rf"^{tmp_path / 'run.json'} is unreadable \(not JSON: .*\); it records what "
                                        r"defines this run: restore it, or use a new --out for a new run$"):
        run_dir.continued(tmp_path, tiny_config(out=str(tmp_path)), "fp", False)


def test_more_steps_on_resume_continue_the_schedule_instead_of_rescaling_it(tmp_path, caplog):
    """The bug: --steps 8 on a 4-step run rescaled the schedule already applied (warmup cut). Now the
    horizon is the first start's, and steps 5-8 run at the end value of that curve."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    one = jax.devices()[:1]
    overrides = ("parallel.mesh=1", "checkpoint.resume=auto", "train.log_every=1", "train.eval_every=0",
                 "optim.warmup_steps=1")
    first = Trainer(tiny_config(*overrides, "train.steps=4", out=str(tmp_path)), devices=one)
    first.fit(log=MetricsLog(tmp_path, primary=False))
    extended = Trainer(tiny_config(*overrides, "train.steps=8", out=str(tmp_path)), devices=one)
    assert extended.cfg.optim.schedule_steps == 4
    more = [r["lr"] for r in extended.fit(log=MetricsLog(tmp_path, primary=False))]
    ocfg = extended.cfg.optim
    np.testing.assert_allclose(more, [ocfg.lr * ocfg.min_lr_ratio] * 4, rtol=1e-6)
    starts = json.loads((tmp_path / "run.json").read_text())["starts"]
    assert [(s["step"], s["steps"]) for s in starts] == [(0, 4), (4, 8)]
    assert (tmp_path / LOCK_FILE).read_text() == ""  # fit() gave the folder back
    # run.json deleted: the horizon and the seed are read from the newest checkpoint, not moved in silence.
    (tmp_path / "run.json").unlink()
    with pytest.raises(UserError, match=r"^the run in .* has train.seed=0, this start 7; use a new --out"):
        Trainer(tiny_config(*overrides, "train.steps=12", "train.seed=7", out=str(tmp_path)), devices=one)
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        again = Trainer(tiny_config(*overrides, "train.steps=12", out=str(tmp_path)), devices=one)
    assert again.cfg.optim.schedule_steps == 4 and "run.json is missing: what defines the run" in caplog.text
    again.fit(log=MetricsLog(tmp_path, primary=False))
    starts = json.loads((tmp_path / "run.json").read_text())["starts"]
    assert [s["step"] for s in starts] == [8] and starts[0]["record_rebuilt_from"] == str(tmp_path / "checkpoints/8")


# ---- files a command writes: never over one it did not create, unless --force ----
def report_args(tmp_path, target):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {5 - s / 10}, "lr": 0.001, "grad_norm": 1.0, '
                                               f'"tokens_per_sec": 100.0}}\n' for s in range(1, 4)))
    return ["meshtrain.report", [str(run), "--out", str(target)]]


def draw_args(tmp_path, target):
    return ["meshtrain.plan", ["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--draw", str(target)]]


def tokenizer_args(tmp_path, target):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    return ["meshtrain.data.__main__", ["train-tokenizer", str(text), "--vocab-size", "300", "--out", str(target)]]


WRITERS = {"report --out": (report_args, "plot.png"), "plan --draw": (draw_args, "timeline.png"),
           "data train-tokenizer --out": (tokenizer_args, "tok.json")}
OUTPUT_CASES = [  # (case, what is at the target before, extra flags, error or None)
    ("new file", None, [], None),
    ("a file of the user's", "mine", [], "already exists; pass --force to overwrite it"),
    ("a file of the user's, --force", "mine", ["--force"], None),
    ("unknown file type", "suffix", [], "unknown file type .xyz; use one of"),
    ("in a folder that is not there yet", "nofolder", [], None),
    ("a folder in the way", "folder", [], "is a folder; name a file"),
]


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("case,before,flags,error", OUTPUT_CASES, ids=[c[0] for c in OUTPUT_CASES])
def test_no_command_overwrites_a_file_without_force(tmp_path, capsys, writer, case, before, flags, error):
    import importlib

    make_args, name = WRITERS[writer]
    target = tmp_path / {"suffix": "out.xyz", "nofolder": f"missing/{name}"}.get(before, name)
    if before == "mine":
        target.write_text("the user's own file")
    elif before == "folder":
        target.mkdir()
    module, argv = make_args(tmp_path, target)
    rc = importlib.import_module(module).main(argv + flags)
    err = capsys.readouterr().err
    if error:
        assert rc == 2 and err.startswith("error: ") and error in err and err.count("\n") == 1, err
        assert (target.read_text() == "the user's own file") if before == "mine" else \
            target.is_dir() if before == "folder" else not target.exists()
    else:
        assert rc == 0 and target.stat().st_size > 0 and target.read_bytes() != b"the user's own file"
    assert not list(tmp_path.rglob(".*tmp*"))  # no leftovers
