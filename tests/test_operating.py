"""Operating a long run (docs/operating.md): per-layer gradient norms that add up to the global norm
and match a one-device jax.grad; a loss spike rolled back and skipped, reproducing bitwise the run
that never saw its batch; the watchdog's verdicts and dump; and a real 2-process run where one
process is slow (named as a straggler) and then stalls inside the step: both exit 4 within the
timeout with their stacks in the run folder, and a rerun resumes."""
import json
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY, tiny_config
from test_multihost import free_port

from meshtrain.config.loader import UserError
from meshtrain.objectives.next_token import make_loss_fn
from meshtrain.run.health import SpikeDetector, find_stragglers
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer
from meshtrain.run.watchdog import StepWatchdog, auto_timeout, who_stopped

STEPS, SPIKED = 6, 3  # batch 3 (step 4, a save step) reports a spike
OVERRIDES = ("parallel.mesh=data=2", "model.num_layers=2", f"train.steps={STEPS}", "checkpoint.every=2",
             "train.grad_norms_every=1", "guard.spike_factor=1.5", "guard.spike_window=2")


def two_devices(trainer_config):
    return Trainer(trainer_config, devices=jax.devices()[:2])


def fit(trainer):
    history = trainer.fit(log=MetricsLog("/tmp/meshtrain-tests", primary=False))
    return {r["step"]: r for r in history if "loss" in r}


@pytest.fixture(scope="module")
def never_saw_the_spike():
    """The run the spike rollback must reproduce: batch 3 skipped from the start (no spike in it);
    and its initial parameters and first batch."""
    trainer = two_devices(tiny_config(*OVERRIDES))
    trainer.skip_batches = [SPIKED]
    params, tokens = trainer.unpermuted_params(), np.asarray(trainer.train_batches(0))
    return trainer, fit(trainer), params, tokens


def test_layer_and_kind_gradient_norms_add_up_and_match_one_device(never_saw_the_spike):
    trainer, records, params, tokens = never_saw_the_spike
    layers = trainer.cfg.model.num_layers
    for r in records.values():
        by_layer = sum(r[f"grad_norm_layer_{i}"] ** 2 for i in range(layers))
        by_block_kind = sum(r[f"grad_norm_{k}"] ** 2 for k in trainer.program.abstract_state["params"]["blocks"])
        others = r["grad_norm_embedding"] ** 2 + r["grad_norm_final_norm"] ** 2
        assert by_layer == pytest.approx(by_block_kind, rel=1e-5)
        assert by_layer + others == pytest.approx(r["grad_norm"] ** 2, rel=1e-5)
        assert 0 < r["comm_share"] <= 1  # data=2: a data-parallel axis to time
    # Step 1's norms against jax.grad on one device, from the same initial parameters and batch.
    one = jax.devices()[0]
    grads = jax.jit(jax.grad(lambda p, t: make_loss_fn(trainer.program.model, "fp32")(p, t)[0]))(
        jax.device_put(params, one), jax.device_put(tokens, one))
    diffs = [abs(records[1][f"grad_norm_layer_{i}"]
                 - float(jnp.sqrt(sum(jnp.sum(g[i] ** 2) for g in jax.tree.leaves(grads["blocks"])))))
             for i in range(layers)]
    diffs.append(abs(records[1]["grad_norm_wq"] - float(jnp.linalg.norm(grads["blocks"]["wq"]))))
    print(f"per-layer gradient norms vs one-device jax.grad: max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-5


def test_a_loss_spike_rolls_back_and_skips_its_batch(never_saw_the_spike, capsys, tmp_path):
    """...and the spike detector, restored from the checkpoint rolled back to and from the one a rerun
    resumes, ends as the run that never saw the batch: the replayed steps' losses enter its mean once."""
    untouched, reference, _, _ = never_saw_the_spike
    trainer = two_devices(tiny_config(*OVERRIDES, out=str(tmp_path)))
    clean_batches, step = trainer.train_batches, trainer.compiled_step

    def batches(index):  # batch 3 is marked: its first row is token 7 throughout
        batch = np.array(clean_batches(index))
        if index == SPIKED:
            batch[0] = 7
        return jax.device_put(batch, trainer.program.batch_sharding)

    def spiking_step(state, batch):  # a divergence the tiny model cannot produce: the marked batch's loss x 10
        state, metrics = step(state, batch)
        return state, {**metrics, "loss": jnp.where(jnp.all(batch[0] == 7), 10 * metrics["loss"], metrics["loss"])}

    trainer.train_batches, trainer.compiled_step = batches, spiking_step
    orbax_threads = lambda: {t for t in threading.enumerate() if t.name.startswith("metadata_store")}
    before = orbax_threads()
    records = fit(trainer)
    assert not orbax_threads() - before  # the run's checkpoint manager ended with it (it saved 3 times)
    captured = capsys.readouterr()
    warning = next(line for line in captured.err.splitlines() if "loss spike" in line)
    print(warning, "\n" + "\n".join(line for line in captured.out.splitlines() if line.startswith("guard")))
    assert warning.startswith("warning: step 4: loss spike: ") and "loss spikes so far: 1" in warning
    assert "guard: a loss spike at step 4; rolled back to step 2" in captured.out
    assert "guard: skipping batches [3]" in captured.out
    assert trainer.skip_batches == [SPIKED] and trainer.guard.loss_spikes == 1
    assert records[STEPS]["loss_spikes"] == 1
    assert sorted(records) == list(range(1, STEPS + 1))  # the retrained steps once each
    for s in range(1, STEPS + 1):  # bitwise the run that never saw batch 3
        assert records[s]["loss"] == reference[s]["loss"], s
    assert trainer.guard.spikes.state() == untouched.guard.spikes.state() and trainer.guard.spikes.seen == STEPS
    resumed = two_devices(tiny_config(*OVERRIDES, "checkpoint.resume=auto", out=str(tmp_path)))  # its step 6
    resumed.close()
    assert resumed.guard.spikes.state() == trainer.guard.spikes.state()


def test_spike_detector_numbers():
    detector = SpikeDetector(factor=2.0, window=4)
    assert [detector.check(x) for x in (4.0, 4.0, 100.0, 4.0)] == [None] * 4  # warming up: 4 losses seen
    assert detector.mean == pytest.approx(4.0 + 96 / 4 * (3 / 4) ** 1, rel=1e-6)  # 100 entered the mean
    mean = detector.mean
    assert detector.check(2.01 * mean) == mean and detector.mean == mean  # a spike stays out of the mean
    assert detector.check(1.99 * mean) is None
    saved = detector.state()
    for kept, same_data in ((saved, True), (None, True), (saved, False)):  # a checkpoint's state, or a warm-up
        resumed = SpikeDetector(factor=2.0, window=4)
        resumed.mean, resumed.seen = 1.0, 9  # what it held before (a rollback's detector)
        resumed.resume(kept, same_data)
        assert resumed.state() == (saved if kept and same_data else {"mean": None, "seen": 0})


def test_stragglers_and_watchdog_verdicts(tmp_path):
    assert find_stragglers([0.010, 0.011, 0.050, 0.012], 2.0) == (0.011, [2])
    assert find_stragglers([0.020, 0.600], 2.0) == (0.020, [1])  # two processes: the faster is the reference
    assert auto_timeout(0.5) == 600 and auto_timeout(120) == 1200
    now = 1000.0
    report = lambda doing, since=990.0: {"done": 4, "doing": doing, "since": since, "host": "h"}
    assert who_stopped({0: report("waiting for step 5"), 1: report("dispatching step 5")}, now) == (
        "process 1 (host h) has been dispatching step 5 for 10 s, while process 0 is waiting for step 5: it stopped")
    assert who_stopped({0: report("waiting for step 5"), 1: report("waiting for step 5")}, now).startswith(
        "processes 0, 1 are waiting for step 5: a device or a collective hangs")
    assert who_stopped({0: report("waiting for step 5"), 1: None}, now).startswith(
        "process 1 published nothing")
    # The dump: every thread's Python stack, the devices, and what cannot be had.
    dog = StepWatchdog(5.0, tmp_path)
    assert dog.timeout() == 600  # until the first step completes: the floor for one-time work
    dog.beat(2)
    dog.doing("waiting for step 3")
    text = dog.dump(7.0).read_text()
    assert "no step completed for 7.0 s (train.step_timeout 5.0 s); last completed step 2; waiting for step 3" in text
    assert "test_stragglers_and_watchdog_verdicts" in text and "most recent call first" in text
    assert f"{jax.local_devices()[0]} ({jax.local_devices()[0].device_kind}, process 0)" in text
    assert "device stacks ---\nnot available" in text


HOLDS_THE_GIL = """
import re, sys, time
from meshtrain.run import watchdog
watchdog.BACKSTOP_S = 1.0
with watchdog.StepWatchdog(2.0, sys.argv[1]) as dog:
    for step in range(1, 13):  # a beat every 0.3 s (1.7 s of slack a beat): past the first deadline, 3.3 s
        time.sleep(0.3)
        dog.beat(step)
    re.match(r"(a+)+$", "a" * 64 + "b")  # never returns and never lets the watchdog's thread run
"""


def test_a_hang_that_holds_the_gil_ends_by_the_faulthandler_backstop(tmp_path):
    """The watchdog's thread cannot run while C code holds the GIL: faulthandler's backstop, armed for
    the last beat + timeout + BACKSTOP_S and re-armed at each beat, prints the stacks and exits 1."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HOLDS_THE_GIL, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "most recent call first" in done.stderr
    assert 'File "<string>", line 9 in <module>' in done.stderr  # the regex, not a sleep: re-armed at each beat
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("override, message", [
    ("guard.spike_factor=1", "guard.spike_factor=1.0 would call an ordinary step a spike"),
    ("train.straggler_every=3", "train.straggler_every=3 is not a multiple of train.log_every=2"),
])
def test_bad_operating_keys_are_one_line(override, message):
    with pytest.raises(UserError, match=message):
        tiny_config("train.log_every=2", override)


# Process 1 of 2: its host is slow (0.5 s more per step, a straggler), then it stalls inside the call of step 5.
SLOW_THEN_STALLED = """
import sys, time
from meshtrain.run import trainer as T
build = T.Trainer._build
def _build(self, *args, **kwargs):
    build(self, *args, **kwargs)
    step, calls = self.compiled_step, []
    def stalling(state, batch):
        calls.append(1)
        time.sleep(3600 if len(calls) == 5 else 0.5)
        return step(state, batch)
    self.compiled_step = stalling
T.Trainer._build = _build
from meshtrain.train import main
sys.exit(main(sys.argv[1:]))
"""
TIMEOUT_S = 6


def test_two_processes_one_stalls_both_exit_with_stacks_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "run"
    sets = ["parallel.mesh=2x2x2", "parallel.zero=0", "checkpoint.every=2", f"train.step_timeout={TIMEOUT_S}",
            "train.straggler_every=2"]

    def launch(name, steps, scripts):
        port = free_port()
        return [subprocess.Popen(
            [sys.executable, *scripts[i], "--config", TINY, "--devices", "4", "--out", str(out), "--steps", str(steps),
             *[a for s in sets for a in ("--set", s)], "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)],
            cwd=ROOT, stdout=open(tmp_path / f"{name}{i}.out", "w"), stderr=open(tmp_path / f"{name}{i}.err", "w"))
            for i in range(2)]

    # --steps 1000: the schedule, and so the compiled program, of test_multihost's runs (compiled once)
    procs = launch("p", 1000, [("-m", "meshtrain.train"), ("-c", SLOW_THEN_STALLED)])
    try:
        deadline = time.time() + 240
        while "step      4" not in (tmp_path / "p0.out").read_text() and time.time() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()[-3000:]
            time.sleep(0.1)
        last_step_at = time.time()
        codes = [p.wait(timeout=120) for p in procs]
        exit_s = time.time() - last_step_at
    finally:
        for p in procs:
            p.kill()
    err0, err1 = (tmp_path / "p0.err").read_text(), (tmp_path / "p1.err").read_text()
    print(f"both exited {exit_s:.1f} s after step 4 was logged (train.step_timeout={TIMEOUT_S})")
    assert codes == [4, 4], err0[-3000:] + err1[-3000:]
    assert exit_s < TIMEOUT_S + 20
    error = err0.strip().splitlines()[-1]
    print(error)
    assert error.startswith("error: no step completed for ") and f"(train.step_timeout {TIMEOUT_S} s)" in error
    assert "process 1 (host " in error and "has been dispatching step 5 for" in error
    assert "while process 0 is waiting for step 5: it stopped" in error
    dumps = {p.name: p.read_text() for p in (out / "stalls").iterdir()}
    print(dumps["process1-step4.txt"])
    assert sorted(dumps) == ["process0-step4.txt", "process1-step4.txt"]
    assert "in stalling" in dumps["process1-step4.txt"] and "dispatching step 5" in dumps["process1-step4.txt"]
    assert " in wait\n" in dumps["process0-step4.txt"]  # process 0 waits for the step on its devices (StepClock.wait)
    # Process 1 was named as a straggler, and the spread is in the metrics.
    straggler = next(line for line in err0.splitlines() if "straggler" in line)
    print(straggler)
    assert straggler.startswith("warning: step 2: straggler: process 1 (host ")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spread = [r["host_time_spread"] for r in records if "host_time_spread" in r]
    assert len(spread) == 2 and min(spread) > 2

    rerun = launch("r", 5, [("-m", "meshtrain.train")] * 2)
    codes = [p.wait(timeout=240) for p in rerun]
    assert codes == [0, 0], (tmp_path / "r0.err").read_text()[-3000:]
    assert "resumed from step 4" in (tmp_path / "r0.out").read_text()
