"""Every command's start-up is interrupt-safe: Ctrl-C is one line and exit 130, SIGTERM one line and
exit 143, never a traceback or a crash (a segfault, rc 139, after the line was the old failure), and no
lock or temporary file is left behind. The signal lands at several moments of start-up (as soon as
meshtrain has taken the signals, while the imports load, while JAX starts, while the program
compiles); a command that finished first exits 0."""
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, TINY

from meshtrain.core.cli import EXIT_INTERRUPTED, EXIT_TERMINATED, INTERRUPTED, TERMINATED

LINES = {signal.SIGINT: (EXIT_INTERRUPTED, INTERRUPTED), signal.SIGTERM: (EXIT_TERMINATED, TERMINATED)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run for the commands that read one."""
    out = tmp_path_factory.mktemp("signals") / "run"
    subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", TINY, "--out", str(out), "--steps", "2"],
                   cwd=ROOT, check=True, capture_output=True)
    return out


def signalled(argv: list[str], sig: int, after: float | str, timeout: float = 240, run: str = "-m") -> tuple[int, str]:
    """Start `python -m meshtrain.<argv>` (or `python -c` with `run="-c"`), send `sig` after `after`
    seconds or once its output shows the text `after`, and return (exit status, output: stdout and
    stderr as they interleave)."""
    proc = subprocess.Popen([sys.executable, run, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if isinstance(after, str) and after in line:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if isinstance(after, str):  # a process that ended without the text fails at once
            deadline = time.monotonic() + timeout
            while not seen.wait(0.1):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-2000:]
        else:  # seconds after meshtrain took the signals: not in Python's own start-up, before any of its code
            assert catches_sigterm(proc, timeout), "".join(lines)[-2000:]
            time.sleep(after)
        proc.send_signal(sig)
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    reader.join(timeout=10)
    return proc.returncode, "".join(lines)


def catches_sigterm(proc, timeout: float) -> bool:
    """Wait until the process has a handler for SIGTERM (its SigCgt mask in /proc; Python sets none
    of its own), or has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            for line in open(f"/proc/{proc.pid}/status"):
                if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
                    return True
        time.sleep(0.01)
    return proc.poll() is not None


def check(status: int, output: str, sig: int) -> None:
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    code, line = LINES[sig]
    assert status in (code, 0), (status, output[-3000:])  # 0: it had finished (or, training, saved)
    if status == code:
        assert output.strip().splitlines()[-1] == line, output[-3000:]


def left_behind(folder) -> list[str]:
    """Locks held or temporary files in a folder a command wrote to (an emptied run.lock is the
    released lock's file)."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if (p.name == "run.lock" and p.stat().st_size) or ".tmp" in p.name or "tmp" in p.suffix)


@pytest.mark.parametrize("sig,after", [(signal.SIGINT, 0.0), (signal.SIGTERM, 1.0), (signal.SIGINT, 3.0),
                                       (signal.SIGTERM, "M params, mesh"), (signal.SIGINT, "done: steps 1-3")],
                         ids=["int-imports", "term-jax", "int-startup", "term-compiled", "int-finished"])
def test_train_start_up(tmp_path, sig, after):
    out = tmp_path / "run"
    status, output = signalled(["meshtrain.train", "--config", TINY, "--out", str(out), "--steps", "3"], sig, after)
    check(status, output, sig)
    assert left_behind(out) == []
    if status != 0:  # stopped before training: nothing was written, the folder it made is gone
        assert not out.exists() or not [p for p in out.iterdir() if p.name != "run.lock"], list(out.iterdir())
    if after == "done: steps 1-3":  # in the teardown of a finished run: its status stands, 0
        assert status == 0 and list((out / "checkpoints").iterdir()), output[-3000:]


def test_train_signal_once_training_saves_and_exits_0(tmp_path):
    out = tmp_path / "run"
    status, output = signalled(["meshtrain.train", "--config", TINY, "--out", str(out), "--steps", "100000",
                                "--set", "train.log_every=1"], signal.SIGTERM, "step      2")
    assert status == 0 and "Traceback" not in output, output[-3000:]
    assert json.loads((out / "run.json").read_text())["starts"] and list((out / "checkpoints").iterdir())
    assert left_behind(out) == []


COMMANDS = {
    "generate": lambda run, tmp: ["meshtrain.generate", "--run", str(run), "--prompt", "hi", "--max-new-tokens", "4",
                                  "--tokenizer", "byte"],
    "eval": lambda run, tmp: ["meshtrain.eval", "--run", str(run), "--json", str(tmp / "eval.json")],
    "plan": lambda run, tmp: ["meshtrain.plan", "--config", TINY, "--devices", "8", "--mesh", "2x2x2"],
    "convert": lambda run, tmp: ["meshtrain.convert", "--to-hf", str(run), str(tmp / "hf")],
    "quantize": lambda run, tmp: ["meshtrain.convert", "--quantize", "int8", str(run), str(tmp / "int8")],
    "report": lambda run, tmp: ["meshtrain.report", str(run), "--out", str(tmp / "report.png")],
    "prepare": lambda run, tmp: ["meshtrain.data", "prepare", str(ROOT / "README.md"), "--out", str(tmp / "data"),
                                 "--tokenizer", "byte"],
    "train-tokenizer": lambda run, tmp: ["meshtrain.data", "train-tokenizer", str(ROOT / "README.md"), "--vocab-size",
                                         "300", "--out", str(tmp / "tokenizer.json")],
    "sweep": lambda run, tmp: sweep(tmp),
}


def sweep(tmp) -> list[str]:
    (tmp / "space.yaml").write_text("optim.lr: {type: float, low: 1.0e-4, high: 3.0, log: true}\n")
    return ["meshtrain.sweep", "--config", TINY, "--space", str(tmp / "space.yaml"), "--trials", "1", "--out",
            str(tmp / "sweep"), "--set", "train.steps=2000", "--set", "train.eval_every=100"]


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("sig,after", [(signal.SIGINT, 1.0), (signal.SIGTERM, 3.0)], ids=["int", "term"])
def test_every_command_start_up(run, tmp_path, name, sig, after):
    status, output = signalled(COMMANDS[name](run, tmp_path), sig, after)
    check(status, output, sig)
    assert left_behind(tmp_path) == [] and left_behind(run) == []


def test_a_sweep_stopped_while_its_trial_starts_retries_the_trial(tmp_path):
    """The sweep's SIGTERM reaches its trial's run during the run's start-up: the run exits 143 with
    nothing saved, and the trial is queued again, not failed."""
    status, output = signalled(sweep(tmp_path), signal.SIGTERM, "trial 0 started")
    assert status == 0 and "Traceback" not in output, output[-3000:]
    assert "retry of trial 0" in output and "stopped: rerun the same command" in output, output[-3000:]


SLOW_SHUTDOWN = """
import os
import time
from meshtrain.core import exits
exits.take_signals()
class SlowTeardown:  # as JAX's backends are on a loaded machine
    def __del__(self):  # in the interpreter's shutdown, after the exit handlers: the signal lands there
        os.write(1, b"finished\\n")
        time.sleep(3)
kept = SlowTeardown()
"""


def test_a_signal_in_the_shutdown_of_a_finished_command_leaves_its_status():
    """Python resets its signal handlers to the defaults as it shuts down: a SIGTERM landing then killed
    a command that had finished (status -15, the old failure); now it ends with the command's own 0."""
    status, output = signalled([SLOW_SHUTDOWN], signal.SIGTERM, "finished", run="-c")
    assert status == 0 and output.strip() == "finished", (status, output)


LIBRARY_SCRIPT = """
import signal, sys, time
from meshtrain.testing import tiny_config
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer
trainer = Trainer(tiny_config("model.num_layers=1", out=sys.argv[1]))
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "constructing a Trainer took SIGTERM"
trainer.fit(2, log=MetricsLog(primary=False))
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "fit kept its SIGTERM handler"
print("trained", flush=True)
time.sleep(60)
"""


def test_a_library_users_sigterm_outside_fit_ends_the_process(tmp_path):
    """A script that trains through the Python API owns its signals: meshtrain takes SIGTERM only while
    `fit` runs (to checkpoint) and gives it back, so a SIGTERM after `fit` ends the script as Python's
    default does (killed by the signal), never absorbed."""
    status, output = signalled([LIBRARY_SCRIPT, str(tmp_path / "run")], signal.SIGTERM, "trained", run="-c")
    assert status == -signal.SIGTERM, (status, output[-3000:])
