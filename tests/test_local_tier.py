"""The local checkpoint tier (checkpoint.local_dir, meshtrain/run/local_tier.py): save, restore
bit-exact, retention, damage and layout changes falling back, the config's checks; a run that resumes
from it continues exactly as the uninterrupted run; two processes killed with SIGKILL resume from the
newer tier, and fall back to the persistent tier when one process lost its local copy."""
import json
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_multihost import free_port, launch

from meshtrain.config.loader import UserError, load_config
from meshtrain.run.local_tier import SHARDS, LocalTier, run_folder
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

MESH = "data=8"


def state_at(step: int, mesh):
    """A small state of three layouts: sharded fp32, replicated bf16, a scalar."""
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    w = jnp.arange(64, dtype=jnp.float32).reshape(16, 4) * (step + 1)
    return {"step": jax.device_put(jnp.int32(step), whole),
            "params": {"w": jax.device_put(w, split), "b": jax.device_put(jnp.full(4, step, jnp.bfloat16), whole)}}


@pytest.fixture
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.fast
def test_saves_restore_bit_exact_keep_the_newest_and_drop_a_left_timeline(tmp_path, mesh):
    tier = LocalTier(tmp_path, keep=2, run_id="run-a")
    for step in (1, 2, 3):
        tier.save(state_at(step, mesh), {"skip_batches": [7]}, MESH)
    tier.wait()
    assert tier.steps() == [3, 2]
    manifest = json.loads((tier.path(3) / "manifest.json").read_text())
    assert manifest["process_count"] == 1 and len(manifest["leaves"][1]["shards"]) == 8  # w: 8 shards
    assert len(manifest["leaves"][0]["shards"]) == 1  # b: replicated, written once
    step, state, meta = tier.restore_newer(-1, abstract(state_at(0, mesh)), MESH)
    assert step == 3 and meta["skip_batches"] == [7]
    assert_same(state, state_at(3, mesh))
    assert state["params"]["w"].sharding == state_at(0, mesh)["params"]["w"].sharding
    assert tier.restore_newer(3, abstract(state_at(0, mesh)), MESH) is None  # the persistent tier is as new
    # Another run in a folder of the same path, another mesh, another sharding: never read.
    assert LocalTier(tmp_path, keep=2, run_id="run-b").restore_newer(-1, abstract(state_at(0, mesh)), MESH) is None
    assert tier.restore_newer(-1, abstract(state_at(0, mesh)), "data=4,tensor=2") is None
    replicated = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                              state_at(0, mesh))
    assert tier.restore_newer(-1, replicated, MESH) is None
    assert tier.steps() == [3, 2]  # none of that is damage
    # A save of an older step (after a rollback) drops the steps past it: a timeline the run left.
    tier.save(state_at(1, mesh), {}, MESH)
    tier.wait()
    assert tier.steps() == [1]


@pytest.mark.fast
def test_damage_falls_back_to_the_previous_step_and_is_set_aside(tmp_path, mesh, caplog):
    tier = LocalTier(tmp_path, keep=3, run_id="r")
    for step in (1, 2, 3):
        tier.save(state_at(step, mesh), {}, MESH)
    tier.wait()
    with open(tier.path(3) / SHARDS, "r+b") as f:  # one flipped bit
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 1]))
    with open(tier.path(2) / SHARDS, "r+b") as f:  # a truncated file: the manifest's sizes
        f.truncate(10)
    step, state, _ = tier.restore_newer(-1, abstract(state_at(0, mesh)), MESH)
    assert step == 1
    assert_same(state, state_at(1, mesh))
    assert "local checkpoint of step 3 is damaged (['params']['w']: a shard's CRC-32 differs" in caplog.text
    assert (tmp_path / "process-0" / "3.damaged").is_dir() and tier.steps() == [2, 1]
    (tier.path(1) / "manifest.json").unlink()  # nothing readable left: the persistent tier's turn
    assert tier.restore_newer(-1, abstract(state_at(0, mesh)), MESH) is None
    # The damaged copy is evidence while its step would be kept, then pruned with the others.
    tier.save(state_at(4, mesh), {}, MESH)
    tier.wait()
    assert (tmp_path / "process-0" / "3.damaged").is_dir() and tier.steps() == [4, 2, 1]
    tier.save(state_at(5, mesh), {}, MESH)
    tier.save(state_at(6, mesh), {}, MESH)
    tier.wait()
    assert tier.steps() == [6, 5, 4] and not (tmp_path / "process-0" / "3.damaged").exists()


@pytest.mark.fast
def test_a_local_save_that_failed_on_any_process_is_said_by_process_0(tmp_path, mesh, caplog, monkeypatch):
    """Process 1's disk is full: it says why in its own log; process 0, whose log the user reads, names
    it at the next save (or the run's end), a collective over the processes' failed steps."""
    from jax.experimental import multihost_utils

    tier = LocalTier(tmp_path, keep=2, run_id="r")
    tier.save(state_at(1, mesh), {}, MESH)
    tier.report_failures()
    assert "not written" not in caplog.text  # one process, and it wrote it
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    gathered = []
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: gathered.append(int(x)) or np.array([int(x), 2], np.int64))
    tier.report_failures()  # process 1 failed step 2
    assert gathered == [-1] and ("local checkpoint of step 2 not written on process(es) 1 (each process's log says "
                                 "why); the persistent tier goes on") in caplog.text


@pytest.mark.fast
def test_an_interrupted_save_is_removed_and_the_folder_is_the_runs_own(tmp_path):
    (tmp_path / "process-0" / "5.tmp-abc").mkdir(parents=True)
    assert LocalTier(tmp_path, keep=1, run_id="r").steps() == []
    assert not (tmp_path / "process-0" / "5.tmp-abc").exists()
    a, b = run_folder(tmp_path, tmp_path / "x" / "run"), run_folder(tmp_path, tmp_path / "y" / "run")
    assert a.name.startswith("run-") and a != b and a.parent == tmp_path


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (("checkpoint.local_every=5",), "checkpoint.local_every=5 has no effect with checkpoint.local_dir='' (it "
                                    "applies where checkpoint.local_dir is set)"),
    (("checkpoint.local_dir=/tmp/nvme",), "checkpoint.local_dir='/tmp/nvme' is never written: set "
                                          "checkpoint.local_every"),
    (("checkpoint.local_dir=/tmp/r/checkpoints/l", "checkpoint.local_every=2", "out=/tmp/r"),
     "is inside the persistent tier /tmp/r/checkpoints"),
    (("checkpoint.local_dir=/tmp/nvme", "checkpoint.local_every=-1"), "checkpoint.local_every=-1 must be >= 0"),
    (("checkpoint.local_dir=/tmp/nvme", "checkpoint.local_every=1", "checkpoint.local_keep=0"),
     "checkpoint.local_keep=0 must be >= 1"),
])
def test_bad_local_tier_settings_are_one_error(overrides, message):
    with pytest.raises(UserError, match=None) as e:
        load_config(None, list(overrides))
    assert message in str(e.value)


def test_a_run_resumed_from_the_local_tier_continues_exactly(tmp_path, capsys):
    """SIGKILL after step 4's local save, the persistent tier's newest being older (here: none, its
    final save removed): the rerun resumes from the local tier and ends bit-equal to the
    uninterrupted run."""
    sets = ("train.steps=6", "checkpoint.every=0", "checkpoint.every_minutes=0", "checkpoint.local_every=2",
            f"checkpoint.local_dir={tmp_path / 'nvme'}", "parallel.mesh=fsdp=4,data=2", "checkpoint.resume=auto")
    first = Trainer(tiny_config(*sets, out=str(tmp_path / "run")))
    history = first.fit(log=MetricsLog("/tmp/meshtrain-tests", primary=False))
    assert [r["step"] for r in history if "local_checkpoint_blocking_s" in r] == [2, 4]
    tier = first.store.local_tier
    assert tier.steps() == [4, 2] and first.checkpointer.steps() == [6]  # step 6: the persistent tier's
    shutil.rmtree(first.checkpointer.path(6))  # as if killed before it
    capsys.readouterr()
    second = Trainer(tiny_config(*sets, out=str(tmp_path / "run")))
    assert f"resumed from step 4 (local tier, {tier.path(4)}, saved on mesh" in capsys.readouterr().out
    second.fit(log=MetricsLog("/tmp/meshtrain-tests", primary=False))
    assert_same(second.state["params"], first.state["params"])
    assert_same(second.state["opt_state"], first.state["opt_state"])


def wait_for(condition, procs, err, timeout=300):
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        assert all(p.poll() is None for p in procs), err.read_text()[-3000:]
        time.sleep(0.1)
    assert condition()


def kill_all(procs):
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()


def test_two_processes_resume_from_the_newer_tier_and_fall_back_when_one_lost_its_copy(tmp_path):
    """2 processes x 4 CPU devices, the persistent tier every 8 steps, the local one every 2 steps in
    between, killed with SIGKILL between persistent saves (a window of 3 local saves: a fast machine
    does not step past it between two looks); the restarts save nothing (every 1000
    steps) and are killed once they said where they resumed from."""
    out, nvme = tmp_path / "run", tmp_path / "nvme"
    common = ("parallel.mesh=2x2x2", "parallel.zero=0", f"checkpoint.local_dir={nvme}")
    persistent = out / "checkpoints"

    def newest(folder):
        return max((int(p.name) for p in folder.iterdir() if p.name.isdigit()), default=0) if folder.is_dir() else 0

    def newest_local():  # the newest step both processes hold whole
        return min(newest(run_folder(nvme, out) / f"process-{i}") for i in range(2))

    def start(name, until, *settings):
        sets = [arg for o in (*common, *settings) for arg in ("--set", o)]
        procs = launch(tmp_path, out, free_port(), *sets, "--steps", "1000", name=name)
        wait_for(lambda: until((tmp_path / f"{name}0.out").read_text()), procs, tmp_path / f"{name}0.err")
        kill_all(procs)
        return (tmp_path / f"{name}0.out").read_text() + (tmp_path / f"{name}0.err").read_text()

    start("a", lambda _: newest(persistent) == 8 and newest_local() >= 10, "checkpoint.every=8",
          "checkpoint.local_every=2")
    local = newest_local()
    assert local > newest(persistent) == 8  # killed between the persistent tier's saves
    resumed = lambda text: "resumed from" in text
    quiet = ("checkpoint.every=1000", "checkpoint.local_every=1000")
    assert f"resumed from step {local} (local tier, {run_folder(nvme, out) / 'process-0' / str(local)}, saved on " \
           in start("b", resumed, *quiet)
    shutil.rmtree(run_folder(nvme, out) / "process-1")  # a replaced node: its local disk is empty
    said = start("c", resumed, *quiet)
    assert f"resumed from step 8 ({persistent / '8'}, saved on" in said
    assert f"notice: local checkpoint of step {local} is missing or unusable on process(es) 1; using the " \
           f"persistent tier" in said
