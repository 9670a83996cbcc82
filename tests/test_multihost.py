"""Real multi-host: 2 processes x 4 CPU devices on 127.0.0.1 (jax.distributed + gloo) train the same
run as 1 process with 8 devices; only process 0 logs (and no Gloo noise); the checkpoint they write
together restores in one process; when one process dies the other stops with one `error:` line
within the heartbeat bound; a damaged step is agreed on before renaming; a SIGTERM that reaches one
process stops both at the same step."""
import json
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT, TINY, tiny_config

from meshtrain.run.checkpoint import Checkpointer, abstract_like
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

LAYOUT = ("parallel.mesh=2x2x2", "parallel.zero=0")
OVERRIDES = (*LAYOUT, "train.steps=1000")
HEARTBEAT_S, EXIT_BOUND_S = 10, 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_text(path, text: str, seconds: float = 10) -> str:
    """`path`'s text once it holds `text`, or after `seconds`: a process's stderr goes through its filter
    process (meshtrain/run/multihost.py), which may write the last line after the process has ended."""
    deadline = time.time() + seconds
    while text not in path.read_text() and time.time() < deadline:
        time.sleep(0.1)
    return path.read_text()


def test_two_processes_match_one_then_survivor_exits_when_peer_dies(tmp_path):
    out, port = tmp_path / "run", free_port()
    sets = [arg for o in OVERRIDES for arg in ("--set", o)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "meshtrain.train", "--config", TINY, "--devices", "4", *sets, "--out", str(out),
         "--set", "checkpoint.every=5", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), "--heartbeat-timeout", str(HEARTBEAT_S)],
        cwd=ROOT, stdout=open(tmp_path / f"p{i}.out", "w"), stderr=open(tmp_path / f"p{i}.err", "w"))
        for i in range(2)]
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "5").is_dir() and time.time() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()[-3000:]
            time.sleep(0.2)
        assert (out / "checkpoints" / "5").is_dir()
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs[0].wait(timeout=EXIT_BOUND_S + 60)
        survivor_exit_s = time.time() - killed_at
    finally:
        for p in procs:
            p.kill()
    print(f"survivor exited {survivor_exit_s:.1f}s after its peer was killed (heartbeat timeout {HEARTBEAT_S}s)")
    assert procs[0].returncode == 3 and survivor_exit_s < EXIT_BOUND_S
    err0 = wait_for_text(tmp_path / "p0.err", "stopped responding")
    assert err0.strip().splitlines()[-1] == (
        f"error: process 1 of 2 stopped responding (no heartbeat for {HEARTBEAT_S} s); rerun the same command on "
        f"every host to resume from the latest checkpoint")
    assert "stack trace" not in err0 and "Traceback" not in err0

    # Only process 0 logs, once per step; its losses are the 1-process 8-device run's. No Gloo lines.
    assert "step      1  loss" in (tmp_path / "p0.out").read_text()
    assert (tmp_path / "p1.out").read_text() == ""
    assert "Gloo" not in (tmp_path / "p0.out").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)) and steps[:5] == [1, 2, 3, 4, 5]
    two_process = [r["loss"] for r in records if "loss" in r][:5]
    one_process = Trainer(tiny_config(*OVERRIDES))
    history = one_process.fit(5, log=MetricsLog("/tmp/meshtrain-tests", primary=False))
    np.testing.assert_allclose(two_process, [r["loss"] for r in history if "loss" in r], rtol=1e-6)

    # The checkpoint both processes wrote restores in one process, onto its mesh.
    state, meta = Checkpointer(out / "checkpoints", keep=10).restore(
        5, abstract_like(one_process.program.abstract_state, one_process.program.state_shardings))
    assert meta["devices"] == 8 and int(state["step"]) == 5
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])),
                    jax.tree.leaves(jax.device_get(one_process.state["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# Process 1 alone fails to decode its part of step 4 (as a bad sector under its shard would make it).
READ_FAILS_ON_THIS_PROCESS = """
import sys
import orbax.checkpoint as ocp
real_restore = ocp.PyTreeCheckpointHandler.restore
def restore(self, directory, args=None):
    if directory.parent.name == "4":
        raise ValueError("injected: cannot decode this process's shard")
    return real_restore(self, directory, args=args)
ocp.PyTreeCheckpointHandler.restore = restore
from meshtrain.train import main
sys.exit(main(sys.argv[1:]))
"""


def launch(tmp_path, out, port, *args, script=("-m", "meshtrain.train"), scripts=None, name="p"):
    """Start process 0 and 1 of a 2-process run; `scripts` may give each its own entry point."""
    return [subprocess.Popen(
        [sys.executable, *(scripts[i] if scripts else script), "--config", TINY, "--devices", "4", "--out", str(out),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), *args],
        cwd=ROOT, stdout=open(tmp_path / f"{name}{i}.out", "w"), stderr=open(tmp_path / f"{name}{i}.err", "w"))
        for i in range(2)]


def test_processes_agree_on_a_damaged_checkpoint_before_renaming(tmp_path):
    out = tmp_path / "run"
    first = Trainer(tiny_config(*LAYOUT, "train.steps=4", "checkpoint.every=2", out=str(out)))
    first.fit(log=MetricsLog("/tmp/meshtrain-tests", primary=False))
    assert first.checkpointer.steps() == [4, 2]

    sets = [arg for o in LAYOUT for arg in ("--set", o)]
    procs = launch(tmp_path, out, free_port(), *sets, "--steps", "1000", "--set", "checkpoint.every=2",
                   scripts=[("-m", "meshtrain.train"), ("-c", READ_FAILS_ON_THIS_PROCESS)])
    try:
        deadline = time.time() + 300
        while "step      5" not in (tmp_path / "p0.out").read_text() and time.time() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()[-3000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)  # a preemption notice that reaches one host only
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    err0, out0 = (tmp_path / "p0.err").read_text(), (tmp_path / "p0.out").read_text()
    assert codes == [0, 0], err0[-3000:] + (tmp_path / "p1.err").read_text()[-3000:]
    # Process 0 read step 4 fine, but both set it aside and resumed from step 2.
    assert (f"warning: checkpoint {out / 'checkpoints' / '4'} is damaged (another process could not read "
            f"its part of it); moved to {out / 'checkpoints' / '4.damaged'}") in err0
    assert "resumed from step 2" in out0
    # Both stopped at the step they agreed on, and saved it together.
    stopped = int(out0.split("preempted at step ")[1].split(":")[0])
    assert stopped >= 5 and (out / "checkpoints" / str(stopped)).is_dir()
    assert (out / "checkpoints" / "4.damaged").is_dir()


def test_losing_the_coordinator_is_one_line(tmp_path):
    out = tmp_path / "run"
    sets = [arg for o in OVERRIDES for arg in ("--set", o)]
    procs = launch(tmp_path, out, free_port(), *sets)
    try:
        deadline = time.time() + 300
        while "step      2" not in (tmp_path / "p0.out").read_text() and time.time() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "p1.err").read_text()[-3000:]
            time.sleep(0.2)
        procs[0].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=120) != 0
    finally:
        for p in procs:
            p.kill()
    err1 = wait_for_text(tmp_path / "p1.err", "error: lost")
    assert err1.strip().splitlines()[-1] == (
        "error: lost the coordinator, process 0 (the JAX distributed service stopped answering); rerun the same "
        "command on every host to resume from the latest checkpoint")
    assert "stack trace" not in err1


def test_the_watcher_that_sees_the_coordinator_gone_first_says_the_same_line():
    """Which of JAX's abort and meshtrain's peer watcher sees the service gone first is a race: the
    watcher's line is the abort's line too (exit 3 there)."""
    from meshtrain.run.multihost import EXIT_PEER_LOST, LOST_COORDINATOR

    done = subprocess.run([sys.executable, "-c", "from meshtrain.core.console import use_console; use_console(); "
                           "from meshtrain.run import multihost; multihost.exit_peer_lost([0], 10, True)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_PEER_LOST and done.stderr.strip().splitlines()[-1] == f"error: {LOST_COORDINATOR}"


def test_gloos_interleaved_connection_lines_leave_stdout():
    """Gloo threads announcing their connections at once: every piece is dropped (a bare count left
    on its own line, or a middle piece on another thread's line, included), the run's own lines
    pass in order."""
    from meshtrain.run.multihost import _FILTER, GLOO_PIECES

    gloo = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : "
    two = f"{gloo}{gloo}1\n1\n\n"  # two threads: the second's count lands on a line of its own
    three = " is connected to 1\n peer ranks. 1\n"  # a third's middle pieces end on others' lines
    stream = f"{two}step      1  loss 5.5\n 12 \n{three}error: 7 steps\n"
    done = subprocess.run([sys.executable, "-c", _FILTER, json.dumps(GLOO_PIECES), "", ""],
                          input=stream, capture_output=True, text=True, timeout=60)
    assert done.stdout == "step      1  loss 5.5\nerror: 7 steps\n"


def test_a_job_that_does_not_meet_ends_at_init_timeout_in_one_line(tmp_path):
    """Process 1 started alone: at --init-timeout it ends with one line naming the coordinator and the
    fix, exit 2 (JAX's own bound aborts with a C++ stack trace, exit 134, and blamed a lost peer)."""
    port, started = free_port(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", TINY, "--devices", "2", "--out",
                           str(tmp_path / "run"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                           "--process-id", "1", "--init-timeout", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: the job did not meet within --init-timeout 3 s: process 0 (the coordinator) did not answer there: "
        f"start it, check that this host reaches that address and port, and that every process names the same "
        f"one; or raise --init-timeout (multi-host: flags, coordinator 127.0.0.1:{port})")
    assert time.monotonic() - started < 60 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_the_job_meets_ends_at_once_in_one_line(tmp_path, sig):
    """Process 0 waiting for a process 1 that never comes (JAX's join holds the main thread in C++,
    where Python runs no signal handler: Ctrl-C waited out the whole --init-timeout)."""
    from test_signals import LINES, signalled

    argv = ["meshtrain.train", "--config", TINY, "--devices", "2", "--out", str(tmp_path / "run"), "--coordinator",
            f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "0", "--init-timeout", "300"]
    started = time.monotonic()
    status, output = signalled(argv, sig, "waiting for all 2 processes of the job", timeout=120)
    assert (status, output.strip().splitlines()[-1]) == LINES[sig], output[-3000:]
    assert time.monotonic() - started < 60
