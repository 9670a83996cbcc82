"""Several processes (one per host) as one job: joining, agreeing, and failing in one line.

- `init_distributed` joins JAX's multi-controller runtime (explicit flags, or SLURM / Open MPI /
  Kubernetes environment) in JAX's recoverable mode, so a dead peer is reported to the others
  instead of aborting each of them with a C++ stack trace; a watcher thread then ends this
  process with one `error:` line naming the lost process, once the coordination service has
  missed its heartbeats for `heartbeat_timeout_s` (exit code 3).
- Decisions that must be the same everywhere (save now, stop now) are agreed: process 0's clock
  decides saves by time (`agree_with_process_0`); a SIGTERM that reaches any process stops all of
  them at the same step (`preemption_reached`, JAX's preemption sync point).
- On CPU the cross-process collectives go through Gloo, which prints connection lines on stdout for
  every communicator it opens; those lines are dropped.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time

from meshtrain.core.errors import UserError

EXIT_PEER_LOST = 3
RESUME_HINT = "rerun the same command on every host to resume from the latest checkpoint"
_run_over = threading.Event()  # set when this process is done: a peer that finished first is not lost


def launched_by_cluster() -> bool:
    """True under a multi-process launcher that jax.distributed.initialize() detects itself."""
    env = os.environ
    return (int(env.get("SLURM_NTASKS", "1")) > 1
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
            or "JAX_COORDINATOR_ADDRESS" in env)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, heartbeat_timeout_s: int = 100,
                     init_timeout_s: int = 300) -> None:
    """Join the job; a no-op for a single process. `init_timeout_s` bounds the wait for all
    processes to join; `heartbeat_timeout_s` how long a dead peer goes unnoticed."""
    import jax

    explicit = coordinator is not None
    if not explicit and not launched_by_cluster():
        return
    if explicit and (num_processes is None or process_id is None):
        raise UserError("--coordinator needs --num-processes and --process-id too")
    if explicit and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id {process_id} is not one of the {num_processes} processes; give each "
                        f"process its own id from 0 to {num_processes - 1}")
    # On CPU the cross-process collectives go through gloo (a real multi-host test on one machine).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:  # a dead peer is reported to the survivors rather than aborting them (the watcher exits)
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # a JAX without the option keeps its own fatal exit
        pass
    _filter_output()
    timeouts = {"initialization_timeout": init_timeout_s, "heartbeat_timeout_seconds": heartbeat_timeout_s}
    if explicit:
        jax.distributed.initialize(coordinator, num_processes, process_id, **timeouts)
    else:
        jax.distributed.initialize(**timeouts)
    _watch_peers(heartbeat_timeout_s)


def _live_processes() -> set[int]:
    import jax
    from jax._src import distributed  # the client has no public handle; guarded by the caller

    return set(distributed.global_state.client.get_live_nodes(list(range(jax.process_count()))))


def _watch_peers(heartbeat_timeout_s: int) -> None:
    import jax

    everyone = set(range(jax.process_count()))

    def watch():
        while not _run_over.wait(1.0):
            try:
                lost = everyone - _live_processes()
            except Exception:  # noqa: BLE001 - the coordinator (process 0) itself is gone
                lost = {0}
            if lost and not _run_over.wait(2.0):  # a peer that just finished normally is not lost
                exit_peer_lost(sorted(lost), heartbeat_timeout_s)

    threading.Thread(target=watch, name="meshtrain-peer-watch", daemon=True).start()


def exit_peer_lost(lost: list[int], heartbeat_timeout_s: int) -> None:
    import jax

    which = ", ".join(map(str, lost))
    print(f"error: process {which} of {jax.process_count()} stopped responding (no heartbeat for "
          f"{heartbeat_timeout_s} s); {RESUME_HINT}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)  # no clean shutdown: it would wait for the lost process


def run_over() -> None:
    """This process has finished its work: peers exiting from now on are not lost."""
    _run_over.set()


def leave_together(timeout_s: int = 300) -> None:
    """After a run that ended normally on every process: leave the job in order. In recoverable mode
    JAX's own shutdown waits for no one, and process 0 hosts the coordination service, so a process
    0 that left first would make the others' shutdown fail (a fatal abort). All meet at a barrier,
    the others disconnect, then process 0 leaves."""
    import jax

    run_over()
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("meshtrain-run-finished", timeout_s * 1000)
    if jax.process_index() != 0:
        jax.distributed.shutdown()
        return
    deadline = time.monotonic() + timeout_s
    while _live_processes() != {0} and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_if_a_peer_died(error: BaseException, heartbeat_timeout_s: int) -> None:
    """A collective that failed on a closed connection (Gloo) means a peer may have died: give the
    watcher one heartbeat timeout to name it (it ends the process); any other error returns at once."""
    text = str(error)
    if _run_over.is_set() or not any(s in text for s in ("Connection closed", "Connection reset", "Gloo")):
        return
    _run_over.wait(heartbeat_timeout_s + 3.0)


def agree_with_process_0(flag: bool) -> bool:
    """Process 0's `flag` on every process (one tiny broadcast), so all take the same branch."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def preemption_reached(step: int) -> bool:
    """True on every process at the same step once any of them received SIGTERM (JAX's preemption
    sync point: the signal is noted by the runtime, not by a Python handler)."""
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


# A filter process between a file descriptor and where it wrote before: it forwards lines, drops
# those holding any of `drop`, and replaces JAX's fatal abort (a C++ stack trace) with one line.
# A process, not a thread, so that it still speaks after this one aborts.
_FILTER = r"""
import json, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)
drop = [f.encode() for f in json.loads(sys.argv[1])]
fatal, message = sys.argv[2].encode(), sys.argv[3].encode()
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    if fatal and fatal in line:
        out.write(message + b"\n"); out.flush()
        break  # the rest is the stack trace
    if not any(f in line for f in drop) and not (drop and not line.strip()):  # Gloo leaves bare newlines
        out.write(line); out.flush()
"""


def _filter_fd(fd: int, drop: tuple[str, ...], fatal: str = "", message: str = "") -> None:
    import atexit
    import subprocess

    (sys.stdout if fd == 1 else sys.stderr).flush()
    real = os.dup(fd)
    child = subprocess.Popen([sys.executable, "-c", _FILTER, json.dumps(drop), fatal, message],
                             stdin=subprocess.PIPE, stdout=real, stderr=subprocess.DEVNULL)
    os.dup2(child.stdin.fileno(), fd)
    child.stdin.close()

    def drain():  # at exit: end the pipe, and let the filter write everything before this process ends
        (sys.stdout if fd == 1 else sys.stderr).flush()
        os.dup2(real, fd)
        child.wait(timeout=10)

    atexit.register(drain)


def _filter_output() -> None:
    """Gloo's connection lines (CPU collectives; its threads interleave them: match any fragment)
    leave stdout; JAX's fatal abort when the coordinator is lost becomes one `error:` line on stderr."""
    _filter_fd(1, ("[Gloo]", "peer ranks"))
    _filter_fd(2, ("Using experimental recoverable task feature",),
               fatal="Terminating process because the JAX distributed service detected fatal errors",
               message=f"error: lost the coordinator, process 0 (the JAX distributed service stopped "
                       f"answering); {RESUME_HINT}")


# ---- meshtrain processes started by a launcher (meshtrain/sweep/, meshtrain/ray_launch.py) ----
def die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM (meshtrain checkpoints and exits) when the sweep dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the sweep died before prctl
            os.kill(os.getpid(), signal.SIGTERM)


def last_error(lines: list[str], empty: str) -> str:
    """Why a meshtrain process failed: its last `error:` line, else its last line, else `empty`."""
    lines = [line.strip() for line in lines if line.strip()]
    return ([line for line in lines if line.startswith("error:")] or lines or [empty])[-1]
