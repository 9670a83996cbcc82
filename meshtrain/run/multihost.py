"""Several processes (one per host) as one job: joining, agreeing, and failing in one line.

- `init_distributed` joins JAX's multi-controller runtime (explicit flags, or the SLURM / Open MPI /
  Kubernetes Job / JobSet environment, read by `resolve_launch`) in JAX's recoverable mode, so a
  dead peer is reported to the others instead of aborting each of them with a C++ stack trace; a
  watcher thread then ends this process with one `error:` line naming the lost process, once the
  coordination service has missed its heartbeats for `heartbeat_timeout_s` (exit code 3). The
  join itself says it waits, yields to Ctrl-C and SIGTERM, and ends at `init_timeout_s` with one
  line from where this process stands (core/waits.py: JAX's own bound aborts with a stack trace).
- Decisions that must be the same everywhere (save now, stop now) are agreed: process 0's clock
  decides saves by time (`agree_with_process_0`); a SIGTERM that reaches any process stops all of
  them at the same step (`preemption_reached`, JAX's preemption sync point).
- On CPU the cross-process collectives go through Gloo, which prints connection lines on stdout for
  every communicator it opens; those lines are dropped.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace

from meshtrain.core import console, exits, waits
from meshtrain.core.console import log
from meshtrain.core.errors import UserError

EXIT_PEER_LOST = 3
JAX_ABORT_AFTER_S = 60  # JAX's join timeout is --init-timeout plus this: ours ends the wait first
RESUME_HINT = "rerun the same command on every host to resume from the latest checkpoint"
LOST_COORDINATOR = f"lost the coordinator, process 0 (the JAX distributed service stopped answering); {RESUME_HINT}"
_run_over = threading.Event()  # set when this process is done: a peer that finished first is not lost


@dataclass(frozen=True)
class Launch:
    """One process's place in a multi-process job, as `resolve_launch` reads it."""

    launcher: str  # "flags", "SLURM", "Open MPI", "Kubernetes Job", "JobSet", "JAX" (its own detection)
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int | None  # None: JAX's detection says (a Cloud TPU pod)
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None  # None: every accelerator this process sees


K8S_PORT = 55527  # JAX's port for Kubernetes (jax/_src/clusters/k8s_cluster.py)


def resolve_launch(env=None, coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None) -> Launch | None:
    """Where this process stands in its job, from the flags or else its launcher's environment;
    None for a single process. Read here, not by `jax.distributed.initialize`'s own detection,
    which misses an Indexed Job without the `kubernetes` package and API rights, JobSet's
    variables and Open MPI 5, and under SLURM restricts every task to one GPU (its SLURM_LOCALID),
    even the only task of an 8-GPU node. Launchers, first found first:

    - flags: --coordinator (or JAX_COORDINATOR_ADDRESS) with --num-processes and --process-id;
      JAX_COORDINATOR_ADDRESS alone leaves the count and id to JAX's detection (Cloud TPU);
    - SLURM (srun): SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_PROCID, SLURM_LOCALID,
      SLURM_STEP_NODELIST (its first host is the coordinator), SLURM_STEP_TASKS_PER_NODE,
      SLURM_GPUS_ON_NODE, SLURM_JOB_ID (the port, as JAX picks it);
    - Open MPI (mpirun): OMPI_COMM_WORLD_SIZE, _RANK, _LOCAL_RANK, _LOCAL_SIZE, and the
      launcher's host in OMPI_MCA_orte_hnp_uri (Open MPI 4; else JAX_COORDINATOR_ADDRESS);
    - Kubernetes, an Indexed Job: JOB_COMPLETION_INDEX, HOSTNAME (`<job>-<index>`), and from the
      manifest MESHTRAIN_NUM_PROCESSES and MESHTRAIN_SERVICE (the headless Service, the pods'
      `subdomain`): the coordinator is `<job>-0.<service>`;
    - a JobSet: JOBSET_NAME, REPLICATED_JOB_NAME, JOB_INDEX (downward API) and
      JOB_COMPLETION_INDEX, MESHTRAIN_NUM_PROCESSES, MESHTRAIN_PODS_PER_JOB: the process id is
      JOB_INDEX * pods per job + JOB_COMPLETION_INDEX, the coordinator
      `<jobset>-<replicated job>-0-0.<subdomain>` (MESHTRAIN_SERVICE, default the JobSet's name).

    JAX_COORDINATOR_ADDRESS replaces the coordinator found, JAX_COORDINATOR_PORT its port, as
    they do for JAX. A variable a launcher needs and lacks is one UserError naming it."""
    env = os.environ if env is None else env
    address = coordinator if coordinator is not None else env.get("JAX_COORDINATOR_ADDRESS")
    if coordinator is not None or num_processes is not None or process_id is not None:
        launch = _from_flags(address, num_processes, process_id, "--coordinator" if coordinator is not None
                             else "JAX_COORDINATOR_ADDRESS")
    elif _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") > 1:
        launch = _slurm(env)
    elif _count(env, "OMPI_COMM_WORLD_SIZE") > 1:
        launch = _open_mpi(env)
    elif "JOB_COMPLETION_INDEX" in env:
        launch = _jobset(env) if "JOBSET_NAME" in env else _indexed_job(env)
    elif address:  # JAX's own detection finds the count and id (a Cloud TPU pod's metadata)
        return Launch("JAX", check_address(address, "JAX_COORDINATOR_ADDRESS"), None, None)
    else:
        return None
    if launch is None:
        return None
    if launch.launcher != "flags":  # (the flags' address is checked as they are read)
        named = "JAX_COORDINATOR_ADDRESS" if address else launch.launcher
        if address:
            launch = replace(launch, coordinator=address)
        elif env.get("JAX_COORDINATOR_PORT"):
            named = f"{launch.launcher} with JAX_COORDINATOR_PORT"
            host = launch.coordinator.rsplit(":", 1)[0]
            launch = replace(launch, coordinator=f"{host}:{env['JAX_COORDINATOR_PORT']}")
        check_address(launch.coordinator, named)
    if not 0 <= launch.process_id < launch.num_processes:
        raise UserError(f"{launch.launcher}: process id {launch.process_id} is not one of the {launch.num_processes} "
                        f"processes (0 to {launch.num_processes - 1}); check the launcher's process count")
    return launch


def _from_flags(address, num_processes, process_id, named) -> Launch:
    if address is None or num_processes is None or process_id is None:
        raise UserError("--coordinator (or JAX_COORDINATOR_ADDRESS), --num-processes and --process-id go together: "
                        "pass all three, or none under SLURM, Open MPI or Kubernetes")
    if not 0 <= process_id < num_processes:
        raise UserError(f"--process-id {process_id} is not one of the {num_processes} processes; give each "
                        f"process its own id from 0 to {num_processes - 1}")
    return Launch("flags", check_address(address, named), num_processes, process_id)


def check_address(address: str, named: str) -> str:
    """`address` if it is host:port (a port from 1 to 65535), else one UserError naming `named`: JAX
    hands a malformed one to gRPC, which retries it until --init-timeout, then aborts."""
    host, colon, port = address.rpartition(":")
    if not colon or not host.strip("[]") or not re.fullmatch("[0-9]{1,5}", port) or not 0 < int(port) < 65536 or \
            any(c.isspace() for c in address):
        raise UserError(f"{named} {address!r} is not host:port: give a host name or address and a port from 1 to "
                        f"65535 (10.0.0.1:1234, node-0:1234, [fd00::1]:1234)")
    return address


def _need(env, name: str, launcher: str, fix: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise UserError(f"{launcher}: {name} is not set; {fix}")
    return value


def _int(env, name: str, launcher: str, fix: str) -> int:
    value = _need(env, name, launcher, fix)
    if not value.isdigit():
        raise UserError(f"{launcher}: {name}={value} is not a count or index; {fix}")
    return int(value)


def _count(env, *names: str) -> int:
    value = next((env[n] for n in names if env.get(n)), "1")
    return int(value) if value.isdigit() else 1


SRUN = "start each task with srun inside the sbatch script (examples/slurm/train.sbatch)"


def _slurm(env) -> Launch:
    """SLURM's variables for a task that srun started (srun(1), 'OUTPUT ENVIRONMENT VARIABLES')."""
    launcher = "SLURM"
    num = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS", launcher, SRUN)
    nodes = _need(env, "SLURM_STEP_NODELIST", launcher,
                  f"SLURM_NTASKS={num} but this process was not started by srun: {SRUN}")
    pid = _int(env, "SLURM_PROCID", launcher, SRUN)
    local = _int(env, "SLURM_LOCALID", launcher, SRUN)
    job = _int(env, "SLURM_JOB_ID", launcher, SRUN)
    tasks_here = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""),
                                int(env.get("SLURM_NODEID", "0")))
    gpus = _gpu_count(env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE"))
    # --gpus-per-task: srun gave each task its own GPUs (CUDA_VISIBLE_DEVICES): it drives all it sees
    devices = None if "SLURM_GPUS_PER_TASK" in env else \
        _local_devices(local, tasks_here, gpus, launcher, "--gpus-per-node", "--ntasks-per-node")
    port = job % 2**12 + (65535 - 2**12 + 1)  # JAX's choice (slurm_cluster.py): the same on every task
    return Launch(launcher, f"{first_host(nodes)}:{port}", num, pid, devices)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: 'gpu[003-010,012],cpu1' -> 'gpu003' (each bracket's first)."""
    host, depth = "", 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        host += ch
    while "[" in host:
        head, rest = host.split("[", 1)
        ranges, tail = rest.split("]", 1)
        host = head + ranges.split(",")[0].split("-")[0] + tail
    return host


def _tasks_on_node(spec: str, node: int) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE ('4(x2),3' = 4 on each of the first 2 nodes, 3 on the third)."""
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[node] if node < len(counts) else None


def _gpu_count(text: str | None) -> int | None:
    """'8' or 'h100:8' (SLURM_GPUS_PER_NODE may name the type) -> 8."""
    tail = (text or "").rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _local_devices(local: int, tasks: int | None, gpus: int | None, launcher: str, gpu_option: str,
                   task_option: str) -> tuple[int, ...] | None:
    """The accelerators of the `local`-th of `tasks` processes on a node with `gpus` of them: all
    for one process per node; else an equal consecutive share (one each when `gpus` is unknown)."""
    if not tasks or tasks == 1:
        return None
    if gpus is None:
        return (local,)
    if gpus % tasks:
        raise UserError(f"{launcher}: {gpus} GPUs on this node do not split evenly over its {tasks} tasks; make "
                        f"{gpu_option} a multiple of {task_option}")
    share = gpus // tasks
    return tuple(range(local * share, (local + 1) * share))


def _open_mpi(env) -> Launch:
    launcher, fix = "Open MPI", "start meshtrain with mpirun"
    num = _int(env, "OMPI_COMM_WORLD_SIZE", launcher, fix)
    pid = _int(env, "OMPI_COMM_WORLD_RANK", launcher, fix)
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", launcher, fix)
    tasks = _count(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")  # '1531576320.0;tcp://10.96.0.1,10.148.0.1:34911'
    host = re.search(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)", uri)
    if host is None and not env.get("JAX_COORDINATOR_ADDRESS"):
        raise UserError(f"{launcher}: OMPI_MCA_orte_hnp_uri is not set (Open MPI 4's mpirun sets it; Open MPI 5 does "
                        f"not); export JAX_COORDINATOR_ADDRESS=<first host>:<port> to every process "
                        f"(mpirun -x JAX_COORDINATOR_ADDRESS)")
    port = int(uri.split(".", 1)[0]) // 2**12 % 2**12 + (65535 - 2**12 + 1) if host else 0  # JAX's choice
    ipv4, ipv6 = host.groups() if host else (None, None)
    address = f"{ipv4 or f'[{ipv6}]'}:{port}" if host else env["JAX_COORDINATOR_ADDRESS"]
    return Launch(launcher, address, num, pid, _local_devices(local, tasks, None, launcher, "", ""))


K8S_FIX = "set it in the pod template's env (examples/kubernetes/)"


def _indexed_job(env) -> Launch | None:
    launcher = "Kubernetes Job"
    num = _int(env, "MESHTRAIN_NUM_PROCESSES", launcher, K8S_FIX + ": the Job's parallelism")
    if num == 1:
        return None
    index = _int(env, "JOB_COMPLETION_INDEX", launcher, "use completionMode: Indexed")
    service = _need(env, "MESHTRAIN_SERVICE", launcher, K8S_FIX + ": the headless Service named in subdomain")
    hostname = _need(env, "HOSTNAME", launcher, "Kubernetes names an Indexed Job's pods <job>-<index>")
    job, _, own = hostname.rpartition("-")
    if own != str(index) or not job:
        raise UserError(f"{launcher}: HOSTNAME={hostname} is not <job name>-{index}; leave the pod's hostname "
                        f"to Kubernetes (an Indexed Job names pods <job>-<index>)")
    return Launch(launcher, f"{job}-0.{service}:{K8S_PORT}", num, index)


def _jobset(env) -> Launch | None:
    launcher = "JobSet"
    num = _int(env, "MESHTRAIN_NUM_PROCESSES", launcher, K8S_FIX + ": replicas x parallelism")
    if num == 1:
        return None
    per_job = _int(env, "MESHTRAIN_PODS_PER_JOB", launcher, K8S_FIX + ": the replicated job's parallelism")
    annotation = "from metadata.annotations['jobset.sigs.k8s.io/{}'] (downward API, examples/kubernetes/jobset.yaml)"
    name = _need(env, "JOBSET_NAME", launcher, "set it " + annotation.format("jobset-name"))
    replicated = _need(env, "REPLICATED_JOB_NAME", launcher, "set it " + annotation.format("replicatedjob-name"))
    job = _int(env, "JOB_INDEX", launcher, "set it " + annotation.format("job-index"))
    pod = _int(env, "JOB_COMPLETION_INDEX", launcher, "JobSet's Jobs are Indexed")
    service = env.get("MESHTRAIN_SERVICE") or name  # JobSet's headless Service: spec.network.subdomain or its name
    return Launch(launcher, f"{name}-{replicated}-0-0.{service}:{K8S_PORT}", num, job * per_job + pod)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, heartbeat_timeout_s: int = 100,
                     init_timeout_s: int = 300) -> Launch | None:
    """Join the job (`resolve_launch`); a no-op for a single process. `init_timeout_s` bounds the
    wait for all processes to join (a library caller that gets the error or a Ctrl-C should end the
    process: JAX cannot cancel the join, and aborts the process 60 s later); `heartbeat_timeout_s` how
    long a dead peer goes unnoticed."""
    import jax

    launch = resolve_launch(None, coordinator, num_processes, process_id)
    if launch is None:
        return None
    from jax._src import distributed  # the client has no public handle

    if distributed.global_state.client is not None:  # JAX would raise "should only be called once"
        raise UserError("this process has already joined a multi-host job, or a join it gave up on is still "
                        "under way (JAX cannot cancel one, and aborts the process at its own bound): run the job "
                        "again in a new process")
    # On CPU the cross-process collectives go through gloo (a real multi-host test on one machine).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:  # a dead peer is reported to the survivors rather than aborting them (the watcher exits)
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # a JAX without the option keeps its own fatal exit
        pass
    _filter_output()
    devices = list(launch.local_device_ids) if launch.local_device_ids is not None else None
    # All given: JAX's own detection ("deactivate") must not restrict the devices again.
    detection = None if launch.launcher == "JAX" else "deactivate"
    # JAX's own bound is later than ours: at it JAX aborts the process (a C++ stack trace, exit 134).
    join = lambda: jax.distributed.initialize(  # noqa: E731
        launch.coordinator, launch.num_processes, launch.process_id, devices, cluster_detection_method=detection,
        initialization_timeout=init_timeout_s + JAX_ABORT_AFTER_S, heartbeat_timeout_seconds=heartbeat_timeout_s)
    if launch.process_id is not None:  # only process 0 says it is waiting, as it logs the run
        console.set_process(launch.process_id)
    log.info(f"waiting for {_meeting(launch)}: at most {init_timeout_s} s (--init-timeout)")
    try:
        waits.interruptible(join, _meeting(launch), deadline_s=init_timeout_s,
                            timed_out=lambda: _not_met(launch, init_timeout_s))
    except UserError as e:
        exits.fail_now(f"error: {e}")  # a command: before the runtime's teardown prints after the line
        raise
    console.set_process(jax.process_index())  # from here on only process 0's notices reach the console
    _watch_peers(heartbeat_timeout_s)
    log.info(f"multi-host: {jax.process_count()} processes ({launch.launcher}), coordinator {launch.coordinator}, "
             f"{jax.device_count()} devices")
    return launch


def _meeting(launch: Launch) -> str:
    who = "all processes" if launch.num_processes is None else f"all {launch.num_processes} processes"
    me = "" if launch.process_id is None else f", this is process {launch.process_id}"
    return f"{who} of the job to join at the coordinator {launch.coordinator} ({launch.launcher}{me})"


def _not_met(launch: Launch, init_timeout_s: int) -> UserError:
    """The one line for a job that did not meet within --init-timeout, from where this process stands."""
    if launch.process_id is None:  # JAX's own detection: where this process stands is not known here
        why = ("not every process reached the coordinator: start all of them, and check that each host "
               "reaches that address and port")
    elif launch.process_id == 0:
        why = ("not every other process joined this one (the coordinator): start all of them, each with the "
               "same coordinator address and process count and its own process id")
    else:
        why = ("process 0 (the coordinator) did not answer there: start it, check that this host reaches that "
               "address and port, and that every process names the same one")
    return UserError(f"the job did not meet within --init-timeout {init_timeout_s} s: {why}; or raise "
                     f"--init-timeout (multi-host: {launch.launcher}, coordinator {launch.coordinator})")


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
                lost, coordinator_gone = everyone - _live_processes(), False
            except Exception:  # noqa: BLE001 - the coordinator (process 0) itself is gone
                lost, coordinator_gone = {0}, True
            if lost and not _run_over.wait(2.0):  # a peer that just finished normally is not lost
                exit_peer_lost(sorted(lost), heartbeat_timeout_s, coordinator_gone)

    threading.Thread(target=watch, name="meshtrain-peer-watch", daemon=True).start()


def exit_peer_lost(lost: list[int], heartbeat_timeout_s: int, coordinator_gone: bool = False) -> None:
    """The one line for a lost peer, then the exit. `coordinator_gone`: the service itself stopped
    answering, said as JAX's own fatal abort is (`_filter_fd`), whichever of the two sees it first."""
    import jax

    which = ", ".join(map(str, lost))
    log.error(LOST_COORDINATOR if coordinator_gone else f"process {which} of {jax.process_count()} stopped "
              f"responding (no heartbeat for {heartbeat_timeout_s} s); {RESUME_HINT}")
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

    meet = lambda: distributed.global_state.client.wait_at_barrier("meshtrain-run-finished", timeout_s * 1000)  # noqa: E731
    waits.interruptible(meet, f"all {jax.process_count()} processes to finish the run")
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
    # Gloo's threads interleave the pieces of "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of
    # connected peer ranks is : 1": a line holds some of its text pieces (`drop` names each), or only its
    # counts, or nothing. With a drop list, lines of nothing but digits are dropped on both streams.
    if not any(f in line for f in drop) and not (drop and (not line.strip() or line.strip().isdigit())):
        out.write(line); out.flush()
"""


# What marks a piece of Gloo's connection line, "[Gloo] Rank 1 is connected to 1 peer ranks. Expected
# number of connected peer ranks is : 1" (its counts aside).
GLOO_PIECES = ("[Gloo]", "is connected to", "peer ranks")


def _filter_fd(fd: int, drop: tuple[str, ...], fatal: str = "", message: str = "") -> None:
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
    """Gloo's connection lines (CPU collectives; its threads interleave them: match any fragment, and
    the bare counts the interleaving leaves) leave stdout; JAX's fatal abort when the coordinator is
    lost becomes one `error:` line on stderr."""
    _filter_fd(1, GLOO_PIECES)
    _filter_fd(2, ("Using experimental recoverable task feature",),
               fatal="Terminating process because the JAX distributed service detected fatal errors",
               message=f"error: {LOST_COORDINATOR}")


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
