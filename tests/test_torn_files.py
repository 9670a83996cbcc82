"""Files torn by a crash or a full disk, and sweep folders: what survives and what is said.

- metrics.jsonl (meshtrain/core/jsonl.py): a torn last record is dropped with one warning by every reader
  (report, resume, sweep); an undecodable line before it is an error; a failed append is cut off.
- A full disk at each point that writes (metrics, checkpoint, prepare's output, the sweep's best.json)
  is one `error:` line, leaves the earlier checkpoints resumable and no temporary folder behind.
- writing_whole removes its folder on any failure, and the folders that a killed process left.
- A sweep folder holds one study; a damaged study database is an error; a trial its killed sweep left
  RUNNING is failed and queued to resume at the next start.
Only the two full-disk training cases train (the tiny config, 6 steps, four short runs in all)."""
import errno
import fcntl
import json
import os
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from conftest import TINY

from meshtrain import report
from meshtrain.core import jsonl
from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_whole
from meshtrain.run import loggers
from meshtrain.run.checkpoint import complete_steps
from meshtrain.sweep import folder as sweep_folder
from meshtrain.sweep.scheduler import Sweep
from meshtrain.sweep.study import open_study
from meshtrain.sweep.summary import write_best
from meshtrain.sweep.trial import TrialRun

FULL = OSError(errno.ENOSPC, "No space left on device")
R1, R2 = b'{"step": 1, "loss": 2.0}\n', b'{"step": 2, "eval_loss": 1.5}\n'


# ---- the tolerant reader ----
@pytest.mark.fast
@pytest.mark.parametrize("tail, kept, torn_line", [
    (b"", [1, 2], None),  # whole
    (b'{"step": 3, "lo', [1, 2], 3),  # killed mid-write
    (b"\x00\x00\x00\x00", [1, 2], 3),  # a machine crash: the file's last block never written
    (b'{"step": 3, "lo\n', [1, 2], 3),  # undecodable, though terminated
    (b'{"step": 3}', [1, 2], 3),  # decodable, but its newline was never written: not whole
])
def test_a_torn_last_record_is_dropped_with_one_warning(tmp_path, caplog, tail, kept, torn_line):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(R1 + R2 + tail)
    assert [r["step"] for r in jsonl.read(path)] == kept
    said = [(r.levelname, r.getMessage()) for r in caplog.records]  # `warning: ...` on stderr
    assert said == ([] if torn_line is None else
                    [("WARNING", f"{path} line {torn_line} is a torn record (written when a process died or the "
                                 f"disk filled); dropped")])


@pytest.mark.fast
@pytest.mark.parametrize("text, line", [(R1 + b"garbage\n" + R2, 2), (b"[1]\n" + R1, 1), (R1 + b'{"st\n\n' + R2, 2)])
def test_an_undecodable_line_before_the_last_is_damage(tmp_path, text, line):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text)
    with pytest.raises(UserError, match=f"line {line} is not a JSON record, and not the last line"):
        jsonl.read(path)


def read_with(reader: str, run: Path) -> list[int]:
    """The steps of the records each reader of metrics.jsonl takes from `run`."""
    if reader == "report":
        loaded = report.load_run(str(run))
        return [r["step"] for r in loaded.train + loaded.evals]
    if reader == "resume":  # the run's own file, reopened to append after step 2
        loggers.Jsonl(run, keep_through=2).close()
        return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_bytes().splitlines())]
    trial = TrialRun(None, run, 2, [], None)  # the sweep, reading a trial's evals as it trains
    return [step for step, _ in trial.read_evals()]


@pytest.mark.fast
@pytest.mark.parametrize("reader, steps", [("report", [1, 2]), ("resume", [1, 2]), ("sweep", [2])])
def test_every_reader_takes_the_whole_records_and_refuses_damage(tmp_path, reader, steps):
    (tmp_path / "metrics.jsonl").write_bytes(R1 + R2 + b'{"step": 3, "lo')
    assert read_with(reader, tmp_path) == steps
    if reader == "resume":
        assert (tmp_path / "metrics.jsonl").read_bytes() == R1 + R2  # cut: the next record starts a line
    (tmp_path / "metrics.jsonl").write_bytes(R1 + b"garbage\n" + R2)
    with pytest.raises(UserError, match="line 2 is not a JSON record"):
        read_with(reader, tmp_path)


@pytest.mark.fast
@pytest.mark.parametrize("failure", ["short write", "error after a partial write"])
def test_a_failed_append_is_cut_off_and_one_user_error(tmp_path, monkeypatch, failure):
    log = loggers.Jsonl(tmp_path)
    log.write({"step": 1, "loss": 2.0})
    real = os.write

    def full(fd, data):
        real(fd, data[:7])
        if failure == "short write":
            return 7
        raise FULL

    monkeypatch.setattr(jsonl.os, "write", full)
    with pytest.raises(UserError, match=f"the disk holding {tmp_path / 'metrics.jsonl'} is full"):
        log.write({"step": 2, "loss": 1.0})
    monkeypatch.undo()
    log.write({"step": 3, "loss": 1.0})  # once there is space again
    log.close()
    assert [r["step"] for r in jsonl.read(tmp_path / "metrics.jsonl")] == [1, 3]


# ---- a full disk at each point that writes ----
def full_at_step_5_record(monkeypatch):
    real = os.write
    monkeypatch.setattr(jsonl.os, "write", lambda fd, data: (_ for _ in ()).throw(FULL)
                        if data.startswith(b'{"time"') and b'"step": 5, "loss"' in data else real(fd, data))


def full_at_checkpoint_6(monkeypatch):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    real = handler.JsonCheckpointHandler._save_fn

    async def save(self, x, directory):  # Orbax's own write of the step's metadata, in its save thread
        if f"{os.sep}6." in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", save)


def test_a_full_disk_in_training_is_one_line_and_the_checkpoints_resume(tmp_path, capsys, monkeypatch):
    """One run folder, three attempts of the same command (one compile): the disk fills as it appends
    the metrics of step 5, then as it saves step 6; then there is space again."""
    from meshtrain.train import main

    out = tmp_path / "run"
    argv = ["--config", TINY, "--out", str(out), "--steps", "6", "--set", "checkpoint.every=2",
            "--set", "logging.tensorboard=false"]
    for fault, what, rc, resumed_from, kept in [(full_at_step_5_record, "a metrics record", 2, None, [4, 2]),
                                                (full_at_checkpoint_6, "a checkpoint", 2, 4, [4, 2]),
                                                (None, None, 0, 4, [6, 4, 2])]:
        if fault:
            fault(monkeypatch)
        assert main(argv) == rc
        monkeypatch.undo()
        said = capsys.readouterr()
        if fault:
            assert said.err.startswith(f"error: the disk holding {out}") and f"(writing {what})" in said.err
            assert said.err.count("\n") == 1, said.err
        assert (f"resumed from step {resumed_from} " in said.out) == (resumed_from is not None)
        assert complete_steps(out / "checkpoints") == kept
    assert not [p for p in (out / "checkpoints").iterdir() if not p.name.isdigit()]  # no interrupted save left
    assert [r["step"] for r in jsonl.read(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_that_also_fails_the_tensorboard_flush_is_still_one_line(tmp_path, capsys, monkeypatch):
    """The disk fills at a checkpoint; closing the TensorBoard writer then fails the same way: the first
    error is the one said (a traceback before)."""
    import tensorboardX.event_file_writer as event_file_writer

    from meshtrain.train import main

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")
    full_at_checkpoint_6(monkeypatch)
    monkeypatch.setattr(event_file_writer.EventFileWriter, "flush", full)
    out = tmp_path / "run"
    assert main(["--config", TINY, "--out", str(out), "--steps", "6", "--set", "checkpoint.every=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the disk holding {out}") and "(writing a checkpoint)" in err
    assert err.count("\n") == 1, err


def prepare_out_of_space(tmp_path, monkeypatch) -> int:
    """python -m meshtrain.data prepare, the disk full as it writes the manifest: no --out made."""
    import importlib

    from meshtrain.data import __main__ as data_cli

    prepare = importlib.import_module("meshtrain.data.prepare")  # the module; the package exports its function
    (tmp_path / "docs.txt").write_text("one document\n")
    monkeypatch.setattr(prepare, "write_json", lambda path, obj: (_ for _ in ()).throw(FULL))
    code = data_cli.main(["prepare", str(tmp_path / "docs.txt"), "--tokenizer", "byte", "--out",
                          str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    return code


def best_json_out_of_space(tmp_path, monkeypatch) -> int:
    """The sweep's best.json, the disk full as it is replaced: the old one stays."""
    path = tmp_path / "best.json"
    path.write_text('{"trial": 0}\n')
    monkeypatch.setattr(Path, "write_text", lambda self, text: (_ for _ in ()).throw(FULL))
    with pytest.raises(UserError) as raised:
        write_best(path, {"trial": 1})
    monkeypatch.undo()
    print(f"error: {raised.value}", file=sys.stderr)  # as the sweep's main prints it
    assert path.read_text() == '{"trial": 0}\n'
    return 2


@pytest.mark.fast
@pytest.mark.parametrize("write, what", [(prepare_out_of_space, "--out"), (best_json_out_of_space, "best.json")])
def test_a_full_disk_writing_an_output_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, write, what):
    assert write(tmp_path, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the disk holding ") and f"(writing {what}" in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"] == []


# ---- writing_whole ----
@pytest.mark.fast
@pytest.mark.parametrize("failure, raised", [(KeyboardInterrupt, KeyboardInterrupt), (FULL, UserError),
                                             (ValueError("bad input"), ValueError)])
def test_writing_whole_leaves_nothing_when_the_block_fails(tmp_path, failure, raised):
    with pytest.raises(raised):
        with writing_whole(tmp_path / "out", "--out") as tmp:
            (tmp / "shard.bin").write_bytes(b"1234")
            raise failure
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fast
@pytest.mark.parametrize("left, stays, says", [
    ("killed", False, "removed"),  # its flock is free: the process is gone (a notice)
    ("writing", True, ""),  # another process holds its flock
])
def test_temporary_folders_left_by_a_killed_process_go_at_the_next_write(tmp_path, caplog, left, stays, says):
    old = tmp_path / ".out.tmp-0badf00d"
    old.mkdir()
    holder = os.open(old, os.O_RDONLY)
    if left == "writing":
        fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: as another process's lock
    else:
        os.close(holder)
    with writing_whole(tmp_path / "out", "--out") as tmp:
        (tmp / "done").write_text("yes")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["done"]
    assert old.exists() == stays and (says in caplog.text)
    if left == "writing":
        os.close(holder)


@pytest.mark.fast
def test_two_writers_of_one_folder_the_second_is_one_line_and_the_first_is_kept(tmp_path):
    """Two exports into one folder at once: both pass the new-folder check; the one that finishes second
    finds it filled and is one error, its own temporary folder gone, the first's output untouched."""
    with pytest.raises(UserError, match="was filled by another process while this one wrote it"):
        with writing_whole(tmp_path / "out", "--out") as second:
            (second / "model.safetensors").write_text("second")
            with writing_whole(tmp_path / "out", "--out") as first:
                (first / "model.safetensors").write_text("first")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out" / "model.safetensors").read_text() == "first"


# ---- sweep folders ----
def opened(out: Path, name: str = "a", url: str | None = None):
    url = url or f"sqlite:///{out / 'study.db'}"
    return open_study(url, name, 0, optuna.pruners.NopPruner(), 10, out.absolute())


def damage(out: Path, how: str) -> tuple[str, str, Path]:
    """Break a claimed sweep folder (of study 'a') one way; returns the (study, storage, --out) to open."""
    db, url = out / "study.db", f"sqlite:///{out / 'study.db'}"
    if how == "another --study":
        return "b", url, out
    elif how == "database deleted":
        db.unlink()
    elif how == "database recreated":
        db.unlink()
        optuna.create_study(storage=url, study_name="a")
    elif how == "database empty":
        db.write_bytes(b"")
    elif how == "not SQLite":
        db.write_text("study: a\n")
    elif how == "SQLite, damaged":
        db.write_bytes(db.read_bytes()[:100] + b"\xff" * (db.stat().st_size - 100))
    elif how == "SQLite, no study":
        db.unlink()
        with sqlite3.connect(db) as c:
            c.execute("CREATE TABLE notes (x)")
    elif how == "the study from another folder":
        (out.parent / "other").mkdir()
        return "a", url, out.parent / "other"
    elif how == "trials of no study":
        (out / "sweep.json").unlink()
        db.unlink()
    return "a", url, out


@pytest.mark.fast
@pytest.mark.parametrize("how, message", [
    ("the same study again", None),
    ("another --study", "holds the trials of study a in sqlite:///"),
    ("database deleted", "is missing, but --out"),
    ("database recreated", "holds as a new study; restore that database, or pass a new --out"),
    ("database empty", "is empty (a sweep killed while creating it?)"),
    ("not SQLite", "is not an SQLite file"),
    ("SQLite, damaged", "is damaged"),
    ("SQLite, no study", "is an SQLite file but no Optuna study database"),
    ("the study from another folder", "runs its trials in"),
    ("trials of no study", "holds trial folders that no study claims"),
])
def test_a_sweep_folder_holds_one_study(tmp_path, how, message):
    out = tmp_path / "sweep"
    out.mkdir()
    _, study = opened(out)
    (out / "trial-0").mkdir()
    name, url, where = damage(out, how)
    if message is None:
        assert opened(where, name, url)[1].study_name == study.study_name
        return
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        opened(where, name, url)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing touched


@pytest.mark.fast
@pytest.mark.parametrize("process, retried", [("gone", True), ("lock left free", True), ("alive", False)])
def test_a_trial_its_killed_sweep_left_running_is_failed_and_resumed(tmp_path, caplog, process, retried):
    out = tmp_path / "sweep"
    out.mkdir()
    storage, study = opened(out)
    trial = study.ask()
    trial.set_user_attr("run_dir", str(out / "trial-0"))
    holder = sweep_folder.ProcessLock(out)  # the sweep that ran it
    trial.set_user_attr(sweep_folder.PROCESS_ATTR, holder.name)
    if process == "gone":
        holder.release()
    elif process == "lock left free":  # SIGKILL: the file stays, its lock goes with the process
        os.close(holder.fd)
    args = SimpleNamespace(out=str(out), heartbeat=10)
    sweep = Sweep(args, {}, [], storage, study)
    sweep.retry_orphans()
    sweep.process.release()
    states = [(t.state.name, t.system_attrs.get("failed_trial")) for t in study.get_trials()]
    assert states == ([("FAIL", None), ("WAITING", 0)] if retried else [("RUNNING", None)])
    notices = [r.getMessage() for r in caplog.records if r.levelname == "NOTICE"]
    assert any(m.startswith("trial 0 was left RUNNING by a sweep that is gone; failed, and queued to resume in")
               for m in notices) == retried
    if process == "alive":
        holder.release()
