"""The train step compiled ahead of time for a multi-host topology: P processes x K CPU devices each,
one job on 127.0.0.1 (jax.distributed, gloo), so the program's devices really belong to several
processes, as on a pod. Per collective kind, the link traffic per device per step on in-node and
cross-node links as the planner's roofline attributes it (meshtrain/planner/roofline.py: node = mesh
position // K) beside the truth of the compiled program: a collective crosses hosts when one of
its replica groups holds devices of two processes (their `process_index`).

    python benchmarks/multihost_plan.py --processes 16 --devices-per-process 8

Defaults: 2 x 8, the tiny model on data=P,fsdp=K/2,tensor=2 with two sequences per batch shard.
Only process 0 compiles (every process of an SPMD job compiles the same program); the others join
the job and wait. A control compiles two psums on a mesh that interleaves the processes, where the
roofline's layout assumption is false: the comparison must see it. `--json FILE` writes process
0's facts (tests/test_multihost_plan.py checks them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def facts(compiled, mesh, sizes: dict) -> dict:
    """What the comparison needs of one compiled program: its mesh's devices in mesh order (global
    id, process), the devices this process runs in the executable's partition order, and every
    collective (meshtrain/planner/hlo.py) with its replica groups as the HLO names them."""
    from meshtrain.planner import hlo

    return {"sizes": sizes,
            "mesh_device_ids": [d.id for d in mesh.devices.flat],
            "mesh_processes": [d.process_index for d in mesh.devices.flat],
            "executable_devices": [d.id for d in compiled.runtime_executable().local_devices()],
            "collectives": [{"kind": c.kind, "name": c.name, "times": c.times, "traffic": c.traffic,
                             "groups": c.groups} for c in hlo.read(compiled.as_text(), mesh.size)]}


def train_step_facts(config: str, mesh: str, overrides: list[str], per_node: int) -> dict:
    """The real TrainProgram for `mesh` over every process's devices, lowered and compiled (no
    training), and the roofline's per-link traffic for it (H100 profile, `per_node` per node)."""
    from meshtrain.config.loader import load_config
    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.engine.program import TrainProgram
    from meshtrain.planner import hlo, roofline, ticks

    cfg = load_config(config, [f"parallel.mesh={mesh}", *overrides])
    cfg.devices = 0
    start = time.perf_counter()
    program = TrainProgram.from_config(cfg)
    compiled = program.lower().compile()
    seconds = time.perf_counter() - start
    records = hlo.read(compiled.as_text(), program.mesh.size, tick_plan=ticks.tick_plan(program))
    links = roofline.estimate(program, compiled.memory_analysis(), records, DEVICE_PROFILES["h100"],
                              per_node)["links"]
    return {**facts(compiled, program.mesh, program.sizes), "compile_s": seconds, "links": links}


def control_facts(per_node: int) -> dict:
    """psum over `data` and over `fsdp` on data=K x fsdp=P, laid out against the process order:
    position i*P + p is process p's device K-1-i. data's groups hold one process's devices, which
    the roofline (node = position // K) puts across nodes; fsdp's hold one device of each process,
    which it puts in one node while P <= K: wrong for both at 2 x 8, for data only at 16 x 8."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshtrain.parallel.mesh import build_mesh

    processes = jax.process_count()
    local = [[d for d in jax.devices() if d.process_index == p] for p in range(processes)]
    order = [local[p][i] for i in reversed(range(per_node)) for p in range(processes)]
    sizes = {"data": per_node, "fsdp": processes}
    mesh = build_mesh(sizes, order)
    sums = jax.shard_map(lambda x: (jax.lax.psum(x, "data"), jax.lax.psum(x, "fsdp")), mesh=mesh,
                         in_specs=P("data", "fsdp"), out_specs=(P(None, "fsdp"), P("data", None)))
    x = jax.ShapeDtypeStruct((per_node, processes), jnp.float32, sharding=NamedSharding(mesh, P("data", "fsdp")))
    return facts(jax.jit(sums).lower(x).compile(), mesh, sizes)


# ---- the comparison ----
def verdicts(program: dict, per_node: int) -> list[dict]:
    """Per collective: its link traffic per step, the roofline's verdict (the axes its groups span
    cross nodes of `per_node` consecutive positions) and the truth (a group holds devices of two
    processes, the group's ids read as mesh positions)."""
    from meshtrain.planner import roofline

    sizes, owner = program["sizes"], program["mesh_processes"]
    return [{"kind": c["kind"], "bytes": c["times"] * c["traffic"],
             "roofline_cross": roofline.crosses_nodes(roofline.axes_of_groups(c["groups"], sizes), sizes, per_node),
             "process_cross": any(len({owner[i] for i in g}) > 1 for g in c["groups"])}
            for c in program["collectives"]]


def table(program: dict, per_node: int) -> str:
    """Per kind: link MB per device per step on each link by the roofline and by the processes."""
    from meshtrain.planner.hlo import KINDS

    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    disagree = 0
    for v in verdicts(program, per_node):
        for kind in (v["kind"], "total"):
            row = rows[kind]
            row[0] += 1
            row[1 + v["roofline_cross"]] += v["bytes"]
            row[3 + v["process_cross"]] += v["bytes"]
        disagree += v["roofline_cross"] != v["process_cross"]
    lines = ["| kind | HLO collectives | roofline in-node | roofline cross-node | processes in-node | "
             "processes cross-node |", "|---|---|---|---|---|---|"]
    for kind in (*KINDS, "total"):
        if kind in rows:
            n, *b = rows[kind]
            lines.append(f"| {kind} | {n:.0f} | " + " | ".join(f"{x / 1e6:,.3f} MB" for x in b) + " |")
    cross = {k: v["traffic_bytes"] for k, v in program["links"].items() if v["cross_node"]}
    within = sum(v["traffic_bytes"] for v in program["links"].values() if not v["cross_node"])
    over = ", ".join(f"over {k} {b / 1e6:,.3f} MB" for k, b in cross.items())
    lines += ["", f"roofline.estimate's links: cross-node {sum(cross.values()) / 1e6:,.3f} MB ({over}), "
                  f"in-node {within / 1e6:,.3f} MB",
              f"collectives the roofline and the processes put on different links: {disagree} of "
              f"{len(program['collectives'])}"]
    return "\n".join(lines)


# ---- the job ----
def worker(args) -> None:
    import jax

    from meshtrain.core.errors import UserError
    from meshtrain.parallel.mesh import simulate_cpu_devices
    from meshtrain.run.multihost import init_distributed, leave_together, run_over

    jax.config.update("jax_platforms", "cpu")
    simulate_cpu_devices(args.devices_per_process)
    init_distributed(args.coordinator, args.processes, args.process_id, init_timeout_s=args.timeout)
    if jax.process_index() == 0:
        try:
            result = {"processes": jax.process_count(), "devices_per_process": args.devices_per_process,
                      "global_device_ids": [d.id for d in jax.devices()],
                      "train": train_step_facts(args.config, args.mesh, args.set, args.devices_per_process),
                      "control": control_facts(args.devices_per_process)}
        except UserError as e:  # one line, and no shutdown that would wait for the others
            run_over()
            print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
        Path(args.json).write_text(json.dumps(result))
    leave_together(timeout_s=args.timeout)


def launch(args) -> dict:
    """Start the P processes, wait for them, and return process 0's facts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = Path(tempfile.mkdtemp(prefix="meshtrain-multihost-plan-"))
    out = Path(args.json or logs / "facts.json")
    argv = [sys.executable, __file__, "--processes", str(args.processes), "--devices-per-process",
            str(args.devices_per_process), "--config", args.config, "--mesh", args.mesh, "--json", str(out),
            "--timeout", str(args.timeout), "--coordinator", f"127.0.0.1:{port}",
            *[a for s in args.set for a in ("--set", s)]]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]  # K is set per process
    env = {**os.environ, "XLA_FLAGS": " ".join(flags),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([*argv, "--process-id", str(i)], cwd=ROOT, env=env,
                              stdout=open(logs / f"p{i}.out", "w"), stderr=open(logs / f"p{i}.err", "w"))
             for i in range(args.processes)]
    deadline = time.monotonic() + args.timeout
    try:  # until all are done, one failed (the others would wait for it), or the time is up
        while time.monotonic() < deadline and not all(p.poll() == 0 for p in procs):
            if any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
    codes = [p.wait() for p in procs]
    if any(codes):
        from meshtrain.run.multihost import last_error

        failed = next((i for i, c in enumerate(codes) if c > 0), 0)  # one that exited itself, not a killed one
        text = (logs / f"p{failed}.err").read_text().splitlines()
        sys.exit(f"error: process {failed} exited with {codes[failed]}: "
                 f"{last_error(text, f'no output after {args.timeout} s')} (logs in {logs})")
    result = json.loads(out.read_text())
    shutil.rmtree(logs)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=8)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--mesh", help="default data=P,fsdp=K/2,tensor=2")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (the default mesh sets train.batch_size=2 x data x fsdp first)")
    p.add_argument("--json", help="write process 0's facts here")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the whole job")
    p.add_argument("--coordinator", help=argparse.SUPPRESS)  # set by the launcher for its processes
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    k, n = args.devices_per_process, args.processes
    if args.mesh is None:
        if k % 2:
            sys.exit(f"error: the default mesh data={n},fsdp=K/2,tensor=2 needs an even --devices-per-process "
                     f"(got {k}); pass --mesh")
        args.mesh = f"data={n},fsdp={k // 2},tensor=2"
        args.set = [f"train.batch_size={2 * n * (k // 2)}", *args.set]
    if args.process_id is not None:
        return worker(args)
    start = time.perf_counter()
    result = launch(args)
    wall = time.perf_counter() - start
    train, control = result["train"], result["control"]
    print(f"{n} processes x {k} CPU devices, mesh {args.mesh}, {Path(args.config).name} {' '.join(args.set)}: "
          f"process 0 built and compiled the train step in {train['compile_s']:.1f} s; link traffic per device "
          f"per step (node = {k} consecutive mesh positions, as the planner assumes):\n")
    print(table(train, k))
    wrong = sum(v["roofline_cross"] != v["process_cross"] for v in verdicts(control, k))
    print(f"control, psums on a mesh interleaving the processes: the roofline's links are wrong for {wrong} of "
          f"{len(control['collectives'])} (the comparison sees a layout the planner does not assume)")
    print(f"wall time {wall:.1f} s (start, join, compile, leave)")


if __name__ == "__main__":
    main()
