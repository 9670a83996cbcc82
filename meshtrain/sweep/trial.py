"""One trial's run: the `python -m meshtrain.train` process it starts once no earlier attempt holds
its folder, the eval losses it reads from metrics.jsonl as the run trains (reported to the pruner; a
pruned run gets SIGTERM and checkpoints), and the error line of a failed run."""
from __future__ import annotations

import fcntl
import functools
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.core import jsonl
from meshtrain.core.console import log
from meshtrain.core.errors import UserError
from meshtrain.run.multihost import die_with_parent, last_error
from meshtrain.sweep.devices import Slot


@dataclass
class TrialRun:
    trial: object  # optuna.Trial
    run_dir: Path
    steps: int
    command: list
    slot: Slot
    lock: int | None = None
    proc: subprocess.Popen | None = None
    reported: set = field(default_factory=set)
    last: tuple | None = None  # (step, eval_loss) of the newest eval record
    step: int = 0  # the newest record's step
    pruned_at: int | None = None
    offset: int = 0  # metrics.jsonl read up to here (whole lines)
    lines: int = 0
    inode: int | None = None
    error: str | None = None  # its metrics.jsonl is damaged: the trial fails with this
    err_from: int = 0
    beat: float = 0.0  # when its heartbeat was last recorded
    taken: bool = False  # another sweep process failed it as stale and retries it: report nothing more

    @property
    def number(self) -> int:
        return self.trial.number

    def logs(self, suffix: str) -> Path:
        return self.run_dir.parent / "logs" / f"trial-{self.number}.{suffix}"

    def try_start(self) -> bool:
        """Start the run once no earlier attempt holds its folder's lock (a run of a killed sweep
        saving its checkpoint); False while it waits."""
        if self.lock is None:
            self.run_dir.parent.mkdir(parents=True, exist_ok=True)
            self.lock = os.open(self.run_dir.parent / f".{self.run_dir.name}.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.logs("out").parent.mkdir(exist_ok=True)
        with open(self.logs("out"), "a") as out, open(self.logs("err"), "a") as err:
            self.err_from = err.tell()
            self.proc = subprocess.Popen(
                self.command, env={**os.environ, **self.slot.env}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=err, start_new_session=True, pass_fds=(self.lock,),
                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        return True

    def read_evals(self) -> list[tuple[int, float]]:
        """New eval_loss records of metrics.jsonl (read incrementally; a resume rewrites the file)."""
        path = self.run_dir / "metrics.jsonl"
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:
            self.inode, self.offset, self.lines = st.st_ino, 0, 0
        with open(path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a record still being written is read next time
        records, _ = jsonl.parse(whole, path, self.lines + 1, tail_may_be_torn=False)
        self.offset, self.lines = self.offset + len(whole), self.lines + whole.count(b"\n")
        evals = []
        for record in records:
            self.step = record.get("step", self.step)
            if "eval_loss" in record:
                evals.append((int(record["step"]), float(record["eval_loss"])))
        return evals

    def watch(self) -> None:
        """Report new eval losses; SIGTERM the run when the pruner says so."""
        import optuna

        try:
            evals = self.read_evals()
        except UserError as e:  # a damaged line: the run's results cannot be trusted
            if self.error is None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            self.error = self.error or f"error: {e}"
            return
        for step, value in evals:
            self.last = (step, value)
            if step in self.reported or self.taken or self.pruned_at is not None:
                continue
            self.reported.add(step)
            try:
                self.trial.report(value, step)
            except optuna.exceptions.UpdateFinishedTrialError:
                self.taken = True  # the run goes on; its retry will find it finished and read the result
                continue
            if step < self.steps and self.trial.should_prune():
                self.pruned_at = step
                self.proc.send_signal(signal.SIGTERM)
                log.info(f"trial {self.number} pruned at step {step} (eval_loss {value:.4f}); stopping its run")

    def error_line(self) -> str:
        with open(self.logs("err"), errors="replace") as f:
            f.seek(self.err_from)
            return last_error(f.read().splitlines(), "(no output on stderr)")

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)  # the flock is gone once the run, which shares it, has exited too
            self.lock = None

