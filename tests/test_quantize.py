"""INT8 export (meshtrain/interop/quantize.py): the round-trip error bound per element for both schemes, the
stored tensors, a saved folder loading back, and the quantized tiny model's eval loss and size."""
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from meshtrain.config.loader import load_config
from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_whole
from meshtrain.data import tokenizer
from meshtrain.interop import quantize as qz
from meshtrain.models import FAMILIES
from meshtrain.models.base import PARAM_AXES
from meshtrain.run.int8_export import export_int8
from meshtrain.testing import MOE_TINY, TINY, run_tiny

SCHEMES = qz.SCHEMES
MOE_PARAM_AXES = FAMILIES["moe"].model.param_axes


def assert_within_half_step(w, t: qz.QTensor):
    """|dequant(quant(w)) - w| <= S/2 per element, plus fp32 rounding: w / S and (q - Z) * S stay
    within 256 steps, so each rounds off at most 256 * 2^-24 steps."""
    err = np.abs(qz.dequantize_array(t) - np.asarray(w, np.float32))
    bound = np.broadcast_to(t.scale, err.shape) * (0.5 + 2 * 256 * 2.0**-24)
    assert np.all(err <= bound), float(np.max(err / np.broadcast_to(t.scale, err.shape)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_within_half_a_step_on_random_matrices(scheme):
    rng = np.random.default_rng(0)
    for w in [rng.normal(size=(64, 48)), rng.uniform(0.5, 2.0, size=(3, 16, 8)),  # all positive
              rng.standard_t(2, size=(32, 4, 8)) * 1e-3, np.zeros((8, 4))]:  # heavy tails; all-zero
        t = qz.quantize_array(w, (0,), scheme)
        assert t.q.dtype == np.int8 and t.q.shape == w.shape and t.scale.dtype == np.float32
        assert t.scale.shape == (1, *w.shape[1:])
        assert_within_half_step(w, t)
        if scheme == "symmetric":
            assert t.zero_point is None and t.q.min() >= -127
        else:  # the range [min(w, 0), max(w, 0)] fills int8: its low end maps to -128
            assert t.zero_point.dtype == np.int8 and t.zero_point.shape == t.scale.shape
            negative = w.min(axis=0, keepdims=True) < 0
            assert np.all(np.where(negative, t.q.min(axis=0, keepdims=True), t.zero_point) == -128)
    zeros = np.zeros((8, 4))
    assert np.array_equal(qz.dequantize_array(qz.quantize_array(zeros, (0,), scheme)), zeros)


def test_channel_rule_contracts_the_matmul_input():
    axes = {name: qz.contracted_axes(("layers", *names)) for name, names in MOE_PARAM_AXES.items()}
    assert axes["wq"] == axes["w_gate"] == axes["router"] == (1,)  # embed, per (layer, outputs)
    assert axes["expert_up"] == axes["expert_down"] == (2,)  # per (layer, expert, outputs)
    assert axes["wo"] == (1, 2)  # heads x head_dim -> embed: one scale per (layer, embed channel)
    assert axes["w_down"] == (1,) and axes["scale"] == ()  # norm scales: nothing to contract
    assert qz.contracted_axes(PARAM_AXES["embedding"]) == (1,)  # one scale per token row
    assert qz.contracted_axes(PARAM_AXES["lm_head"]) == (0,)  # per vocab output


def test_moe_experts_get_a_scale_each_and_the_router_stays():
    model = FAMILIES["moe"](load_config(MOE_TINY, []).model)
    rng = np.random.default_rng(0)  # random weights of the model's shapes (init runs for seconds)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32),
                          jax.eval_shape(model.init, jax.random.key(0)))
    qtree = qz.quantize(params, model.logical_axes(params), "affine")["blocks"]
    assert isinstance(qtree["router"], np.ndarray)  # kept as it is
    assert qtree["expert_down"].scale.shape == (4, 4, 1, 32)  # [layers, experts, F, D]
    assert_within_half_step(params["blocks"]["expert_gate"], qtree["expert_gate"])


@pytest.fixture(scope="module")
def tiny():
    """The shared single-device tiny run, with its final state checkpointed."""
    trainer, _, params = run_tiny("parallel.mesh=1", devices=jax.devices()[:1])
    trainer.save_checkpoint(wait=True)
    return trainer, params


@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_params_round_trip(tiny, scheme):
    trainer, params = tiny
    axes = trainer.program.model.logical_axes(params)
    qtree = qz.quantize(params, axes, scheme)
    flat, originals = qz.flat(qtree), qz.flat(params)
    kept = {path for path, t in flat.items() if not isinstance(t, qz.QTensor)}
    norms = {("blocks", "attn_norm", "scale"), ("blocks", "mlp_norm", "scale"), ("final_norm", "scale")}
    assert kept == norms
    for path, t in flat.items():
        if isinstance(t, qz.QTensor):
            assert t.q.dtype == np.int8 and t.q.shape == originals[path].shape
            assert_within_half_step(originals[path], t)
    assert flat[("blocks", "wq")].scale.shape == (4, 1, 8, 8)  # [layers, D, H, K]: per (layer, head, k)
    assert np.array_equal(qz.dequantize(qtree)["final_norm"]["scale"], params["final_norm"]["scale"])


@pytest.fixture(scope="module")
def exports(tiny, tmp_path_factory):
    """{scheme: (OUT folder, report)}: the tiny run (a copy, recording a tokenizer) exported."""
    trainer, _ = tiny
    root = tmp_path_factory.mktemp("int8")
    run = shutil.copytree(trainer.out, root / "run")
    tokenizer.record(run, tokenizer.ByteTokenizer())
    return {s: (root / s, export_int8(run, root / s, s, devices=jax.devices()[:1])) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_export_loads_back_and_stays_close(tiny, exports, scheme):
    trainer, params = tiny
    out, report = exports[scheme]
    files = ["SHA256SUMS", "config.yaml", "model.safetensors", "quantization.json", "tokenizer.txt"]
    assert sorted(p.name for p in out.iterdir()) == files
    assert isinstance(tokenizer.for_run(out), tokenizer.ByteTokenizer)
    qtree, info = qz.load(out)  # the tree quantize() makes, bit for bit
    expected = qz.quantize(params, trainer.program.model.logical_axes(params), scheme)
    assert jax.tree.structure(qtree) == jax.tree.structure(expected)
    assert all(a.dtype == b.dtype and np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(qtree), jax.tree.leaves(expected)))
    assert info["scheme"] == scheme and info["params"]["blocks.wo"]["channel_axes"] == ["layers", "embed"]
    # fp32: the model the trainer evaluates; int8 within 1e-4 of it (measured: 1e-5 here; 2e-5
    # symmetric and 9e-5 affine on the Shakespeare model).
    assert report["eval_loss_fp32"] == pytest.approx(trainer.evaluate(), rel=1e-6)
    assert report["eval_loss_int8"] != report["eval_loss_fp32"] and abs(report["delta"]) < 1e-4
    # The file is its tensors plus a small header. At d_model 32 each int8 channel of 32 carries a
    # 4-byte scale (+ a zero point), so 4 / (1 + 4/32) = 3.56x is this model's ceiling.
    payload = sum(a.nbytes for a in qz.tensors(qtree).values())
    assert payload < report["bytes_int8"] < payload + 4096
    assert report["ratio"] > (3.45 if scheme == "symmetric" else 3.35)


def test_bad_input_is_a_user_error_and_writes_nothing(tiny, exports, tmp_path):
    trainer, _ = tiny
    taken, _ = exports["symmetric"]
    with pytest.raises(UserError, match="OUT .* already exists and is not empty; pick a new folder"):
        export_int8(trainer.out, taken, "symmetric", devices=jax.devices()[:1])
    with pytest.raises(UserError, match="scheme 'int4'; pass --scheme symmetric or affine"):
        export_int8(trainer.out, tmp_path / "new", "int4")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.yaml").write_text((trainer.out / "config.yaml").read_text())
    with pytest.raises(UserError, match="holds no checkpoint; train first"):
        export_int8(tmp_path / "fresh", tmp_path / "new", "symmetric")
    with pytest.raises(UserError, match="not a meshtrain run folder"):
        export_int8(tmp_path / "nowhere", tmp_path / "new", "symmetric")
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["fresh"]


def test_a_failed_write_leaves_no_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        with writing_whole(tmp_path / "a" / "out", "OUT") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
            (tmp / "no" / "such").write_bytes(b"y")
    assert list(tmp_path.iterdir()) == []


def test_a_run_on_simulated_devices_gets_them_before_its_weights_are_read(tmp_path, monkeypatch):
    """Reading the weights starts JAX; a run trained with --devices 8 must have its 8 CPU devices
    asked for first (a fresh `convert --quantize` process failed: 'it already has 1 CPU devices')."""
    from meshtrain.parallel import mesh
    from meshtrain.run import run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(Path(TINY).read_text() + "devices: 8\n")
    calls = []
    monkeypatch.setattr(mesh, "simulate_cpu_devices", lambda n: calls.append(f"simulate {n}"))

    def read(*args, **kwargs):
        calls.append("read")
        raise KeyboardInterrupt  # stop there: the order is the point

    monkeypatch.setattr(run_dir, "newest_params", read)
    with pytest.raises(KeyboardInterrupt):
        export_int8(tmp_path / "run", tmp_path / "int8")
    assert calls == ["simulate 8", "read"]
