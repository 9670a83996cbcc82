"""Checkpoints: exact continuation after SIGKILL, elastic resume on another mesh, resume across
config changes, damaged checkpoints vs mismatches vs transient errors, saves by time, SIGTERM."""
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import ROOT, TINY, tiny_config

from meshtrain.config.loader import UserError
from meshtrain.run.checkpoint import Checkpointer, resolve_resume
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

STEPS = 24  # checkpoints every 4 steps, all kept


def train_cmd(out, *extra):
    return [sys.executable, "-m", "meshtrain.train", "--config", TINY, "--steps", str(STEPS), "--out", str(out),
            "--set", "checkpoint.every=4", "--set", "checkpoint.keep=10", *extra]


def losses(out):
    """{step: loss}; metrics.jsonl holds each step once, also after a resume."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)), steps
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def run(cmd, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted fsdp=8 run with checkpoints every 4 steps. Read only: tests that change a
    run folder take their own copy (`full_run`)."""
    full = tmp_path_factory.mktemp("full")
    run(train_cmd(full, "--devices", "8", "--mesh", "fsdp=8"))
    reference = losses(full)
    assert sorted(reference) == list(range(1, STEPS + 1))
    header = (full / "config.yaml").read_text().splitlines()[0]
    assert header.startswith("# written by meshtrain ") and "on 8 x cpu (cpu), 1 process(es)" in header
    assert yaml.safe_load((full / "config.yaml").read_text())["model"]["mlp_dim"] == 64  # resolved values
    return full, reference


@pytest.fixture
def full_run(reference_run, tmp_path):
    """This test's own copy of the reference run's folder."""
    full, reference = reference_run
    shutil.copytree(full, tmp_path / "full")
    return tmp_path / "full", reference


def test_sigkill_then_rerun_continues_bitwise_and_elastic_resume(tmp_path, reference_run):
    full, reference = reference_run

    # kill -9 the same command once its step-8 checkpoint is complete, then rerun it
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(killed, "--devices", "8", "--mesh", "fsdp=8"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "8").is_dir() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "8").is_dir()
    out = run(train_cmd(killed, "--devices", "8", "--mesh", "fsdp=8"))
    restored = int(out.split("resumed from step ")[1].split()[0])
    assert 8 <= restored < STEPS  # killed mid-run: there are steps left to compare
    resumed = losses(killed)  # each step once: the killed attempt's records past the checkpoint are dropped
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(restored + 1, STEPS + 1):
        assert resumed[step] == reference[step], step  # fp32 on CPU: bitwise

    # elastic: the fsdp=8 checkpoint at step 8 continues on 4 devices as data=2,tensor=2
    elastic = tmp_path / "elastic"
    out = run(train_cmd(elastic, "--devices", "4", "--mesh", "data=2,tensor=2",
                        "--resume", str(full / "checkpoints" / "8")))
    assert "resumed from step 8" in out and "saved on mesh data=1,fsdp=8" in out
    moved = losses(elastic)
    assert sorted(moved) == list(range(9, STEPS + 1))
    np.testing.assert_allclose([moved[s] for s in moved], [reference[s] for s in moved], rtol=1e-5)


def test_resume_path_yields_to_a_newer_out(tmp_path):
    given, out = tmp_path / "given" / "checkpoints", tmp_path / "out"
    for step in (4, 8):
        (given / str(step)).mkdir(parents=True)
    assert resolve_resume(str(given / "8"), out) == (given, [8])  # a fresh --out starts from PATH
    (out / "checkpoints" / "12").mkdir(parents=True)  # the same command ran on and was interrupted
    assert resolve_resume(str(given / "8"), out) == (out / "checkpoints", [12])
    assert resolve_resume(str(given), out) == (out / "checkpoints", [12])
    (given / "16").mkdir()
    assert resolve_resume(str(given), out) == (given, [16, 8, 4])
    with pytest.raises(UserError, match=r"--resume never, but .*out/checkpoints holds checkpoints of an earlier "
                                        r"run \(newest: step 12\); use a new --out"):
        resolve_resume("never", out)


def tiny_run(out, *overrides):
    return Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}", "checkpoint.resume=auto", *overrides,
                               out=str(out)))


def quiet_fit(trainer, steps):
    return trainer.fit(steps, log=MetricsLog("/tmp/meshtrain-tests", primary=False))


def test_config_changes_resume_and_mismatches_harm_nothing(full_run, monkeypatch):
    full, reference = full_run
    ckpts = full / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir())

    # How the run executes and learns may change: it resumes from step 24, checkpoints untouched.
    changed = tiny_run(full, "parallel.mesh=data=2,tensor=4", "optim.clip_norm=0", "optim.lr=0.01", "optim.b2=0.99",
                       "parallel.remat=full", "parallel.zero=3", "parallel.microbatches=2", "model.mlp_dim=64",
                       "parallel.attention=blockwise", "parallel.precision=bf16")
    assert changed.resumed_from == ckpts / "24"
    assert sorted(p.name for p in ckpts.iterdir()) == saved

    # What defines the weights may not: a one-line error naming the key, nothing renamed.
    with pytest.raises(UserError, match=rf"^the run in {full} has model.d_model=32, this start has 64; use a new --out "
                                        rf"for a new run, or the model section of {full / 'config.yaml'}$"):
        tiny_run(full, "model.d_model=64", "model.head_dim=0")
    assert sorted(p.name for p in ckpts.iterdir()) == saved

    # A transient read failure is an error, never damage.
    def out_of_memory(self, directory, args=None):
        raise MemoryError("simulated: host out of memory")

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", out_of_memory)
    with pytest.raises(MemoryError):
        tiny_run(full)
    monkeypatch.undo()
    assert sorted(p.name for p in ckpts.iterdir()) == saved

    # A checkpoint of another state layout (with clip_norm=0, earlier versions saved AdamW unchained):
    # a UserError naming an array, nothing renamed.
    state = dict(changed.state)
    state["step"] = state["step"] + 4
    state["opt_state"] = optax.adamw(1e-3).init(state["params"])
    meta = json.loads((ckpts / "24" / "metadata" / "metadata").read_text())
    checkpointer = Checkpointer(ckpts, keep=10)
    checkpointer.save(state, meta)
    checkpointer.wait()
    with pytest.raises(UserError, match=rf"checkpoint {ckpts / '28'} holds another state layout: this run has "
                                        r"24 arrays it lacks \(e.g. opt_state/1/0/count\); "
                                        r"it has 23 arrays this run lacks"):
        tiny_run(full)
    assert (ckpts / "28").is_dir() and not list(ckpts.glob("*.damaged"))


def test_saves_by_wall_time(tmp_path):
    by_time = tiny_run(tmp_path / "by_time", "checkpoint.every_minutes=1e-6", "checkpoint.keep=10")
    quiet_fit(by_time, 6)
    assert by_time.checkpointer.steps() == [6, 5, 4, 3, 2, 1]  # every step is past the interval
    default = tiny_run(tmp_path / "default")  # every_minutes=10: only the final save in a short run
    quiet_fit(default, 6)
    assert default.checkpointer.steps() == [6]


def largest_file(checkpoint):
    return max((f for f in (checkpoint / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_damaged_checkpoints_fall_back_with_a_warning_or_fail_clearly(full_run):
    full, reference = full_run
    ckpts = full / "checkpoints"
    steps = list(range(STEPS, 0, -4))  # 24, 20, ..., 4
    assert all((ckpts / str(s) / "meshtrain_manifest.json").is_file() for s in steps)
    largest_file(ckpts / "24").write_bytes(b"truncated")  # caught by the manifest's sizes
    flipped = largest_file(ckpts / "20")
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit in zstd-compressed data: a decode error or wrong values
    flipped.write_bytes(bytes(data))
    recorded = ckpts / "16" / "metadata" / "metadata"  # arrays that differ from the recorded checksums,
    text = recorded.read_text()                         # deterministically (same size: the manifest passes)
    first = re.search(r'"checksums": \[(\d+)', text)
    recorded.write_text(text[:first.start(1)] + str(int(first[1]) ^ 1) + text[first.end(1):])  # n^1: as many digits

    proc = subprocess.run(train_cmd(full, "--devices", "8", "--mesh", "fsdp=8"), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: checkpoint {ckpts / '24'} is damaged (file state/" in proc.stderr
    assert f"warning: checkpoint {ckpts / '20'} is damaged (" in proc.stderr
    assert f"warning: checkpoint {ckpts / '16'} is damaged (checksums of the restored arrays differ" in proc.stderr
    assert "resumed from step 12" in proc.stdout
    assert all((ckpts / f"{s}.damaged").is_dir() for s in (24, 20, 16))  # kept for inspection
    retrained = losses(full)  # the rerun rewrote steps 13-24: the same losses
    assert all(retrained[s] == reference[s] for s in range(13, STEPS + 1))

    for step in steps:
        largest_file(ckpts / str(step)).unlink()
    proc = subprocess.run(train_cmd(full, "--devices", "8", "--mesh", "fsdp=8", "--steps", "30"), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: no intact checkpoint in {ckpts} (damaged: {', '.join(map(str, steps))}); "
        f"pass --resume never to start fresh")


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    proc = subprocess.Popen(train_cmd(tmp_path, "--devices", "8", "--mesh", "data=8", "--steps", "100000"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (tmp_path / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("preempted at step")]
    assert lines, stdout[-2000:] + stderr[-2000:]
    line = lines[0]
    step = int(line.split()[3].rstrip(":"))
    assert (tmp_path / "checkpoints" / str(step)).is_dir()
    assert line.endswith(str(tmp_path / "checkpoints" / str(step)))


def test_a_namedtuple_state_with_unsorted_fields_restores_intact(tmp_path):
    """Optimizer states are namedtuples whose fields need not be in alphabetical order (optax's
    MultiStepsState): Orbax's metadata tree returns them sorted by name, and a checksum matched
    through it declared a sound checkpoint damaged."""
    import collections

    import jax.numpy as jnp

    Unsorted = collections.namedtuple("Unsorted", ["z", "a"])
    state = {"step": jnp.asarray(3, jnp.int32), "opt": Unsorted(z=jnp.arange(4.0), a=jnp.full((2, 3), 7.0))}
    saver = Checkpointer(tmp_path, keep=2)
    saver.save(state, {})
    saver.wait()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored, _ = Checkpointer(tmp_path, keep=2).restore(3, abstract)
    assert isinstance(restored["opt"], Unsorted)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
