"""int8 gradient compression (meshtrain/parallel/compression.py): quantization within half a step, error
feedback telescopes, the compressed mean inside shard_map matches fp32 within the quantization
bound (zero 0/1 and 2/3 layouts, fp16's scale) and feeds its residuals back, the compiled step
moves int8 over `data` at under 0.3x the fp32 bytes, an fp16 overflow keeps the residuals, runs are
deterministic, train like fp32, and resume bitwise (fresh residuals on another data size, none
without compression)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, run_tiny, tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.parallel import compression
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.parallel.sharding import activation_rules
from meshtrain.planner import hlo, traffic
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

# The Shakespeare model's byte-level shape (configs/shakespeare_char.yaml), narrowed to train in
# seconds: standard-library text, data=8, zero 0 (so every byte over `data` is the gradient mean).
SMALL = ("parallel.mesh=data=8", "parallel.zero=0", "data.kind=stdlib", "data.path=", "model.d_model=64",
         "model.mlp_dim=192", "model.num_layers=2", "train.batch_size=16", "train.steps=100",
         "train.log_every=1", "train.eval_every=100", "train.eval_batches=4", "optim.lr=3e-3",
         "optim.warmup_steps=10", "checkpoint.every_minutes=0")
SHAKESPEARE = str(ROOT / "configs" / "shakespeare_char.yaml")
INT8 = "parallel.grad_compression=int8"


def small_run(*overrides):
    return run_tiny(*SMALL, *overrides, config=SHAKESPEARE)


def quiet_fit(trainer, steps=None):
    history = trainer.fit(steps, log=MetricsLog(trainer.out, primary=False))
    return np.array([r["loss"] for r in history if "loss" in r])


def test_quantize_round_trip_within_half_a_step():
    x = jax.random.normal(jax.random.key(0), (6, 256)) * jnp.logspace(-6, 3, 6)[:, None]  # scales far apart
    x = x.at[2].set(0.0)  # an all-zero block: scale 0, values 0
    q, s = compression.quantize(x)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32 and int(jnp.max(jnp.abs(q))) == 127
    err = jnp.abs(x - compression.dequantize(q, s))
    assert bool(jnp.all(err <= s[:, None] / 2 * (1 + 1e-6))), float(jnp.max(err / s[:, None]))
    assert float(s[2]) == 0 and bool(jnp.all(compression.dequantize(q, s)[2] == 0))
    blocks = compression.to_blocks(jnp.ones((3, 300)), 256)  # padded with zeros to whole blocks
    assert blocks.shape == (3, 2, 256) and float(blocks.sum()) == 900
    assert bool(jnp.isnan(compression.dequantize(*compression.quantize(x.at[4, 7].set(jnp.inf)))[4]).any())


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 12])
def test_error_feedback_telescopes(scale):
    """deq(q_k) + S e_{k+1} = c_k exactly (Sterbenz: they are within half a step), so over K steps
    sum deq(q_k) = S (sum g_k - e_K) up to the fp32 rounding of c = g + e. The residual is kept
    unscaled (e, not S e)."""
    K, e = 40, jnp.zeros((4, 64))
    sent, inputs = [], []
    for k in range(K):
        g = scale * jax.random.normal(jax.random.key(k), (4, 64)) * (1 + 100 * (k % 7 == 0))
        q, s, e_next = compression.with_feedback(g, e, scale)
        deq = compression.dequantize(q, s)
        np.testing.assert_array_equal(deq + scale * e_next, g + scale * e)  # exact, step by step
        assert bool(jnp.all(jnp.abs(e_next) <= s[..., None] / (2 * scale) * (1 + 1e-6)))
        sent.append(np.asarray(deq, np.float64))
        inputs.append(np.asarray(g, np.float64))
        e = e_next
    total = np.sum(inputs, axis=0)
    np.testing.assert_allclose(np.sum(sent, axis=0) + scale * np.asarray(e, np.float64), total,
                               atol=1e-5 * scale * K, rtol=0)
    assert np.max(np.abs(np.asarray(e))) > 0  # something was delayed, not lost


def natural(error, shape):
    """A 'shards' residual [N, ..., before, N, after, ...] back in its gradient's own shape, per shard."""
    return np.asarray(error).reshape(error.shape[0], *shape)


@pytest.mark.parametrize("zero,scale", [(1, 1.0), (2, 1.0), (1, 2.0 ** 10)])
def test_compressed_mean_inside_shard_map_matches_fp32(zero, scale):
    """data=8 shards with different gradients: the int8 mean equals the fp32 one within the bound,
    and exactly the fp32 mean of what was sent (mean g - mean e', and - e2 at zero 0/1). A second
    step, fed the first one's residuals, sends them too: over both steps the means telescope."""
    n = 8
    mesh = build_mesh(parse_mesh("data=8", 8))
    owned = {"a": P("data", None), "b": P(None, "data"), "c": P()}  # c: nothing divides by 8 -> fp32
    grad_specs = owned if zero >= 2 else {k: P() for k in owned}
    shapes = {"a": (16, 40), "b": (3, 24), "c": (3,)}
    reducer = compression.Int8Reduction(mesh, grad_specs, owned, block=64, zero=zero)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    _, error_specs = compression.error_shapes_and_specs(params, owned, dict(mesh.shape), zero)
    errors = compression.init_error(params, owned, dict(mesh.shape), zero)
    keys = iter(jax.random.split(jax.random.key(1), 6))
    # per-shard gradients with magnitudes spread over 4 decades, as real gradients are
    grads = lambda: {k: jax.random.normal(next(keys), (n, *s)) * jnp.logspace(-2, 2, n).reshape(n, *[1] * len(s))
                     for k, s in shapes.items()}
    g, g2 = grads(), grads()
    local = lambda specs: jax.tree.map(lambda s: P(*[e if e == "data" else None for e in s]), specs,
                                       is_leaf=lambda x: isinstance(x, P))

    def per_shard(g, errors):
        return reducer.reduce_mean(jax.tree.map(lambda x: x[0] * scale, g), errors, {"data"},
                                   jnp.float32(scale))

    with jax.set_mesh(mesh), activation_rules({}, mesh):
        fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=({k: P("data") for k in g}, local(error_specs)),
                                   out_specs=(local(grad_specs), local(error_specs)), axis_names={"data"},
                                   check_vma=False))
        errors = jax.device_put(errors, jax.tree.map(lambda s: NamedSharding(mesh, s), error_specs,
                                                     is_leaf=lambda x: isinstance(x, P)))
        first = fn(g, errors)
        reduced2, new2 = jax.device_get(fn(g2, first[1]))
        reduced, new = jax.device_get(first)
    # Each shard's error is at most half a step of its block, max|block| / 254 <= max|g_j| / 254 (a
    # block may span both compressed gradients), averaged over shards; at zero 0/1 plus half a step
    # of the mean's block.
    packed = lambda tree, axis: np.concatenate([np.asarray(tree[k], np.float64).reshape(*axis, -1) for k in "ab"], -1)
    bound = np.abs(packed(g, (n,))).max(axis=1).mean() / 254
    if zero <= 1:
        bound += np.abs(packed(g, (n,)).mean(axis=0)).max() / 254
    for k, shape in shapes.items():
        g_k = np.asarray(g[k], np.float64)
        mean = g_k.mean(axis=0)
        got = reduced[k] / scale
        if k == "c":
            np.testing.assert_allclose(got, mean, rtol=1e-6)  # averaged in fp32
            continue
        assert np.max(np.abs(got - mean)) <= bound * (1 + 1e-5), (k, np.max(np.abs(got - mean)), bound)
        assert np.max(np.abs(got - mean)) > 0  # it was quantized

        def residual(e, k=k, shape=shape):  # what the shards kept back, as the mean sees it
            kept = natural(e["shards"][k], shape).astype(np.float64).mean(axis=0)
            return kept + (np.asarray(e["owned"][k], np.float64).reshape(shape) if zero <= 1 else 0)

        np.testing.assert_allclose(got, mean - residual(new), atol=1e-6 * np.abs(g_k).max(), rtol=0)  # fp32 sums of 8
        # step 2 sends its gradients and step 1's residuals, laid out as the state keeps them
        g2_k = np.asarray(g2[k], np.float64)
        np.testing.assert_allclose(reduced2[k] / scale, g2_k.mean(axis=0) + residual(new) - residual(new2),
                                   atol=2e-6 * max(np.abs(g_k).max(), np.abs(g2_k).max()), rtol=0)


def test_compiled_step_moves_int8_at_under_0_3x_the_fp32_bytes():
    fp32, _, _ = small_run()
    int8, _, _ = small_run(INT8)
    plain = hlo.collectives(fp32.compiled_step.as_text(), 8)
    found = hlo.collectives(int8.compiled_step.as_text(), 8)
    total = lambda c: sum(k["traffic_bytes"] for k in c.values())
    print(f"data-parallel bytes per device per step: fp32 {total(plain):,.0f}, int8 {total(found):,.0f} "
          f"({total(found) / total(plain):.3f}x)")
    assert total(found) <= 0.3 * total(plain)  # measured 0.257x (int8, a scale per 256, rows padded to whole blocks)
    assert plain["all-reduce"]["traffic_bytes"] > 0.9 * total(plain)  # fp32: the gradient all-reduce
    for kind in ("all-to-all", "all-gather"):  # int8 values and one fp32 scale per 256 of them
        dtypes = found[kind]["dtypes"]
        assert set(dtypes) == {"s8", "f32"} and dtypes["f32"] == dtypes["s8"] * 4 / 256, (kind, dtypes)
    assert found["all-reduce"]["payload_bytes"] < 100  # only the metrics' mean is left in fp32
    assert found["reduce-scatter"]["count"] == 0
    # the planner's formula (python -m meshtrain.plan): the measured bytes add the rows' padding
    formula = traffic.expected_traffic(int8.program)
    for kind in ("all-to-all", "all-gather"):
        assert formula[kind]["traffic_bytes"] == pytest.approx(found[kind]["traffic_bytes"], rel=0.05)
    dp = traffic.data_parallel_traffic(int8.program)
    assert dp["compression"] == "int8" and dp["ratio"] == pytest.approx(0.25 + 1 / 256)
    assert dp["fp32_bytes"] == pytest.approx(plain["all-reduce"]["traffic_bytes"], rel=0.01)


def test_int8_trains_like_fp32():
    """100 steps of the small Shakespeare-shaped model on stdlib text, data=8."""
    fp32, _, _ = small_run()
    int8, _, _ = small_run(INT8)
    eval_loss = lambda t: [r["eval_loss"] for r in t.history if "eval_loss" in r][-1]
    a, b = eval_loss(fp32), eval_loss(int8)
    print(f"eval loss after 100 steps: fp32 {a:.4f}, int8 {b:.4f} ({(b - a) / a:+.3%})")
    # measured: fp32 2.7782, int8 2.7786 (+0.017%); the first loss is ~5.5
    assert abs(b - a) / a < 0.02 and a < 2.8


def test_int8_at_zero_2_beside_tensor_follows_fp32():
    """ZeRO-2 beside tensor: data is the minor factor of tensor's dimensions, so each shard owns a row
    of every tensor block (B > 1 in Int8Reduction) and the executor unfolds it (data_parallel.unfold).
    The tiny model's 5 losses stay within 1e-4 of fp32's (measured 1.3e-5)."""
    common = ("parallel.mesh=data=2,tensor=4", "parallel.zero=2", "parallel.microbatches=2")
    _, fp32, _ = run_tiny(*common)
    _, int8, _ = run_tiny(*common, INT8)
    np.testing.assert_allclose(int8, fp32, rtol=1e-4, atol=0)
    assert not np.array_equal(int8, fp32)  # compressed: not the fp32 sums


def test_an_fp16_overflow_keeps_the_residuals():
    """An overflowing step's residuals hold its Inf/NaN: the skipped step keeps the previous ones
    (meshtrain/engine/step.py), and an applied one moves them on."""
    trainer, _, _ = run_tiny("parallel.precision=fp16", INT8, "parallel.mesh=data=8")
    batch = trainer.train_batches(0)
    state = jax.tree.map(jnp.copy, trainer.state)  # the step donates its input: the shared run's state stays
    before = jax.device_get(state["grad_error"])
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(before)) > 0
    good = jax.tree.map(jnp.copy, state)
    state["loss_scale"] = {**state["loss_scale"], "scale": jnp.float32(2.0 ** 40)}  # the fp16 backward overflows
    after, metrics = trainer.compiled_step(state, batch)
    assert not np.isfinite(float(metrics["grad_norm"]))
    assert int(after["loss_scale"]["overflows"]) == int(good["loss_scale"]["overflows"]) + 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(after["grad_error"]), before)
    moved, _ = trainer.compiled_step(good, batch)
    moved = jax.device_get(moved["grad_error"])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(moved))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(before)))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The int8 run again, in its own folder, stopped (and checkpointed) at step 10."""
    out = tmp_path_factory.mktemp("int8")
    trainer = Trainer(tiny_config(*SMALL, INT8, out=str(out), config=SHAKESPEARE))
    losses = quiet_fit(trainer, 10)
    return out, losses, jax.device_get(trainer.state["grad_error"])


def test_two_runs_are_bitwise_equal(interrupted):
    _, straight, _ = small_run(INT8)
    np.testing.assert_array_equal(interrupted[1], straight[:10])


def test_resume_restores_the_residuals_bitwise_and_another_data_size_starts_them_fresh(interrupted, caplog):
    out, _, saved = interrupted
    _, straight, _ = small_run(INT8)
    resumed = Trainer(tiny_config(*SMALL, INT8, "checkpoint.resume=auto", out=str(out), config=SHAKESPEARE))
    restored = jax.device_get(resumed.state["grad_error"])
    jax.tree.map(np.testing.assert_array_equal, restored, saved)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(saved)) > 0
    np.testing.assert_array_equal(quiet_fit(resumed, 15), straight[10:15])

    caplog.clear()
    other = Trainer(tiny_config(*SMALL, INT8, "parallel.mesh=data=4,tensor=2", "checkpoint.resume=auto",
                                out=str(out), config=SHAKESPEARE))
    assert "has no 'grad_error' in this run's layout; it starts fresh" in caplog.text  # a notice, logged
    assert int(other.state["step"]) == 15
    assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(jax.device_get(other.state["grad_error"])))

    # compression off on resume (every parallel setting may change): the residuals are not read
    plain = Trainer(tiny_config(*SMALL, "checkpoint.resume=auto", out=str(out), config=SHAKESPEARE))
    assert "holds 'grad_error', which this run does not use; not read" in caplog.text
    assert int(plain.state["step"]) == 15 and "grad_error" not in plain.state


def test_tiny_blocks_are_refused_and_one_data_shard_compresses_nothing():
    from meshtrain.config.loader import UserError
    from meshtrain.engine.program import TrainProgram

    with pytest.raises(UserError, match=r"^parallel.compression_block=4 sends a 4-byte scale per 4 int8 values, "
                                        r"0.50x the fp32 bytes; use at least 16"):
        tiny_config(INT8, "parallel.compression_block=4")
    alone = TrainProgram.from_config(tiny_config(INT8, "parallel.mesh=fsdp=8"))  # data=1: nothing to reduce
    assert "grad_error" not in alone.abstract_state and "grad_error" not in alone.optional_state()
    odd = TrainProgram.from_config(tiny_config(INT8, "parallel.mesh=data=8", "parallel.compression_block=1000"))
    assert "grad_error" in odd.optional_state()  # a block larger than any row: rows are padded
