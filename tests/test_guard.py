"""Nonfinite guard: a NaN/Inf step updates nothing and is counted; a run of them rolls back to the
last checkpoint and skips the offending batches, reproducing a run that never saw them."""
import json

import jax
import numpy as np
import pytest
from conftest import tiny_config

from meshtrain.config.loader import UserError
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

STEPS, BAD = 10, (5, 6)  # batches 5 and 6 (steps 6 and 7) are poisoned


def poison(trainer, bad_batches):
    """Feed a token id outside the vocabulary in the given batches: the embedding lookup turns it
    into NaN, as a corrupt shard of data would."""
    clean = trainer.train_batches

    def batches(index):
        batch = clean(index)
        if index not in bad_batches:
            return batch
        tokens = np.array(batch)
        tokens[0, 0] = trainer.cfg.model.vocab_size
        return jax.device_put(tokens, trainer.program.batch_sharding)

    trainer.train_batches = batches
    return trainer


def fit(trainer, steps):
    history = trainer.fit(steps, log=MetricsLog("/tmp/meshtrain-tests", primary=False))
    return {r["step"]: r["loss"] for r in history if "loss" in r}


@pytest.fixture(scope="module")
def never_saw_bad_batches():
    """The run the guard must reproduce: batches 5 and 6 skipped from the start."""
    trainer = Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}"))
    trainer.skip_batches = list(BAD)
    losses = fit(trainer, STEPS)
    return trainer, losses, jax.device_get(trainer.state["params"])


def test_nonfinite_step_leaves_params_and_optimizer_unchanged(never_saw_bad_batches):
    trainer, _, _ = never_saw_bad_batches
    before = jax.device_get(trainer.state)
    tokens = np.array(trainer.train_batches(0))
    tokens[3, 2] = trainer.cfg.model.vocab_size
    state, metrics = trainer.compiled_step(trainer.state, jax.device_put(tokens, trainer.program.batch_sharding))
    after = jax.device_get(state)
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    assert int(metrics["skipped_steps"]) == int(before["skipped_steps"]) + 1
    assert int(after["step"]) == int(before["step"]) + 1  # the data position still advances
    for key in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(before[key]), jax.tree.leaves(after[key])):
            np.testing.assert_array_equal(a, b)
    trainer.state = state


def test_consecutive_nonfinite_steps_roll_back_and_skip_the_batches(never_saw_bad_batches, capsys, tmp_path):
    _, reference_losses, reference_params = never_saw_bad_batches
    trainer = poison(Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}", "checkpoint.every=4",
                                         "guard.max_consecutive_bad=2", out=str(tmp_path))), set(BAD))
    history = trainer.fit(STEPS, log=MetricsLog(tmp_path / "log"))
    losses = {r["step"]: r["loss"] for r in history if "loss" in r}
    # the rollback retrained steps 5-7: metrics.jsonl (and the history) hold each step once
    logged = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in history if "loss" in r] == list(range(1, STEPS + 1))
    captured = capsys.readouterr()
    err = captured.err
    assert "guard: 2 NaN/Inf steps in a row; rolled back to step 4" in captured.out
    assert "warning: step 6: loss or gradients are NaN/Inf; update skipped (1 in a row)" in err
    assert "(2 in a row)" in err
    assert trainer.skip_batches == list(BAD) and trainer.guard.rollbacks == 1
    for step in range(5, STEPS + 1):  # after the rollback to step 4: bitwise the clean run
        assert losses[step] == reference_losses[step], step
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state["params"])), jax.tree.leaves(reference_params)):
        np.testing.assert_array_equal(a, b)

    # A run that keeps diverging after guard.max_rollbacks stops with an error, its state saved.
    trainer.cfg.guard.max_rollbacks = 1
    poison(trainer, set(range(STEPS, STEPS + 100)))
    with pytest.raises(UserError, match="still diverging after 1 rollbacks; state saved to"):
        fit(trainer, STEPS + 6)


def test_a_rollback_with_only_a_local_checkpoint_uses_it(never_saw_bad_batches, capsys, tmp_path):
    """No persistent checkpoint yet, a local one at step 4 (checkpoint.local_dir): the guard rolls back
    to it, and the run is bitwise the one that never saw the bad batches."""
    _, reference_losses, reference_params = never_saw_bad_batches
    trainer = poison(Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}", "checkpoint.every=0",
                                         f"checkpoint.local_dir={tmp_path / 'nvme'}", "checkpoint.local_every=4",
                                         "guard.max_consecutive_bad=2", out=str(tmp_path / "run"))), set(BAD))
    losses = fit(trainer, STEPS)
    assert "guard: 2 NaN/Inf steps in a row; rolled back to step 4 (local tier, " in capsys.readouterr().out
    for step in range(5, STEPS + 1):
        assert losses[step] == reference_losses[step], step
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state["params"])), jax.tree.leaves(reference_params)):
        np.testing.assert_array_equal(a, b)


def test_a_streak_ending_on_a_save_step_rolls_back_before_the_save(tmp_path, capsys):
    """Batches 6 and 7 (steps 7 and 8) are bad: step 8, a save step, is judged at once, before its
    save, and ends the streak there. The rollback is the same as one judged a step later (the test
    above): each step logged once, then bitwise the run that never saw those batches."""
    reference = Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}"))
    reference.skip_batches = [6, 7]
    reference_losses = fit(reference, STEPS)
    trainer = poison(Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}", "checkpoint.every=4",
                                         "guard.max_consecutive_bad=2", out=str(tmp_path))), {6, 7})
    history = trainer.fit(STEPS, log=MetricsLog(tmp_path / "log"))
    logged = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, STEPS + 1))
    assert "guard: 2 NaN/Inf steps in a row; rolled back to step 4" in capsys.readouterr().out
    assert trainer.skip_batches == [6, 7] and trainer.guard.rollbacks == 1
    losses = {r["step"]: r["loss"] for r in history if "loss" in r}
    for step in range(5, STEPS + 1):
        assert losses[step] == reference_losses[step], step


def test_no_checkpoint_inside_a_bad_streak_and_the_logged_lr_is_the_applied_one(tmp_path):
    """Batches 3 and 4 (steps 4 and 5) are bad: the step-4 save waits for the first good step, 6;
    the optimizer's count, and so the learning rate, does not advance on skipped steps."""
    trainer = poison(Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}", "checkpoint.every=4",
                                         "checkpoint.keep=10", out=str(tmp_path))), {3, 4})
    history = {r["step"]: r for r in trainer.fit(log=MetricsLog("/tmp/meshtrain-tests", primary=False))
               if "loss" in r}
    assert trainer.checkpointer.steps() == [10, 8, 6]
    assert [history[s]["skipped_steps"] for s in (3, 4, 5, 6)] == [0, 1, 2, 2]
    applied_updates = {3: 2, 4: 3, 5: 3, 6: 3, 7: 4}  # good updates before each step
    for step, count in applied_updates.items():
        assert history[step]["lr"] == pytest.approx(float(trainer.program.schedule(count)), rel=1e-6), step


def test_preemption_inside_a_bad_streak_saves_nothing(tmp_path, capsys):
    import os
    import signal

    trainer = poison(Trainer(tiny_config("parallel.mesh=fsdp=8", f"train.steps={STEPS}", "checkpoint.every=2",
                                         "data.prefetch=0", out=str(tmp_path))), {3, 4})  # built in the loop
    batches = trainer.train_batches

    def sigterm_during_batch_4(index):
        if index == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: finish the step, then stop
        return batches(index)

    trainer.train_batches = sigterm_during_batch_4
    fit(trainer, STEPS)
    assert trainer.preempted and trainer.checkpointer.steps() == [2]  # not 4 (bad), nor 5 (bad)
    assert "preempted at step 5: not saved (inside a NaN/Inf streak)" in capsys.readouterr().out
