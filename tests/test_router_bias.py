"""Aux-loss-free balancing and the sequence-wise balance loss (issue 41, section 1): the expert
loads against a count of the routing, the balance loss against DeepSeek-V3's eq. 17-20 in numpy,
the step's bias update against numpy's sign rule on the step's counts (two microbatches, one
device), the update driving a skewed router toward balance, and the router bias never the
optimizer's. Parity of the biases on data x expert and on pipelines: tests/test_deepseek_v3.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, run_tiny, tiny_config

from meshtrain.config.loader import UserError, load_config
from meshtrain.engine.program import TrainProgram
from meshtrain.models import FAMILIES
from meshtrain.models.experts import Router, moe_mlp, route
from meshtrain.parallel.batching import inputs_and_targets
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

TINY = str(ROOT / "configs" / "deepseek_v3_tiny.yaml")
RATE = 0.01


@pytest.mark.fast
def test_loads_count_the_routing_and_the_balance_loss_is_eq_17_to_20():
    B, L, D, F, E, K = 4, 8, 16, 8, 8, 2
    rng = np.random.default_rng(0)
    x, router = rng.normal(size=(B, L, D)).astype(np.float32), rng.normal(size=(D, E)).astype(np.float32)
    w = [(rng.normal(size=s) / 4).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    bias = rng.uniform(-0.2, 0.2, E).astype(np.float32)
    sigmoid = Router("sigmoid", normalize=True, scale=2.5)
    _, stats = jax.jit(lambda *a: moe_mlp(*a, experts_per_token=K, capacity_factor=0.0, router=sigmoid,
                                          bias_E=bias))(x, router, *w)
    expert_BxLxK = np.asarray(route(x, router, K, sigmoid, bias)[2])
    np.testing.assert_array_equal(np.round(np.asarray(stats["load"]) * B * L * K),
                                  np.bincount(expert_BxLxK.ravel(), minlength=E))
    # eq. 17-20, per sequence: f_i = E / (K T) count_i, P_i = the mean of s_i / sum_j s_j; mean over sequences
    s = 1 / (1 + np.exp(-np.einsum("bld,de->ble", x.astype(np.float64), router)))
    P_BxE = (s / s.sum(-1, keepdims=True)).mean(axis=1)
    f_BxE = np.stack([E / (K * L) * np.bincount(e.ravel(), minlength=E) for e in expert_BxLxK])
    np.testing.assert_allclose(float(stats["aux_loss"]), np.mean(np.sum(f_BxE * P_BxE, axis=-1)), rtol=1e-6)


@pytest.fixture(scope="module")
def stepping():
    """The tiny deepseek_v3 on one device, two microbatches, the bias update on: (program, jitted step)."""
    cfg = load_config(TINY, [f"model.router_bias_update_rate={RATE}", "parallel.microbatches=2"])
    program = TrainProgram(cfg.model, cfg.parallel, cfg.optim, cfg.train, devices=jax.devices()[:1])
    return program, jax.jit(program.step_fn)


def test_the_step_moves_each_bias_by_the_sign_of_its_layers_global_imbalance(stepping):
    program, step = stepping
    model, c = program.model, program.model.cfg
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, c.vocab_size, program.batch_shape), jnp.int32)
    with program.context():
        state = program.init_state(jax.random.key(0))
        state["params"]["blocks"]["router_bias"] = jnp.asarray(np.random.default_rng(1).uniform(-0.05, 0.05, (2, 8)),
                                                               jnp.float32)
        params = state["params"]
        new, metrics = step(state, tokens)
        # the routing of the whole batch at once, layer by layer
        x = model.embed(params, inputs_and_targets(tokens, None)[0])
        counts = []
        for i in range(c.num_layers - c.first_k_dense_replace):
            x, stats = model.block(jax.tree.map(lambda w, i=i: w[i], params["blocks"]), x)
            counts.append(np.round(np.asarray(stats["expert_load"]) * tokens.shape[0] * c.experts_per_token
                                   * (tokens.shape[1] - 1)))
    count = np.asarray(metrics["expert_load"])
    np.testing.assert_array_equal(count, np.stack(counts))
    bias0, bias1 = (np.asarray(s["params"]["blocks"]["router_bias"]) for s in (state, new))
    expected = bias0 + np.float32(RATE) * np.sign(count.mean(-1, keepdims=True) - count).astype(np.float32)
    np.testing.assert_array_equal(bias1, expected)
    assert float(metrics["batch_load_max"]) == count.max() / count.mean()
    assert "router_bias" not in program.trained(new["params"])["blocks"]  # never the optimizer's


def test_the_bias_drives_a_skewed_router_toward_balance(stepping):
    """Experts 0 and 1 start 0.08 ahead of the rest (the busiest then takes 1.92x the mean count):
    8 steps at rate 0.01 bring it to 1.36x (fp32 on CPU, fixed seeds)."""
    program, step = stepping
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, program.batch_shape), jnp.int32)
    with program.context():
        state = program.init_state(jax.random.key(0))
        state["params"]["blocks"]["router_bias"] = jnp.zeros((2, 8)).at[:, :2].set(0.08)
        loads = []
        for _ in range(8):
            state, metrics = step(state, tokens)
            loads.append(float(metrics["batch_load_max"]))
    print("batch load max/mean per step:", loads)
    assert loads[0] > 1.8 and loads[-1] < 0.75 * loads[0]


def test_a_resumed_run_continues_the_biases_bitwise(tmp_path):
    overrides = ("parallel.mesh=1", f"model.router_bias_update_rate={RATE}")  # test_deepseek_v3.py's run
    _, _, straight = run_tiny(*overrides, devices=jax.devices()[:1], config=TINY)
    one = jax.devices()[:1]
    interrupted = Trainer(tiny_config(*overrides, out=str(tmp_path), config=TINY), devices=one)
    interrupted.fit(2, log=MetricsLog(interrupted.out, primary=False))
    saved = np.asarray(interrupted.state["params"]["blocks"]["router_bias"])
    resumed = Trainer(tiny_config(*overrides, "checkpoint.resume=auto", out=str(tmp_path), config=TINY), devices=one)
    assert int(resumed.state["step"]) == 2 and np.any(saved)
    np.testing.assert_array_equal(np.asarray(resumed.state["params"]["blocks"]["router_bias"]), saved)
    resumed.fit(log=MetricsLog(resumed.out, primary=False))
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state["params"])), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.fast
@pytest.mark.parametrize("config", ["moe_tiny", "qwen3_moe_tiny"])
def test_the_other_families_get_a_selection_bias_only_with_the_update_on(config):
    path = str(ROOT / "configs" / f"{config}.yaml")
    for rate in (0.0, 0.001):
        spec = load_config(path, [f"model.router_bias_update_rate={rate}"]).model
        params = jax.eval_shape(FAMILIES[spec.family](spec).init, jax.random.key(0))
        assert ("router_bias" in params["blocks"]) == bool(rate)
    assert params["blocks"]["router_bias"].shape == (spec.num_layers, spec.num_experts)
    assert not spec.trainable(("blocks", "router_bias")) and spec.trainable(("blocks", "router"))
    with pytest.raises(UserError, match="selection bias has no .* form"):
        FAMILIES[spec.family].hf.write(spec)
