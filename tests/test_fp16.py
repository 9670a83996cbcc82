"""fp16 with dynamic loss scaling (meshtrain/ops/precision.py): it tracks fp32, an overflow skips the
step and halves the scale, good steps double it, every executor scales the same objective, and the
scale state resumes bitwise (also on another mesh, and fresh from a checkpoint without one)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_tiny, tiny_config

from meshtrain.config.loader import to_dict
from meshtrain.config.spec import ParallelPlan
from meshtrain.ops.precision import update_loss_scale
from meshtrain.run.checkpoint import Checkpointer
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

FP16 = "parallel.precision=fp16"


def quiet_fit(trainer, steps=None):
    return trainer.fit(steps, log=MetricsLog(trainer.out, primary=False))


def test_fp16_tracks_fp32():
    """The tiny model on standard-library text, one device, 40 steps, fp32 and fp16 from the same seed
    and batches: fp16's loss stays within 2% of fp32's at every step (measured: 0.10% at most) and
    both learn (5.56 -> 3.43). The Shakespeare model over 1000 steps: benchmarks/precision.py."""
    runs = {p: run_tiny(f"parallel.precision={p}", "parallel.mesh=1", "data.kind=stdlib", "data.path=",
                        "train.steps=40", "train.log_every=1", "optim.lr=1e-2", devices=jax.devices()[:1])
            for p in ("fp32", "fp16")}
    (_, fp32, _), (trainer, fp16, _) = runs["fp32"], runs["fp16"]
    assert len(fp32) == len(fp16) == 40
    gap = np.max(np.abs(fp16 - fp32) / fp32)
    print(f"largest loss gap fp16 vs fp32 over 40 steps: {gap:.3%}; last {fp32[-1]:.4f} vs {fp16[-1]:.4f}")
    assert gap < 0.02, (fp16, fp32)
    assert fp32[-1] < fp32[0] - 0.5 and fp16[-1] < fp16[0] - 0.5  # both learned
    scales = [r["loss_scale"] for r in trainer.history if "loss" in r]
    assert all(1 <= s <= 65536 for s in scales)


def test_an_overflow_skips_the_step_and_halves_the_scale_good_steps_double_it():
    trainer, _, _ = run_tiny(FP16, "parallel.mesh=1", devices=jax.devices()[:1])
    batch = trainer.train_batches(0)
    state = jax.tree.map(jnp.copy, trainer.state)  # the step donates its input: the shared run's state stays
    # 2^40 x the loss: the fp16 backward overflows (its largest finite value is 65504).
    state["loss_scale"] = {**state["loss_scale"], "scale": jnp.float32(2.0 ** 40)}
    before = jax.device_get(state)
    after, metrics = trainer.compiled_step(state, batch)
    after = jax.device_get(after)
    assert bool(metrics["finite"]) and np.isfinite(float(metrics["loss"]))  # not a bad step for the guard
    assert not np.isfinite(float(metrics["grad_norm"]))
    assert after["loss_scale"]["scale"] == 2.0 ** 39
    assert after["loss_scale"]["overflows"] == before["loss_scale"]["overflows"] + 1
    assert after["skipped_steps"] == before["skipped_steps"] and after["step"] == before["step"] + 1
    for key in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(before[key]), jax.tree.leaves(after[key])):
            np.testing.assert_array_equal(a, b)

    # The window's last good step doubles the scale and restarts the count; the update is applied.
    window = trainer.cfg.parallel.loss_scale_window
    state["loss_scale"] = {"scale": jnp.float32(1024.0), "good_steps": jnp.int32(window - 1),
                           "overflows": jnp.int32(0)}
    grown, metrics = trainer.compiled_step(state, batch)
    assert float(grown["loss_scale"]["scale"]) == 2048.0 and int(grown["loss_scale"]["good_steps"]) == 0
    assert float(metrics["loss_scale"]) == 1024.0  # the scale this step used
    assert not np.array_equal(jax.device_get(grown["params"]["embedding"]), before["params"]["embedding"])


def test_the_scale_rules():
    plan = ParallelPlan(precision="fp16", loss_scale_initial=8.0, loss_scale_window=3, loss_scale_min=2.0)
    state = {"scale": jnp.float32(8.0), "good_steps": jnp.int32(1), "overflows": jnp.int32(0)}
    yes, no = jnp.bool_(True), jnp.bool_(False)
    run = lambda s, loss_ok, grads_ok: jax.device_get(update_loss_scale(plan, s, loss_ok, grads_ok))
    new, overflow, bad = run(state, yes, no)  # overflow: halve, restart the count
    assert (new["scale"], new["good_steps"], new["overflows"], overflow, bad) == (4.0, 0, 1, True, False)
    new, overflow, bad = run({**state, "scale": jnp.float32(2.0)}, yes, no)  # at the minimum: a bad step
    assert (new["scale"], overflow, bad) == (2.0, False, True)
    new, overflow, bad = run(state, no, no)  # a NaN/Inf loss is the guard's, whatever the scale
    assert (new["scale"], new["good_steps"], overflow, bad) == (8.0, 0, False, True)
    new, _, bad = run({**state, "good_steps": jnp.int32(2)}, yes, yes)  # the window's third good step
    assert (new["scale"], new["good_steps"], bad) == (16.0, 0, False)
    fp32 = ParallelPlan(precision="fp32")  # outside fp16: nothing changes, a nonfinite gradient is bad
    new, overflow, bad = jax.device_get(update_loss_scale(fp32, state, yes, no))
    assert (new["scale"], overflow, bad) == (8.0, False, True)


@pytest.mark.parametrize("mesh", ["data=2,fsdp=4", "pipeline=2,data=4"])
def test_every_executor_scales_the_same_objective(mesh):
    """The manual data-parallel step (with accumulation) and the pipeline differentiate scale x
    objective and unscale like one device: a missing factor would put the gradients off by 2^16."""
    _, losses, _ = one = run_tiny(FP16, "parallel.mesh=1", devices=jax.devices()[:1])
    trainer, other_losses, _ = run_tiny(FP16, f"parallel.mesh={mesh}", "parallel.microbatches=2")
    np.testing.assert_allclose(other_losses, losses, rtol=1e-3)
    np.testing.assert_allclose(trainer.grad_norms, one[0].grad_norms, rtol=1e-2)


def test_resume_restores_the_scale_bitwise_on_any_mesh(tmp_path, caplog):
    # An initial scale of 2^30 overflows until it falls; a window of 2 then doubles it: a moving scale.
    overrides = (FP16, "parallel.loss_scale_initial=1073741824", "parallel.loss_scale_window=2", "train.steps=8")
    straight = Trainer(tiny_config(*overrides, "parallel.mesh=fsdp=8", out=str(tmp_path / "straight")))
    quiet_fit(straight)
    interrupted = Trainer(tiny_config(*overrides, "parallel.mesh=fsdp=8", out=str(tmp_path / "run")))
    quiet_fit(interrupted, 4)
    saved = jax.device_get(interrupted.state["loss_scale"])
    assert saved["overflows"] > 0
    resumed = Trainer(tiny_config(*overrides, "parallel.mesh=data=2,tensor=4", "checkpoint.resume=auto",
                                  out=str(tmp_path / "run")))
    assert jax.device_get(resumed.state["loss_scale"]) == saved
    quiet_fit(resumed)
    final = lambda t: jax.device_get(t.state["loss_scale"])
    assert final(resumed) == final(straight)

    # A checkpoint of an earlier version (no loss_scale) resumes with a fresh scale. Its folder holds what
    # that version wrote: the checkpoints and config.yaml (no run.json, which is rebuilt from the checkpoint).
    old = {k: v for k, v in resumed.state.items() if k != "loss_scale"}
    checkpointer = Checkpointer(tmp_path / "old" / "checkpoints", keep=1)
    checkpointer.save(old, {"config": to_dict(resumed.cfg), "mesh": "fsdp=8", "devices": 8, "skip_batches": []})
    checkpointer.close()  # saved, and its manager's threads ended
    (tmp_path / "old" / "config.yaml").write_text((tmp_path / "run" / "config.yaml").read_text())
    caplog.clear()
    fresh = Trainer(tiny_config(*overrides, "parallel.mesh=fsdp=8", "checkpoint.resume=auto",
                                out=str(tmp_path / "old")))
    assert "has no 'loss_scale' in this run's layout; it starts fresh" in caplog.text  # a notice, logged
    assert float(fresh.state["loss_scale"]["scale"]) == 2.0 ** 30 and int(fresh.state["step"]) == 8
    fresh.close()
