"""Cluster launch from the shipped files: examples/slurm/train.sbatch and examples/kubernetes/*.yaml
are parsed, each task's or pod's environment is built as SLURM / Kubernetes / JobSet set it, and
`resolve_launch` (what `init_distributed` hands to jax.distributed.initialize) must give every
process its own id, the same count and coordinator, and its share of the node's GPUs; a missing
variable is one UserError naming it. The files' meshtrain commands parse and load. Also: the
start-up messages (compile ticker on a short interval, step time after warm-up, ETA, run folder)."""
import math
import re
import shlex

import pytest
import yaml
from conftest import ROOT

from meshtrain.config.loader import UserError, load_config
from meshtrain.parallel.mesh import parse_mesh
from meshtrain.run import loggers
from meshtrain.run.multihost import K8S_PORT, Launch, first_host, resolve_launch
from meshtrain.train import overrides, parser

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
INDEXED_JOB = ROOT / "examples" / "kubernetes" / "indexed-job.yaml"
JOBSET = ROOT / "examples" / "kubernetes" / "jobset.yaml"
JOB_ID = 73519


# ---- SLURM ----
def sbatch(text: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The script's #SBATCH options, its exported variables, and the srun command's argv."""
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            for option in shlex.split(line.removeprefix("#SBATCH"), comments=True):
                key, _, value = option.lstrip("-").partition("=")
                options[key] = value
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", text, re.M))
    command = re.search(r"^srun .*?[^\\]$", text.replace("\\\n", " "), re.M | re.S)[0]
    for name, value in exports.items():
        command = command.replace(f'"${name}"', value)
    return options, exports, shlex.split(command)


def slurm_tasks(options: dict[str, str], exports: dict[str, str]):
    """Each task's environment as srun sets it (srun(1), OUTPUT ENVIRONMENT VARIABLES) for these
    #SBATCH options, with the script's exports."""
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    gpus = int(options["gpus-per-node"])
    nodelist = f"gpu[001-{nodes:03d}]" if nodes > 1 else "gpu001"
    layout = f"{per_node}(x{nodes})" if nodes > 1 else str(per_node)
    for node in range(nodes):
        for local in range(per_node):
            yield {**exports, "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NAME": options["job-name"],
                   "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist, "SLURM_NNODES": str(nodes),
                   "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_NTASKS": str(nodes * per_node),
                   "SLURM_STEP_NUM_TASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
                   "SLURM_TASKS_PER_NODE": layout, "SLURM_STEP_TASKS_PER_NODE": layout, "SLURM_STEP_ID": "0",
                   "SLURM_NODEID": str(node), "SLURM_PROCID": str(node * per_node + local),
                   "SLURM_LOCALID": str(local), "SLURM_GPUS_ON_NODE": str(gpus),
                   "SLURM_GPUS_PER_NODE": options["gpus-per-node"],
                   "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}


SLURM_PORT = JOB_ID % 4096 + 61440  # JAX's choice (jax/_src/clusters/slurm_cluster.py)


@pytest.mark.parametrize("layout", [{}, {"nodes": "2", "ntasks-per-node": "4"}],
                         ids=["as shipped", "2 nodes x 4 tasks"])
def test_sbatch_tasks_resolve_to_one_job(layout):
    options, exports, _ = sbatch(SBATCH.read_text())
    options |= layout
    nodes, per_node, gpus = int(options["nodes"]), int(options["ntasks-per-node"]), int(options["gpus-per-node"])
    launches = [resolve_launch(env) for env in slurm_tasks(options, exports)]
    assert [launch.process_id for launch in launches] == list(range(nodes * per_node))
    assert {(launch.launcher, launch.num_processes, launch.coordinator) for launch in launches} == {
        ("SLURM", nodes * per_node, f"gpu001:{SLURM_PORT}")}
    share = gpus // per_node
    expected = [None] if per_node == 1 else [tuple(range(i * share, (i + 1) * share)) for i in range(per_node)]
    assert [launch.local_device_ids for launch in launches] == expected * nodes
    # every GPU of the allocation driven by exactly one process
    assert sum(share if ids is None else len(ids) for ids in expected) * nodes == nodes * gpus


def test_sbatch_runs_a_command_that_loads_on_its_allocation():
    options, _, argv = sbatch(SBATCH.read_text())
    assert argv[:4] == ["srun", "--kill-on-bad-exit=1", "python", "-m"] and argv[4] == "meshtrain.train"
    args = parser().parse_args(argv[5:])
    cfg = load_config(str(ROOT / args.config), overrides(args))
    devices = int(options["nodes"]) * int(options["gpus-per-node"])
    assert math.prod(parse_mesh(cfg.parallel.mesh, devices).values()) == devices
    assert options["signal"].startswith("TERM@")  # a SIGTERM before the time limit: every task saves


def test_slurm_bound_gpus_and_missing_variables():
    options, exports, _ = sbatch(SBATCH.read_text())
    env = next(slurm_tasks(options | {"ntasks-per-node": "8"}, exports))
    assert resolve_launch(env).local_device_ids == (0,)
    assert resolve_launch({**env, "SLURM_GPUS_PER_TASK": "1"}).local_device_ids is None  # srun bound them
    assert resolve_launch({**env, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "gpu001:1234"
    with pytest.raises(UserError, match="6 GPUs on this node do not split evenly over its 8 tasks"):
        resolve_launch({**env, "SLURM_GPUS_ON_NODE": "6"})
    batch_step = {k: v for k, v in env.items() if "STEP" not in k}  # the script itself, outside srun
    with pytest.raises(UserError, match=r"^SLURM: SLURM_STEP_NODELIST is not set; SLURM_NTASKS=64 but this process "
                                        r"was not started by srun"):
        resolve_launch(batch_step)
    for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID"):
        with pytest.raises(UserError, match=f"^SLURM: {name} is not set; start each task with srun"):
            resolve_launch({k: v for k, v in env.items() if k != name})
    single = {**env, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}
    assert resolve_launch(single) is None


@pytest.mark.parametrize("nodelist, host", [("gpu[003-010,012],cpu1", "gpu003"), ("node7,node8", "node7"),
                                            ("rack1-n[08-09]-ib", "rack1-n08-ib"), ("solo", "solo")])
def test_first_host_of_a_slurm_host_list(nodelist, host):
    assert first_host(nodelist) == host


# ---- Kubernetes ----
def container_env(container: dict, annotations: dict[str, str]) -> dict[str, str]:
    """A container's env as the kubelet resolves it: values, and the downward API's annotations."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = annotations[re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)[1]]
    return env


def test_indexed_job_pods_resolve_through_the_headless_service():
    service, job = yaml.safe_load_all(INDEXED_JOB.read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"]) == ("Indexed", spec["parallelism"])
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}  # the label Jobs give pods
    name, n = job["metadata"]["name"], spec["parallelism"]
    launches = []
    for index in range(n):  # Kubernetes sets the index and names the pod <job>-<index>
        env = container_env(pod["containers"][0], {}) | {"JOB_COMPLETION_INDEX": str(index),
                                                         "HOSTNAME": f"{name}-{index}"}
        launches.append(resolve_launch(env))
    assert launches == [Launch("Kubernetes Job", f"{name}-0.{pod['subdomain']}:{K8S_PORT}", n, i) for i in range(n)]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8  # each pod: all its GPUs (None)
    for name_missing in ("MESHTRAIN_NUM_PROCESSES", "MESHTRAIN_SERVICE", "HOSTNAME"):
        with pytest.raises(UserError, match=f"^Kubernetes Job: {name_missing} is not set; "):
            resolve_launch({k: v for k, v in env.items() if k != name_missing})
    with pytest.raises(UserError, match="HOSTNAME=worker is not <job name>-7"):
        resolve_launch({**env, "HOSTNAME": "worker"})


def test_jobset_pods_resolve_to_one_job():
    jobset = yaml.safe_load(JOBSET.read_text())
    name = jobset["metadata"]["name"]
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    launches = {}
    for j in range(replicated["replicas"]):
        for p in range(job["parallelism"]):  # the annotations JobSet puts on each pod
            annotations = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name":
                           replicated["name"], "jobset.sigs.k8s.io/job-index": str(j)}
            env = container_env(container, annotations) | {"JOB_COMPLETION_INDEX": str(p),
                                                           "HOSTNAME": f"{name}-{replicated['name']}-{j}-{p}"}
            launches[(j, p)] = resolve_launch(env)
    n = replicated["replicas"] * job["parallelism"]
    assert sorted(launch.process_id for launch in launches.values()) == list(range(n))
    # the coordinator is pod 0 of Job 0 under JobSet's headless Service (named after the JobSet)
    coordinator = f"{name}-{replicated['name']}-0-0.{name}:{K8S_PORT}"
    assert {(launch.launcher, launch.num_processes, launch.coordinator) for launch in launches.values()} == {
        ("JobSet", n, coordinator)}
    assert launches[(0, 0)].process_id == 0
    with pytest.raises(UserError, match=r"^JobSet: JOB_INDEX is not set; set it from metadata.annotations"
                                        r"\['jobset.sigs.k8s.io/job-index'\]"):
        resolve_launch({k: v for k, v in env.items() if k != "JOB_INDEX"})


@pytest.mark.parametrize("path", [INDEXED_JOB, JOBSET], ids=["indexed job", "jobset"])
def test_manifest_commands_load(path):
    [job] = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] in ("Job", "JobSet")]
    job = job["spec"]["replicatedJobs"][0]["template"] if job["kind"] == "JobSet" else job
    argv = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[:3] == ["python", "-m", "meshtrain.train"]
    args = parser().parse_args(argv[3:])
    cfg = load_config(str(ROOT / args.config), overrides(args))
    assert math.prod(parse_mesh(cfg.parallel.mesh, 64).values()) == 64  # 8 pods x 8 GPUs


# ---- flags, Open MPI, nothing ----
def test_flags_open_mpi_and_a_single_process():
    assert resolve_launch({}) is None
    assert resolve_launch({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"}) is None
    assert resolve_launch({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99"}) == Launch("JAX", "10.0.0.1:99", None, None)
    flags = resolve_launch({"SLURM_NTASKS": "8"}, "10.0.0.1:1234", 2, 1)  # flags win over any launcher
    assert flags == Launch("flags", "10.0.0.1:1234", 2, 1)
    with pytest.raises(UserError, match="--process-id 2 is not one of the 2 processes"):
        resolve_launch({}, "h:1", 2, 2)
    with pytest.raises(UserError, match="go together"):
        resolve_launch({}, "h:1", 2)
    mpi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    assert resolve_launch(mpi) == Launch("Open MPI", f"10.96.0.1:{1531576320 // 4096 % 4096 + 61440}", 4, 3, (1,))
    del mpi["OMPI_MCA_orte_hnp_uri"]  # Open MPI 5
    with pytest.raises(UserError, match="OMPI_MCA_orte_hnp_uri is not set"):
        resolve_launch(mpi)
    assert resolve_launch(mpi | {"JAX_COORDINATOR_ADDRESS": "head:5000"}).coordinator == "head:5000"


# ---- start-up messages ----
def test_compile_ticker_counts_the_seconds_then_says_how_long():
    import itertools
    import threading

    readings = itertools.count(100.0, 10.0)  # a fake clock: each reading 10 s after the one before
    lines, three = [], threading.Event()

    def tick(line):
        lines.append(line)
        if len(lines) == 3:
            three.set()

    with loggers.Ticker("compiling the train step", "compiled the train step", every_s=0.001,
                        clock=lambda: next(readings), print_line=tick):
        assert three.wait(10)
    assert lines[:3] == [f"compiling the train step ({s} s so far)" for s in (10, 20, 30)]
    assert re.fullmatch(r"compiled the train step in \d+\.\ds", lines[-1]) and len(lines) >= 4
    silent = []
    with loggers.Ticker("x", "y", every_s=0.001, enabled=False, print_line=silent.append):
        pass
    assert silent == []


def test_lines_give_the_warm_step_time_and_an_eta(capsys):
    sink = loggers.Lines(first=0, steps=100)
    record = lambda step, t: {"step": step, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1e3,
                              "step_time_s": t}
    for r in (record(10, 0.5), {"step": 10, "eval_loss": 2.0}, record(20, 0.1), record(30, 0.2), record(100, 0.2)):
        sink.write(r)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == loggers.format_record(record(10, 0.5))  # warm-up: no ETA
    assert lines[1] == "step     10  eval_loss 2.0000"
    assert lines[2] == "after warm-up: 100.0ms per step (steps 11-20); 80 steps left, ETA 8.0s"
    assert lines[3] == loggers.format_record(record(20, 0.1)) + "  ETA 8.0s"
    assert lines[4] == loggers.format_record(record(30, 0.2)) + "  ETA 14.0s"
    assert lines[5] == loggers.format_record(record(100, 0.2))  # the last step: nothing left
    assert loggers.where(ROOT / "runs/x", True) == (f"run folder {ROOT / 'runs/x'} (config.yaml, metrics.jsonl, "
                                                    f"checkpoints/); TensorBoard: tensorboard --logdir "
                                                    f"{ROOT / 'runs/x/tensorboard'}")
