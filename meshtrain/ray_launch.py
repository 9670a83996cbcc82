"""`python -m meshtrain.ray_launch --nodes N [--address auto] -- <meshtrain.train args>`: one meshtrain
process per Ray node, joined by jax.distributed.

A placement group reserves one bundle per process (`--strategy STRICT_SPREAD`, the default: each on
its own node; `PACK` puts them on one machine, as the local test does). A small task in bundle 0
picks that node's IP and a free port as the coordinator; then bundle i runs
`python -m meshtrain.train <args> --coordinator IP:PORT --num-processes N --process-id i`.
Ray gives each bundle's task its GPUs through CUDA_VISIBLE_DEVICES (`--gpus-per-node`). The
processes' output comes back to this terminal line by line as `[process i] ...` and the launcher
exits non-zero, naming each failed process and its last `error:` line, if any process fails.

Every node must have meshtrain installed (the task runs the worker's own Python) and see `--out` on
a shared filesystem, as for any multi-host run (docs/multihost.md). `--address local` starts a
Ray instance on this machine instead of joining a cluster.
"""
from __future__ import annotations

import functools
import os
import sys
import time

from meshtrain.core.cli import Parser, arguments, command, number
from meshtrain.core.console import log
from meshtrain.core.errors import UserError
from meshtrain.core.ray_cluster import connected
from meshtrain.run.multihost import EXIT_PEER_LOST, die_with_parent, last_error

SET_BY_LAUNCHER = ("--coordinator", "--num-processes", "--process-id")
FORWARDED_ENV = ("JAX_", "XLA_", "TF_CPP_", "NCCL_")  # this shell's settings for the processes
TAIL_LINES = 40


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.ray_launch",
               description="Run one meshtrain process per Ray node: ... -- <meshtrain.train args>")
    p.add_argument("--nodes", type=number(int, min=1), required=True, help="processes, one per node (bundle)")
    p.add_argument("--address", default="auto",
                   help="Ray cluster address (default auto: the running cluster); local: start one here")
    p.add_argument("--strategy", default="STRICT_SPREAD", choices=("STRICT_SPREAD", "SPREAD", "PACK"),
                   help="placement of the bundles (STRICT_SPREAD: one per node)")
    p.add_argument("--cpus-per-node", type=number(float, above=0.0), default=1, help="CPUs each bundle reserves")
    p.add_argument("--gpus-per-node", type=number(float, min=0.0), default=0,
                   help="GPUs each bundle reserves (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--timeout", type=number(int, min=1), default=300, metavar="SECONDS",
                   help="how long to wait for the cluster to place every bundle")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise UserError("pass the meshtrain.train arguments after --, e.g. ... --nodes 2 -- --config configs/tiny.yaml")
    i = argv.index("--")
    train = argv[i + 1:]
    for flag in SET_BY_LAUNCHER:
        if any(a == flag or a.startswith(flag + "=") for a in train):
            raise UserError(f"{flag} is set by the launcher for each process; leave it out of the meshtrain arguments")
    return argv[:i], train


def coordinator() -> tuple[str, int]:
    """This node's IP and a port free on it (run inside bundle 0)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def run_process(process_id: int, argv: list[str], cwd: str, env: dict) -> dict:
    """One meshtrain process, inside its bundle: its output streams back line by line; the result
    carries the exit code and the last lines."""
    import collections
    import signal
    import subprocess


    tail = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain.train", *argv], cwd=cwd if os.path.isdir(cwd) else None,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, preexec_fn=functools.partial(die_with_parent, os.getpid()))
    try:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"[process {process_id}] {line}", end="", flush=True)  # relayed as it came: its own console's
        code = proc.wait()
    except BaseException:  # cancelled (the launcher was interrupted): meshtrain checkpoints on SIGTERM
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise
    import ray

    return {"process": process_id, "code": code, "node": ray.util.get_node_ip_address(), "tail": list(tail)}


def launch(nodes: int, train_argv: list[str], strategy: str = "STRICT_SPREAD", cpus: float = 1, gpus: float = 0,
           timeout: int = 300) -> list[dict]:
    """Run the processes on the connected Ray cluster; one result per process, in process order."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = placement_group([dict(bundle) for _ in range(nodes)], strategy=strategy)
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout)
        if not ready:
            alive = sum(n["Alive"] for n in ray.nodes())
            raise UserError(f"Ray could not place {nodes} bundles of {bundle} with {strategy} within {timeout} s "
                            f"({alive} node(s) alive); add nodes or lower --nodes")
        in_bundle = functools.partial(PlacementGroupSchedulingStrategy, group)
        host, port = ray.get(ray.remote(coordinator).options(
            num_cpus=0, scheduling_strategy=in_bundle(placement_group_bundle_index=0)).remote())
        log.info(f"ray_launch: {nodes} processes, coordinator {host}:{port}")
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        task = ray.remote(run_process)
        refs = [task.options(num_cpus=cpus, num_gpus=gpus, max_retries=0,
                             scheduling_strategy=in_bundle(placement_group_bundle_index=i)).remote(
            i, [*train_argv, "--coordinator", f"{host}:{port}", "--num-processes", str(nodes), "--process-id", str(i)],
            os.getcwd(), env) for i in range(nodes)]
        try:
            return ray.get(refs)
        except KeyboardInterrupt:
            for ref in refs:
                ray.cancel(ref)
            raise
    finally:
        remove_placement_group(group)


@command
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train = split_argv(argv)
    args = arguments(parser(), own)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every process's lines, not "[repeated 2x]"
    started = time.time()
    with connected(args.address, local={"num_cpus": max(2, int(args.nodes * args.cpus_per_node))}):
        results = launch(args.nodes, train, args.strategy, args.cpus_per_node, args.gpus_per_node, args.timeout)
    return summarize(results, time.time() - started)


def summarize(results: list[dict], seconds: float) -> int:
    """Each process's exit code; for a failed one its last `error:` line. The exit status is the code
    of the first process that failed on its own (EXIT_PEER_LOST: a process only lost its peer)."""

    failed = [r for r in results if r["code"] != 0]
    for r in results:
        print(f"process {r['process']} on {r['node']}: exit {r['code']}", flush=True)
    if not failed:
        print(f"ray_launch: all {len(results)} processes finished in {seconds:.0f} s", flush=True)
        return 0
    for r in failed:
        print(f"error: process {r['process']} of {len(results)} failed (exit {r['code']}): "
              f"{last_error(r['tail'], '(no output)')}", file=sys.stderr)
    causes = [r["code"] for r in failed if r["code"] != EXIT_PEER_LOST]
    return (causes or [failed[0]["code"]])[0]


if __name__ == "__main__":
    sys.exit(main())
