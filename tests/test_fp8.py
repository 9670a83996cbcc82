"""precision=fp8 (meshtrain/ops/fp8.py): the op's numerics (exact fp8 round trips, the einsum
equal to the scaled fp8 GEMM, gradients near fp32's), the compiled step quantizing
exactly the projections and the MLP, the tiny run tracking bf16, a sharded run matching one device,
a bitwise resume, and the planner's fp8 roofline and activation bytes."""
import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MOE_TINY, run_tiny, tiny_config

from meshtrain.core.errors import UserError
from meshtrain.core.formulas import llama_activation_terms
from meshtrain.core.metrics import DEVICE_PROFILES
from meshtrain.engine.program import TrainProgram
from meshtrain.ops.fp8 import (
    E4M3,
    E5M2,
    contracted_axes,
    dequantize,
    fp8_einsum,
    fp8_max,
    fp8_rowwise_einsum,
    quantize,
    transposed_specs,
)
from meshtrain.ops.platform import installed_cudnn, loaded_cudnn
from meshtrain.ops.precision import compute_bytes, saved_matmul_bytes
from meshtrain.ops.recipes import recipe_refusal
from meshtrain.planner import compilers, roofline
from meshtrain.run import dashboards, loggers
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

STEPS = 24
RUN = ("parallel.precision={}", "parallel.mesh=1", f"train.steps={STEPS}", "train.log_every=1")


def one_device(precision):
    return run_tiny(*(o.format(precision) for o in RUN), devices=jax.devices()[:1])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_representable_values_round_trip_exactly(dtype):
    """Every finite value of the format, times fmax / its amax (so the scale is exactly 1), comes back
    bitwise, and so does a quarter of it (scale 1/4); an all-zero tensor gets scale 1 (no division
    by zero)."""
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    values = values[np.isfinite(values)]
    assert np.max(np.abs(values)) == fp8_max(dtype)  # 448 (e4m3fn), 57344 (e5m2)
    round_trip = jax.jit(lambda t: (quantize(t, dtype), dequantize(*quantize(t, dtype))))
    for t, scale in ((values, 1.0), (values / 4, 0.25), (np.zeros(8, np.float32), 1.0)):
        (q, s), back = round_trip(t)
        assert float(s) == scale and q.dtype == dtype
        np.testing.assert_array_equal(np.asarray(back), t)


SPECS = {"bld,dhk->blhk": ((2, 8, 32), (32, 4, 8)), "blhk,hkd->bld": ((2, 8, 4, 8), (4, 8, 32)),
         "bnecd,edf->bnecf": ((2, 1, 3, 4, 32), (3, 32, 16))}  # q/k/v, the output projection, MoE experts


def results(spec, x32, w32, g32):
    """fp8_einsum's output and gradients; the fp8 GEMM's by its definition (the fp8 values as fp32,
    fp32 sums rounded to bf16 (the GEMM's output type), the product of the two scales applied in fp32,
    rounded to bf16 again), each gradient the vjp of the fp32 einsum of the fp8 values applied to the
    e5m2 cotangent; and fp32's."""
    x, w, g = (t.astype(jnp.bfloat16) for t in (x32, w32, g32))
    y, vjp = jax.vjp(functools.partial(fp8_einsum, spec), x, w)
    (qx, sx), (qw, sw), (qg, sg) = quantize(x, E4M3), quantize(w, E4M3), quantize(g, E5M2)
    f32 = lambda t: t.astype(jnp.float32)
    gemm, gemm_vjp = jax.vjp(functools.partial(jnp.einsum, spec), f32(qx), f32(qw))
    dx, dw = gemm_vjp(f32(qg))
    scaled = lambda t, a, b: (f32(t.astype(jnp.bfloat16)) * (f32(a) * f32(b))).astype(jnp.bfloat16)
    y32, vjp32 = jax.vjp(functools.partial(jnp.einsum, spec), x32, w32)
    return (y, *vjp(g)), (scaled(gemm, sx, sw), scaled(dx, sg, sw), scaled(dw, sx, sg)), (y32, *vjp32(g32))


@pytest.fixture(scope="module")
def einsums():
    """`results` of every spec, in one jitted program (one compile)."""
    rng, inputs = np.random.default_rng(0), {}
    for spec, (xs, ws) in SPECS.items():
        out = np.einsum(spec, np.zeros(xs), np.zeros(ws)).shape
        inputs[spec] = tuple(rng.standard_normal(shape).astype(np.float32) * scale
                             for shape, scale in ((xs, 1.0), (ws, 0.1), (out, 1.0)))
    return jax.jit(lambda inputs: {spec: results(spec, *args) for spec, args in inputs.items()})(inputs)


@pytest.mark.parametrize("spec", SPECS)
def test_the_fp8_einsum_is_the_scaled_fp8_gemm_and_its_gradients_track_fp32(einsums, spec):
    fp8, gemm, fp32 = einsums[spec]
    assert all(t.dtype == jnp.bfloat16 for t in fp8)
    for got, want in zip(fp8, gemm):  # forward: e4m3 operands; backward: e4m3 residuals, e5m2 cotangent
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # Against fp32: e4m3 rounds to 3 mantissa bits (relative error up to 2^-4, ~3.6% rms), e5m2 to 2
    # (2^-3); sums of products keep about the operands' rms error. Measured: 3.7-6.3% (y, dx, dw).
    errors = [np.linalg.norm(np.asarray(a, np.float32) - b) / np.linalg.norm(b) for a, b in zip(fp8, fp32)]
    print(spec, [f"{e:.1%}" for e in errors])
    assert max(errors) < 0.1


def numpy_rowwise(spec, a, b, a_dtype, b_dtype):
    """fp8_rowwise's GEMM by its definition, in NumPy with ml_dtypes' fp8 casts: per slice along the
    axes the GEMM contracts, s = 2^ceil(log2(amax / fmax)) (1 for a zero slice); the fp8 values'
    products summed in fp32, times the scales' outer product, rounded to bf16 once (the GEMM writes its
    sum in bf16 and then scales it: by powers of 2, the same bits)."""
    import ml_dtypes

    def quantized(t, dtype, axes):
        fmax = float(ml_dtypes.finfo(dtype).max)
        amax = np.max(np.abs(t), axis=axes, keepdims=True).astype(np.float64)
        with np.errstate(divide="ignore"):  # float64's log2 is exact at powers of 2
            s = np.where(amax > 0, 2.0 ** np.ceil(np.log2(amax / fmax)), 1.0)
        assert np.all((s / 2 < amax / fmax) | (amax == 0))  # the smallest such power
        s = s.astype(np.float32)
        assert np.all(np.abs(t / s) <= fmax)  # the power of 2 rounds the scale up: nothing saturates
        return (t / s).astype(dtype).astype(np.float32), s

    (qa, sa), (qb, sb) = (quantized(np.asarray(t, np.float32), d, axes)
                          for t, d, axes in zip((a, b), (a_dtype, b_dtype), contracted_axes(spec)))
    return (np.einsum(spec, qa, qb) * np.einsum(spec, sa, sb)).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("spec", SPECS)
def test_the_rowwise_einsum_is_numpys_rowwise_fp8_gemm_forward_and_backward(spec):
    """fp8_rowwise: y, dx and dw each the row-scaled fp8 GEMM of its own contraction (dx: the e5m2
    cotangent and w scaled over w's outputs; dw: x and the cotangent scaled over the tokens); an
    outlier row costs its own row's precision only."""
    rng = np.random.default_rng(1)
    xs, ws = SPECS[spec]
    x, w = (jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16) for shape, scale in ((xs, 1.0), (ws, 0.1)))
    x = x.at[(0,) * (x.ndim - 1)].multiply(2.0**16)  # one outlier row
    y, vjp = jax.vjp(functools.partial(fp8_rowwise_einsum, spec), x, w)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    dx, dw = vjp(g)
    dx_spec, dw_spec = transposed_specs(spec)
    wants = (numpy_rowwise(spec, x, w, E4M3, E4M3), numpy_rowwise(dx_spec, g, w, E5M2, E4M3),
             numpy_rowwise(dw_spec, x, g, E4M3, E5M2))
    for got, want in zip((y, dx, dw), wants):  # products of fp8 values and powers of 2 are exact in fp32
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    # Beside the outlier, y keeps fp8's precision against fp32; a per-tensor scale loses it there.
    x32, w32 = (np.asarray(t, np.float32) for t in (x, w))
    exact, rest = np.einsum(spec, x32, w32), (slice(1, None),)
    error = lambda got: np.linalg.norm(np.asarray(got, np.float32)[rest] - exact[rest]) / np.linalg.norm(exact[rest])
    assert error(y) < 0.1 < error(fp8_einsum(spec, x, w)), (error(y), error(fp8_einsum(spec, x, w)))


@pytest.fixture(scope="module")
def runs():
    return {p: one_device(p) for p in ("bf16", "fp8", "fp8_rowwise")}


@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise"])
def test_the_tiny_fp8_run_tracks_bf16(runs, recipe):
    (_, bf16, _), (_, fp8, _) = runs["bf16"], runs[recipe]
    assert len(fp8) == STEPS and bf16[-1] < bf16[0] - 0.05  # it learned (the synthetic data's first steps)
    print(f"{recipe} vs bf16: at most {np.max(np.abs(fp8 - bf16) / bf16):.3%} apart over {STEPS} steps")  # 0.17%
    np.testing.assert_allclose(fp8, bf16, rtol=0.02)
    assert not np.array_equal(fp8, bf16)  # fp8 is not bf16


def test_an_fp8_run_logs_its_mfu_against_both_peaks(monkeypatch):
    """MFU keeps the bf16 peak (the convention); an fp8 run logs `mfu_fp8` against the fp8 peak beside
    it, a bf16 run does not. The steps load from the suite's compilation cache (the `runs` fixture's)."""
    monkeypatch.setattr("meshtrain.core.metrics.peak_flops",
                        lambda kind, peak="peak_flops": {"peak_flops": 989e12, "peak_fp8_flops": 1979e12}[peak])
    metrics = {"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "skipped_steps": 0}
    records = {}
    for precision in ("bf16", "fp8"):
        trainer = Trainer(tiny_config(*(o.format(precision) for o in RUN)), devices=jax.devices()[:1])
        trainer.close()
        assert (trainer.peak, trainer.peak_fp8) == (989e12, 1979e12 if precision == "fp8" else None)
        records[precision] = trainer.record(3, metrics, tokens_per_sec=1e9, step_time=1.0, data_wait=0.0)
    record = records["fp8"]
    assert record["mfu"] == pytest.approx(1e9 * trainer.program.flops_per_token / 989e12)
    assert record["mfu_fp8"] == pytest.approx(record["mfu"] * 989 / 1979)
    assert f"({record['tflops_per_device']:.0f} TFLOP/s/device; {record['mfu_fp8']:.1%} of the fp8 peak)" in \
        loggers.format_record(record)
    assert dashboards.tag("mfu_fp8") == "perf/mfu_fp8"
    assert records["bf16"]["mfu"] == record["mfu"] and "mfu_fp8" not in records["bf16"]


def shapes(text: str, dtype: str) -> set:
    return set(re.findall(rf"tensor<([0-9x]+)x{dtype}>", text))


def test_the_step_quantizes_the_projections_and_the_mlp_and_nothing_else(runs):
    """The lowered step's fp8 tensors are exactly the projections' and MLP's operands (e4m3: the
    seven weights of a layer and the three activations that enter them) and their outputs'
    cotangents (e5m2), alone or stacked over the layers (the scan's residuals), never the embedding
    or the head (whose shapes hold the vocabulary, 256); the compiled step converts to both."""
    trainer = runs["fp8"][0]
    text = trainer.program.lower().as_text()
    B, L, D, H, G, K, F = 16, 16, 32, 8, 4, 8, 64
    fmt = lambda dims: "x".join(map(str, dims))
    e4m3 = {fmt(s) for s in ((D, H, K), (D, G, K), (H, K, D), (D, F), (F, D), (B, L, D), (B, L, H, K), (B, L, F))}
    e5m2 = {fmt(s) for s in ((B, L, H, K), (B, L, G, K), (B, L, D), (B, L, F))}
    for dtype, expected in (("f8E4M3FN", e4m3), ("f8E5M2", e5m2)):
        found = shapes(text, dtype)
        unstacked = {next((e for e in expected if f == e or f.endswith("x" + e)), f) for f in found}
        assert unstacked == expected, dtype
        assert not any("256" in f for f in found)
    compiled = trainer.compiled_step.as_text()
    assert "f8e4m3fn[" in compiled and "f8e5m2[" in compiled
    assert "f8e4m3fn" not in runs["bf16"][0].compiled_step.as_text()


def test_capacity_routed_experts_run_in_fp8_and_dropless_ones_in_bf16():
    """models/experts.py: the capacity routing's expert einsums take the block's matmul; the dropless
    grouped matmuls do not. Lowered only: moe_tiny's [B, N, E, C, D] = [16, 1, 4, 10, 32] slot buffer
    (C = ceil(1.25 x 16 x 2 / 4)) enters the experts in e4m3, and the dense shared expert either way."""
    def lowered(capacity):
        cfg = tiny_config("parallel.precision=fp8", "parallel.mesh=1", f"model.capacity_factor={capacity}",
                          config=MOE_TINY)
        return shapes(TrainProgram.from_config(cfg, devices=jax.devices()[:1]).lower().as_text(), "f8E4M3FN")
    capacity, dropless = lowered(1.25), lowered(0.0)
    assert "16x1x4x10x32" in capacity and not any("x10x" in f for f in dropless)
    assert "32x32" in dropless  # the shared expert's [D, F] weights


def test_the_scale_of_a_sharded_tensor_is_the_whole_tensors():
    """Under jit a sharded tensor's amax is the global max (an all-reduce; max is exact in any
    order): its quantization equals one device's bitwise."""
    t = jax.random.normal(jax.random.key(1), (8, 16, 32)).astype(jnp.bfloat16)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    split = jax.device_put(t, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "x")))
    quantize_e4m3 = jax.jit(lambda t: quantize(t, E4M3))
    for got, want in zip(quantize_e4m3(split), quantize_e4m3(t)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise"])
def test_a_sharded_fp8_run_matches_one_device(runs, recipe):
    """data=2 x tensor=2 against one device. Along compiler-managed axes (tensor here) a tensor's
    scale is the whole tensor's (above); `data` runs manual (meshtrain/parallel/data_parallel.py), so
    each data shard scales its own rows' activations and gradients, as each GPU's GEMM would. The
    sharded matmuls also sum in another order in bf16, and a value that moves in bf16 can round to
    another fp8 neighbour (2^-3 apart): fp8 amplifies bf16's sharding noise about tenfold. Measured
    over 24 steps, the losses' largest relative difference: 0.13% (bf16 pair: 0.017%); with
    fsdp=2 x tensor=2, where every scale is global: 0.17% (bf16: 0.017%). fp8_rowwise: a row's scale
    is its own on every layout, but for dw's (over the tokens: each data shard's own)."""
    _, one, _ = runs[recipe]
    _, sharded, _ = run_tiny(*(o.format(recipe) for o in RUN if "mesh" not in o), "parallel.mesh=data=2,tensor=2",
                             devices=jax.devices()[:4])
    print(f"sharded {recipe} vs one device: at most {np.max(np.abs(sharded - one) / one):.3%} apart")
    np.testing.assert_allclose(sharded, one, rtol=5e-3)


def test_resume_equals_the_uninterrupted_run_bitwise(runs, tmp_path):
    """fp8 keeps no scale state (current scaling): a run stopped halfway and resumed from its
    checkpoint ends on the uninterrupted run's parameters, bitwise."""
    overrides = [o.format("fp8") for o in RUN]
    interrupted = Trainer(tiny_config(*overrides, out=str(tmp_path)), devices=jax.devices()[:1])
    interrupted.fit(STEPS // 2, log=MetricsLog(interrupted.out, primary=False))
    resumed = Trainer(tiny_config(*overrides, "checkpoint.resume=auto", out=str(tmp_path)), devices=jax.devices()[:1])
    assert int(resumed.state["step"]) == STEPS // 2
    resumed.fit(log=MetricsLog(resumed.out, primary=False))
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state["params"])), jax.tree.leaves(runs["fp8"][2])):
        np.testing.assert_array_equal(a, b)


def test_the_roofline_runs_the_blocks_matmuls_at_the_fp8_peak():
    """compute = ((hardware - fp8) / bf16 peak + fp8 / fp8 peak), fp8 = 6 N_blocks per token (8 with
    remat=full's rerun forward); MFU against the bf16 peak, and against the fp8 peak beside it."""
    nothing = SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0, temp_size_in_bytes=0)
    h100 = DEVICE_PROFILES["h100"]
    for remat, matmuls in (("none", 6), ("full", 8)):
        bf16, fp8 = (TrainProgram.from_config(tiny_config(f"parallel.precision={p}", "parallel.mesh=1",
                                                          f"parallel.remat={remat}"), devices=jax.devices()[:1])
                     for p in ("bf16", "fp8"))
        base, est = (roofline.estimate(p, nothing, [], h100) for p in (bf16, fp8))
        n = fp8.model.active_matmul_params(fp8.abstract_state["params"]) - 256 * 32  # the head's V x D out
        fp8_flops = matmuls * n * 16 * 16
        hardware = est["flops"]["hardware_per_device"]
        assert hardware == base["flops"]["hardware_per_device"] and est["flops"]["fp8_per_device"] == fp8_flops
        assert est["compute_s"] == pytest.approx((hardware - fp8_flops) / 989e12 + fp8_flops / 1979e12, rel=1e-12)
        assert est["mfu_ceiling"] * est["step_s"] * 989e12 == pytest.approx(est["flops"]["model_per_device"])
        assert est["mfu_fp8_ceiling"] == pytest.approx(est["mfu_ceiling"] * 989 / 1979)
        assert "mfu_fp8_ceiling" not in base
    with pytest.raises(UserError, match="parallel.precision=fp8: the A100 SXM 80GB has no fp8 GEMMs"):
        roofline.estimate(fp8, nothing, [], DEVICE_PROFILES["a100"])


@pytest.mark.fast
def test_a_recipe_is_refused_on_a_gpu_without_its_gemms():
    """Before the recipe's compute capability (fp8: 8.9, so not an A100's 8.0; mxfp8 and nvfp4: Blackwell's
    10.0, so not a Hopper's 9.0) XLA would run the recipe upcast, slower than bf16: one line naming the GPU,
    who has the GEMMs and the recipes this GPU runs; CPUs compute every recipe's numbers."""
    gpu = lambda cc, kind="NVIDIA A100-SXM4-80GB": SimpleNamespace(platform="gpu", compute_capability=cc,
                                                                   device_kind=kind)
    why = recipe_refusal("fp8_rowwise", gpu("8.0"))
    assert why.startswith("parallel.precision=fp8_rowwise: the NVIDIA A100-SXM4-80GB (compute capability 8.0) has "
                          "no fp8_rowwise GEMMs") and why.endswith("set parallel.precision=bf16")
    assert [recipe_refusal("fp8", gpu(cc)) for cc in ("8.9", "9.0", "10.0")] == [None] * 3
    for recipe in ("mxfp8", "nvfp4"):
        why = recipe_refusal(recipe, gpu("9.0", "NVIDIA H100 80GB HBM3"))
        assert why == (f"parallel.precision={recipe}: the NVIDIA H100 80GB HBM3 (compute capability 9.0) has no "
                       f"{recipe} GEMMs, which need 10.0 or newer (Blackwell: B200, GB200); XLA would run the recipe "
                       f"upcast, slower than bf16: set parallel.precision=fp8 or fp8_rowwise or fp8_blockwise or bf16")
        assert recipe_refusal(recipe, gpu("10.0", "NVIDIA B200")) is None
        assert recipe_refusal(recipe, jax.devices()[0]) is None
        # a B200 whose loaded cuDNN is before 9.10: XLA dequantizes the block-scaled GEMM (test_gpu_compile.py)
        assert recipe_refusal(recipe, gpu("10.0", "NVIDIA B200"), (9, 9)) == (
            f"parallel.precision={recipe}: its block-scaled GEMMs need cuDNN 9.10 or newer and this install has "
            f"cuDNN 9.9, with which XLA would dequantize them to bf16 GEMMs, slower than bf16: upgrade cuDNN (pip "
            f"install -U nvidia-cudnn-cu12), or set parallel.precision=fp8 or bf16")
        assert recipe_refusal(recipe, gpu("10.0", "NVIDIA B200"), (9, 10)) is None
    assert recipe_refusal("fp8", gpu("9.0"), (9, 9)) is None  # cuBLASLt's fp8 GEMMs
    assert recipe_refusal("bf16", gpu("8.0")) is None
    # the planner's target and the refusal read one cuDNN: the plugin's library, else the package's, else 9.8
    assert compilers.cudnn_version() == installed_cudnn() == (loaded_cudnn() or installed_cudnn())


def test_the_fp8_collectives_beyond_the_formulas_are_known_by_layout():
    """The reasons known_gaps gives by layout (their ratios are read on the GPU program: 1.60x on
    tiny fsdp=4,tensor=2). Beside tensor, each column-parallel projection's dx is all-reduced on its own
    (its scaled GEMM rounds alone; bf16 sums them first), bounded at 7/4; elsewhere the scales' amaxes are the
    all-reduce bytes the formula lacks (meshtrain/planner/known_gaps.py). A bf16 step has neither."""
    from meshtrain.planner.known_gaps import known_gaps

    def all_reduce_gaps(mesh, precision="fp8"):
        program = TrainProgram.from_config(tiny_config(f"parallel.mesh={mesh}", f"parallel.precision={precision}"),
                                           devices=jax.devices()[:8])
        return [(why.split(":")[0], hi) for why, _, hi in known_gaps(program).get("all-reduce", [])]

    assert all_reduce_gaps("fsdp=4,tensor=2") == [("fp8 beside tensor", 7 / 4)]
    assert all_reduce_gaps("fsdp=8") == [("the fp8 recipe's scales", float("inf"))]
    assert all_reduce_gaps("fsdp=8", "bf16") == []


def test_the_fp8_roofline_leaves_the_router_and_dropless_experts_at_the_bf16_peak():
    """moe_tiny (4 layers, D 32, F 32, 4 experts, top 2, a shared expert): its router [D, E] runs
    bf16 either way, and its routed experts run fp8 under capacity routing only, on every slot: at
    factor 1.25 C = 10 of the 16 positions, 10/16 of the routed parameters per token against N's 2/4."""
    nothing = SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0, temp_size_in_bytes=0)
    L, D, F, E, k, V, tokens = 4, 32, 32, 4, 2, 256, 16 * 16
    for capacity, bf16_experts, slots in ((1.25, 0, L * E * 3 * D * F * (10 / 16 - k / E)),
                                          (0.0, L * k * 3 * D * F, 0)):
        program = TrainProgram.from_config(tiny_config("parallel.precision=fp8", "parallel.mesh=1",
                                                       f"model.capacity_factor={capacity}", config=MOE_TINY),
                                           devices=jax.devices()[:1])
        active = program.model.active_matmul_params(program.abstract_state["params"])
        fp8 = roofline.estimate(program, nothing, [], DEVICE_PROFILES["h100"])["flops"]["fp8_per_device"]
        assert fp8 == 6 * (active - V * D - L * D * E - bf16_experts + slots) * tokens, capacity


def test_activations_are_bf16_and_the_matmuls_saved_inputs_one_byte():
    assert compute_bytes("fp8") == 2 and saved_matmul_bytes("fp8") == 1 and saved_matmul_bytes("bf16") == 2
    assert compute_bytes("fp8_rowwise") == saved_matmul_bytes("fp8_rowwise") == 2  # requantized in the backward
    s, b, h, a, k, f = 16, 2, 32, 4, 8, 64
    bf16, fp8 = (llama_activation_terms(s, b, h, a, a, k, f, 2, matmul_input_bytes=m) for m in (None, 1))
    # one byte less for each of the norms' two outputs, the attention context and gate x up
    assert sum(bf16.values()) - sum(fp8.values()) == s * b * (2 * h + a * k + f)
