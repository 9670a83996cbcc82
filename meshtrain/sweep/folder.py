"""A sweep folder (`--out` of python -m meshtrain.sweep) belongs to one Optuna study, and a study to
one folder: trial-<n>/ is trial n's run of that study, and nothing else may read or write it.

The pair is recorded on both sides when a sweep first claims the folder: <out>/sweep.json names the
study, its storage and a random id; the study holds the id and the folder as its user attribute
`meshtrain_folder`. A later sweep resumes only where both sides agree; a folder of another study, a
study of another folder, a study gone from (or recreated in) its database, and a folder holding
trials that no study claims are each a one-line error naming the way out. A study database that is
empty, not SQLite or damaged is an error too, never a silent fresh start.

Trials killed with their sweep: each sweep process holds a lock file <out>/.sweep-<id>.lock while it
lives and names it in the trials it runs (user attribute `sweep_process`); a RUNNING trial whose
process's lock is free is failed and queued for retry at once by the next sweep, with a notice
(those without one are left to the heartbeat, which fails them after 2 x --heartbeat).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import uuid
from pathlib import Path

from meshtrain.core import schema
from meshtrain.core.errors import UserError
from meshtrain.core.folders import replace_file

RECORD = "sweep.json"
RECORD_SCHEMA = {"study": str, "storage": str, "id": str}  # meshtrain/core/schema.py; written by `claim`
STUDY_ATTR = "meshtrain_folder"
PROCESS_ATTR = "sweep_process"
SQLITE_HEADER = b"SQLite format 3\x00"
NO_STUDY = ("--out {out} holds trial folders that no study claims (a sweep of an earlier meshtrain, or whose "
            "sweep.json was removed); pass a new --out")


def check_database(url: str, out: Path | None = None) -> None:
    """A SQLite study database must be a whole SQLite file with Optuna's tables, and be there if the
    sweep folder `out` records a study."""
    if not url.startswith("sqlite:///"):
        return
    path = Path(url.removeprefix("sqlite:///"))
    if not path.exists():
        if out is not None and (out / RECORD).exists():
            raise UserError(f"study database {path} is missing, but --out {out} holds the trials of its study; "
                            f"restore it, or pass a new --out")
        if out is not None and holds_trials(out):
            raise UserError(NO_STUDY.format(out=out))
        return
    fix = "move it away to start a new study, or restore it from a backup"
    with open(path, "rb") as f:
        header = f.read(len(SQLITE_HEADER))
    if not header:
        raise UserError(f"study database {path} is empty (a sweep killed while creating it?); {fix}")
    if header != SQLITE_HEADER:
        raise UserError(f"study database {path} is not an SQLite file (damaged, or another file); {fix}")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        raise UserError(f"study database {path} is damaged ({e}); {fix}") from None
    if verdict != "ok":
        raise UserError(f"study database {path} is damaged ({verdict}); {fix}")
    if "studies" not in tables:
        raise UserError(f"{path} is an SQLite file but no Optuna study database; pass another --storage or "
                        f"--out")


def holds_trials(out: Path) -> bool:
    return any(out.glob("trial-*")) or (out / "logs").exists() or (out / "best.json").exists()


def claim(out: Path, name: str, shown_storage: str, study_exists, load_study, create_study):
    """The study of folder `out`, once both sides agree it is theirs (see the module's doc);
    `load_study()` / `create_study()` open it. Serialised by a lock: several sweeps may start at once."""
    lock = os.open(out / ".sweep.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = (schema.read_json(out / RECORD, RECORD_SCHEMA, "restore it from a backup, or pass a new --out")
                  if (out / RECORD).exists() else None)
        study = load_study() if study_exists() else None
        owner = study.user_attrs.get(STUDY_ATTR) if study else None
        if record and (record["study"], record["storage"]) != (name, shown_storage):
            raise UserError(f"--out {out} holds the trials of study {record['study']} in {record['storage']}; "
                            f"pass a new --out for study {name}, or that --study and --storage to continue it")
        if record and (owner or {}).get("id") != record["id"]:
            raise UserError(f"--out {out} holds the trials of study {name}, which {shown_storage} "
                            f"{'holds no more' if study is None else 'holds as a new study'}; restore that "
                            f"database, or pass a new --out")
        if owner and owner["out"] != str(out):
            raise UserError(f"study {name} in {shown_storage} runs its trials in {owner['out']}; pass that --out, "
                            f"or a new --study")
        if not record and not owner and holds_trials(out):
            raise UserError(NO_STUDY.format(out=out))
        if record is None:
            study = study or create_study()
            owner = owner or {"id": uuid.uuid4().hex, "out": str(out)}
            study.set_user_attr(STUDY_ATTR, owner)
            replace_file(out / RECORD, json.dumps({"study": name, "storage": shown_storage, "id": owner["id"]},
                                                  indent=1) + "\n")
        return study
    finally:
        os.close(lock)


class ProcessLock:
    """This sweep process's lock file in `out`, held while it lives; `name` goes into its trials."""

    def __init__(self, out: Path):
        self.name = uuid.uuid4().hex[:12]
        self.path = out / f".sweep-{self.name}.lock"
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def process_gone(out: Path, name: str) -> bool:
    """True when the sweep process `name` no longer holds its lock in `out`."""
    try:
        fd = os.open(out / f".sweep-{name}.lock", os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    (out / f".sweep-{name}.lock").unlink(missing_ok=True)
    return True


def orphans(trials, out: Path) -> list:
    """RUNNING trials whose sweep process is gone."""
    return [t for t in trials if t.state.name == "RUNNING" and PROCESS_ATTR in t.user_attrs
            and process_gone(out, t.user_attrs[PROCESS_ATTR])]


def shown_path(path) -> str:
    """A path as the sweep prints it: relative to the working directory when under it."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel
