"""Checkpoints: exact continuation after SIGKILL, elastic resume on another mesh, damaged
checkpoints, SIGTERM."""
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, TINY

STEPS = 24  # checkpoints every 4 steps, all kept


def train_cmd(out, *extra):
    return [sys.executable, "-m", "meshtrain.train", "--config", TINY, "--steps", str(STEPS), "--out", str(out),
            "--set", "checkpoint.every=4", "--set", "checkpoint.keep=10", *extra]


def losses(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for r in records:
        if "loss" in r:
            by_step[r["step"]] = r["loss"]  # a resumed run rewrites the steps after its checkpoint
    return by_step


def run(cmd, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted fsdp=8 run with checkpoints every 4 steps. The damaged-checkpoint test
    (defined after the others that read them) damages them."""
    full = tmp_path_factory.mktemp("full")
    run(train_cmd(full, "--devices", "8", "--mesh", "fsdp=8"))
    reference = losses(full)
    assert sorted(reference) == list(range(1, STEPS + 1))
    return full, reference


def test_sigkill_then_rerun_continues_bitwise_and_elastic_resume(tmp_path, full_run):
    full, reference = full_run

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
    resumed = losses(killed)
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
    data[len(data) // 2] ^= 1  # one flipped bit: caught by the checksums
    flipped.write_bytes(bytes(data))

    proc = subprocess.run(train_cmd(full, "--devices", "8", "--mesh", "fsdp=8"), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: checkpoint {ckpts / '24'} is damaged (file state/" in proc.stderr
    assert f"warning: checkpoint {ckpts / '20'} is damaged (checksums of the restored arrays differ" in proc.stderr
    assert "resumed from step 16" in proc.stdout
    assert (ckpts / "24.damaged").is_dir() and (ckpts / "20.damaged").is_dir()  # kept for inspection
    retrained = losses(full)  # the rerun rewrote steps 17-24: the same losses
    assert all(retrained[s] == reference[s] for s in range(17, STEPS + 1))

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
