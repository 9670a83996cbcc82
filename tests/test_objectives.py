"""The executors know no objective (issue 54): an objective none of them has seen, written here
against the protocol of meshtrain/objectives/base.py alone, trains the same step on every executor:
XLA's partitioned accumulation, the manual data-parallel shard_map, and pipelines (with data shards,
and interleaved over fsdp). It uses every seam a new objective has: a forward-only pass before the
gradients (`scores_first`: on a pipeline through the stages), per-row extras split with the rows,
a shared value, and a divisor of the gradients (`finish`). Each registered objective is proven on
its own: next-token training by tests/test_pipeline.py's parity table (every schedule) and
tests/test_sft.py / test_mtp.py, DPO by tests/test_dpo.py (the flat executors and a pipeline)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from meshtrain.core.errors import UserError
from meshtrain.engine.program import TrainProgram
from meshtrain.objectives import OBJECTIVES, Objective
from meshtrain.objectives.base import run_trunk
from meshtrain.ops.precision import cast_for_compute


def row_losses(model, params, x_NxLxD, targets_NxL):
    """[N]: each row's mean next-token cross-entropy, from the final hidden state."""
    logp = jax.nn.log_softmax(model.head(params, x_NxLxD).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets_NxL[..., None], -1)[..., 0], axis=-1)


class RowWeighted(Objective):
    """Next-token cross-entropy with a weight per row from a forward pass before the step, as
    importance weights are: w_b = 1 / (1 + ce_b(params before the step)), the objective
    sum_b w_b ce_b / sum_b w_b. Each microbatch's loss is mean_b(w_b ce_b); the step's mean of them
    over the batch is divided by mean_b(w_b), a shared value."""
    name = "row_weighted_test"
    scores_first = True

    def step_inputs(self, state, tokens, score):
        weights_B = 1.0 / (1.0 + score(cast_for_compute(state["params"], self.precision), {"tokens": tokens}))
        return {"tokens": tokens, "weights": weights_B}, {"weight_mean": jnp.mean(weights_B)}

    def extras(self, rows):
        return rows.get("weights")

    def head(self, shared):
        def weighted(p_outer, y, micro):
            loss = jnp.mean(micro.extras * row_losses(self.model, p_outer, y, micro.targets))
            return loss, {"loss": loss}

        return weighted

    def finish(self, metrics, rows, shared):
        return {**metrics, "loss": metrics["loss"] / shared["weight_mean"]}, shared["weight_mean"]

    def scores(self, params, rows):
        params, x, micro, _ = run_trunk(self.model, self.model.block, self.precision, params, rows["tokens"])
        return row_losses(self.model, params, x, micro.targets)

    def score_head(self, p_outer, y, micro):
        return row_losses(self.model, p_outer, y, micro.targets)


def one_step(mesh: str, n: int, *extra):
    """(the first step's metrics, the parameters after it) of RowWeighted on `mesh` (n devices)."""
    cfg = tiny_config(f"parallel.mesh={mesh}", "parallel.precision=fp32", f"train.objective={RowWeighted.name}",
                      "train.batch_size=8", *extra)
    program = TrainProgram.from_config(cfg, devices=jax.devices()[:n])
    tokens = jax.random.randint(jax.random.key(7), program.batch_shape, 0, cfg.model.vocab_size)
    with program.context():
        state = jax.jit(program.init_state, out_shardings=program.state_shardings)(jax.random.key(cfg.train.seed))
        params = jax.device_get(state["params"])
        new, metrics = program.lower().compile()(state, jax.device_put(tokens, program.batch_sharding))
    return program, params, tokens, jax.device_get(metrics), jax.device_get(program.in_model_order(new["params"]))


# XLA's accumulation; manual data shards; a pipeline with data shards; an interleaved one beside fsdp
LAYOUTS = {"fsdp=2,tensor=2": ("fsdp=2,tensor=2", 4, "parallel.microbatches=2"),
           "data=2": ("data=2", 2, "parallel.microbatches=2"),
           "data=2,pipeline=2 gpipe": ("data=2,pipeline=2", 4, "parallel.schedule=gpipe", "parallel.microbatches=2"),
           "fsdp=2,pipeline=2 interleaved": ("fsdp=2,pipeline=2", 4, "parallel.schedule=interleaved",
                                             "parallel.virtual_stages=2", "parallel.microbatches=2")}


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, RowWeighted.name, RowWeighted)


def test_an_objective_no_executor_knows_trains_alike_on_every_executor(registered):
    program, params, tokens, metrics, want = one_step("1", 1)
    _, x, micro, _ = run_trunk(program.model, program.model.block, "fp32", params, tokens)
    ce = np.asarray(row_losses(program.model, params, x, micro.targets))
    weights = 1 / (1 + ce)
    np.testing.assert_allclose(metrics["loss"], np.sum(weights * ce) / np.sum(weights), rtol=1e-5)
    for layout, (mesh, n, *extra) in LAYOUTS.items():
        _, _, _, got_metrics, got = one_step(mesh, n, *extra)
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(got_metrics[key], metrics[key], rtol=1e-5, err_msg=f"{layout} {key}")
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        assert diff < 1e-5, (layout, diff)


@pytest.mark.fast
def test_an_unregistered_objective_is_one_error():
    with pytest.raises(UserError, match="train.objective='ppo' is not one of sft, dpo, grpo"):
        tiny_config("train.objective=ppo")

