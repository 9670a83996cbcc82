"""An ahead-of-time compile of a multi-host topology: benchmarks/multihost_plan.py starts 2 processes
x 8 CPU devices on 127.0.0.1 (jax.distributed, gloo) and compiles the real train step for
data=2,fsdp=4,tensor=2 over their 16 devices, as a pod's hosts would (no training). For every
collective, the link the planner's roofline gives it (meshtrain/planner/roofline.py, 8 devices per node)
must be the truth of the compiled program's devices: whether one of its replica groups holds
devices of two processes. A control on a mesh that interleaves the processes shows the check
tells the two apart."""
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from meshtrain.planner import roofline

PROCESSES, PER_PROCESS = 2, 8
N = PROCESSES * PER_PROCESS


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Process 0's facts of the 2-process compile (its train step and the control), and what the
    benchmark printed."""
    out = tmp_path_factory.mktemp("multihost-plan") / "facts.json"
    run = subprocess.run([sys.executable, "benchmarks/multihost_plan.py", "--processes", str(PROCESSES),
                          "--devices-per-process", str(PER_PROCESS), "--json", str(out), "--timeout", "300"],
                         cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def links(program):
    """Per collective: (the roofline's verdict, the processes' truth, link bytes per step). The
    replica groups name mesh positions (see the test below); position i is the mesh's device i."""
    sizes, owner = program["sizes"], program["mesh_processes"]
    for c in program["collectives"]:
        planned = roofline.crosses_nodes(roofline.axes_of_groups(c["groups"], sizes), sizes, PER_PROCESS)
        true = any(len({owner[i] for i in group}) > 1 for group in c["groups"])
        yield planned, true, c["times"] * c["traffic"]


def test_replica_groups_name_mesh_positions_and_build_mesh_puts_data_across_processes(job):
    facts, _ = job
    train, control = facts["train"], facts["control"]
    # Process 1's global device ids start at 2048: no collective names one, and 8..15 are no
    # device's id, so the groups' ids are positions in the mesh (XLA's partitions), not device ids.
    ids = facts["global_device_ids"]
    assert ids[PER_PROCESS] >= N and sorted(ids) == sorted(train["mesh_device_ids"])
    for program in (train, control):
        named = {i for c in program["collectives"] for group in c["groups"] for i in group}
        assert named == set(range(N))
    # Partition i runs on the mesh's device i: process 0 runs its mesh devices in mesh order, which
    # the control reverses against the device ids.
    for program in (train, control):
        mine = [d for d, p in zip(program["mesh_device_ids"], program["mesh_processes"]) if p == 0]
        assert program["executable_devices"] == mine
    assert control["executable_devices"] == sorted(control["executable_devices"], reverse=True)
    # build_mesh (create_hybrid_device_mesh, data across hosts) gives process p the positions
    # 8p..8p+7: the planner's device_grid with 8 devices per node.
    grid = roofline.device_grid(train["sizes"]).reshape(-1)
    assert train["mesh_processes"] == (grid // PER_PROCESS).tolist()


def test_every_collective_is_on_the_link_its_devices_processes_say(job):
    facts, printed = job
    train = list(links(facts["train"]))
    assert [planned for planned, _, _ in train] == [true for _, true, _ in train]
    # Both kinds exist: data's gradient all-reduce and the ZeRO-1 gathers cross; fsdp and tensor stay in.
    crossing = {roofline.axes_of_groups(c["groups"], facts["train"]["sizes"])
                for c, (_, true, _) in zip(facts["train"]["collectives"], train) if true}
    staying = {roofline.axes_of_groups(c["groups"], facts["train"]["sizes"])
               for c, (_, true, _) in zip(facts["train"]["collectives"], train) if not true}
    assert ("data",) in crossing and {("fsdp",), ("tensor",)} <= staying
    assert f"put on different links: 0 of {len(train)}" in printed
    # The control's psums: fsdp's groups {2i, 2i+1} hold both processes, data's one process's
    # devices; by position // 8 it is the other way round, and the check must say so.
    control = list(links(facts["control"]))
    assert len(control) == 2 and all(planned != true for planned, true, _ in control)


def test_the_roofline_puts_the_cross_process_bytes_on_the_cross_node_link(job):
    facts, _ = job
    est = facts["train"]["links"]  # roofline.estimate's links, as the planner reports them
    across = sum(nbytes for _, true, nbytes in links(facts["train"]) if true)
    within = sum(nbytes for _, true, nbytes in links(facts["train"]) if not true)
    assert across > 0 and within > 0
    assert sum(v["traffic_bytes"] for v in est.values() if v["cross_node"]) == pytest.approx(across, rel=1e-12)
    assert sum(v["traffic_bytes"] for v in est.values() if not v["cross_node"]) == pytest.approx(within, rel=1e-12)
    # H100: a 400 Gb/s NIC per GPU, a group's k devices in each node crossing on k of them (roofline.link_bandwidth):
    # data's groups hold one device a node
    assert est["data"]["bandwidth"] == 50e9
    assert all(v["bandwidth"] in {k * 50e9 for k in range(1, 9)} for v in est.values() if v["cross_node"])


@pytest.mark.parametrize("mesh,hosts,dcn", [
    ("data=2,fsdp=4,tensor=2", 2, {"data": 2}),  # the job above
    ("data=32,fsdp=2,tensor=2", 16, {"data": 16}),  # data's factor 32 = 16 hosts x 2 within one
    ("fsdp=16,tensor=8", 16, {"fsdp": 16}),  # no data axis: fsdp crosses hosts
    ("data=2,fsdp=8", 4, {"data": 2, "fsdp": 2}),  # the hosts split data, then fsdp
    ("data=2,tensor=2,pipeline=4", 4, {"data": 2, "tensor": 2}),  # mesh order: tensor before pipeline
])
def test_build_mesh_splits_the_outer_axes_across_hosts_as_the_roofline_assumes(mesh, hosts, dcn):
    """mesh.across_hosts, build_mesh's across-host factors, make jax's create_hybrid_device_mesh
    (fake GPUs, `hosts` processes) lay devices out in mesh order: host g holds positions
    g*k .. g*k+k-1, roofline.device_grid's nodes."""
    from types import SimpleNamespace

    from jax.experimental import mesh_utils

    from meshtrain.parallel.mesh import AXES, across_hosts, parse_mesh

    sizes = parse_mesh(mesh, 16 * 8 if hosts == 16 else 16)
    assert across_hosts(sizes, hosts) == dcn
    outer = tuple(dcn.get(a, 1) for a in AXES)
    inner = tuple(sizes[a] // o for a, o in zip(AXES, outer))
    k = int(np.prod(inner))
    fake = [SimpleNamespace(id=p * k + i, process_index=p, platform="gpu", device_kind="fake GPU")
            for p in range(hosts) for i in range(k)]
    grid = mesh_utils.create_hybrid_device_mesh(inner, outer, fake, process_is_granule=True)
    assert np.vectorize(lambda d: d.id)(grid).tolist() == roofline.device_grid(sizes).tolist()


def test_a_mesh_the_hosts_cannot_split_in_mesh_order_is_one_line():
    from meshtrain.core.errors import UserError
    from meshtrain.parallel.mesh import across_hosts, parse_mesh

    with pytest.raises(UserError, match=r"mesh data=6,fsdp=2,tensor=1,pipeline=1 cannot be split across 4 hosts in "
                                        r"mesh order: the data axis \(6\) and the 4 hosts left for it do not divide "
                                        r"one another; change --mesh, e.g. make data a multiple of 4"):
        across_hosts(parse_mesh("data=6,fsdp=2", 12), 4)
