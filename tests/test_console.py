"""The one console (meshtrain/core/console.py): what the library says is `logging` under the `meshtrain`
logger; the commands' handler prints it as they always printed (info on stdout as it is, `notice:`,
`warning:`, `error:` on stderr), only on process 0, above a live progress bar while there is one; a
notebook quiets or redirects it with the standard calls."""
import io
import logging
import subprocess
import sys

import pytest
from conftest import ROOT

from meshtrain.core import console
from meshtrain.core.console import NOTICE, log, use_console
from meshtrain.run import loggers


@pytest.fixture
def said(capsys):
    """The console as a command has it; the `meshtrain` logger's level and the process index put back."""
    use_console()
    level = log.level
    capsys.readouterr()
    yield lambda: capsys.readouterr()
    log.setLevel(level)
    console.set_process(0)


def speak():
    log.info("resumed from step 3")
    log.log(NOTICE, "config key 'a' is now 'b'")
    log.warning("step 4: loss spike")
    log.error("process 1 stopped responding")


@pytest.mark.fast
def test_the_console_prints_as_the_commands_always_did(said):
    speak()
    out, err = said()
    assert out == "resumed from step 3\n"
    assert err == ("notice: config key 'a' is now 'b'\nwarning: step 4: loss spike\n"
                   "error: process 1 stopped responding\n")
    assert use_console() is use_console() and sum(isinstance(h, console.ConsoleHandler) for h in log.handlers) == 1


@pytest.mark.fast
def test_a_notebook_quiets_the_library_with_logging(said):
    logging.getLogger("meshtrain").setLevel(logging.WARNING)
    speak()
    out, err = said()
    assert out == "" and err == "warning: step 4: loss spike\nerror: process 1 stopped responding\n"


@pytest.mark.fast
def test_a_handler_of_ones_own_gets_the_records(said):
    records = []
    mine = logging.Handler()
    mine.emit = records.append
    log.addHandler(mine)
    try:
        speak()
    finally:
        log.removeHandler(mine)
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("INFO", "resumed from step 3"), ("NOTICE", "config key 'a' is now 'b'"),
        ("WARNING", "step 4: loss spike"), ("ERROR", "process 1 stopped responding")]


@pytest.mark.fast
def test_only_the_primary_process_prints_notices(said, caplog):
    console.set_process(1)
    assert not console.primary()
    speak()
    out, err = said()
    assert out == "" and err == "error: process 1 stopped responding\n"  # errors show on every process
    assert [r.levelname for r in caplog.records] == ["ERROR"]  # the others became debug records, not shown
    log.setLevel(logging.DEBUG)  # who asks for debug records sees them
    log.info("resumed from step 3")
    assert [r.levelname for r in caplog.records][-1] == "DEBUG"
    console.set_process(0)
    log.setLevel(logging.INFO)
    log.info("resumed from step 3")
    assert said()[0] == "resumed from step 3\n"


@pytest.mark.fast
def test_while_the_bar_is_live_the_console_writes_above_it(said):
    from rich.console import Console

    screen = io.StringIO()
    bar = loggers.ProgressBar(0, 10, console=Console(file=screen, force_terminal=True, width=200))
    speak()
    bar.write({"step": 5, "loss": 1.87, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_sec": 1000.0, "step_time_s": 0.01})
    bar.close()
    assert said() == ("", "")  # none past the bar
    shown = screen.getvalue()
    for line in ("resumed from step 3", "notice: config key 'a' is now 'b'", "warning: step 4: loss spike",
                 "error: process 1 stopped responding", "step      5  loss 1.8700"):
        assert line in shown, line
    assert shown.index("resumed from step 3") < shown.index("step      5  loss")
    log.info("done")
    assert said()[0] == "done\n"  # the bar gone: stdout again


def test_a_command_console_is_the_only_one():
    """A library that logs through the module-level functions configures the root logger
    (logging.basicConfig): the command's lines still show once, in its format."""
    script = ("import logging; from meshtrain.core.console import log, use_console; use_console(); "
              "logging.warning('a library speaks'); log.warning('step 4: loss spike'); log.info('resumed')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "resumed\n"
    assert done.stderr == "WARNING:root:a library speaks\nwarning: step 4: loss spike\n"


@pytest.mark.fast
def test_a_trainer_adds_its_console_only_where_logging_is_not_set_up(monkeypatch):
    """default_console (Trainer): none over a configured root logger; detach() gives the records back to it."""
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "propagate", True)
    monkeypatch.setitem(console._detached, "yes", False)
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    console.default_console()
    assert log.handlers == [] and log.propagate  # the user's root handler gets the records
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    console.default_console()
    assert [type(h) for h in log.handlers] == [console.ConsoleHandler] and not log.propagate
    console.detach()
    assert log.handlers == [] and log.propagate
    console.default_console()
    assert log.handlers == []  # detached for good
