"""deepseek_v3's multi-token prediction (issue 41, section 1; DeepSeek-V3 section 2.2) on
configs/deepseek_v3_tiny.yaml with model.mtp_depth=2: the first step's loss, mtp_loss and gradient
norm equal a direct computation written here (the modules on truncated rows, jnp cross-entropies);
each depth's targets follow the loss mask and packed documents; evaluation and the Hugging Face export
use the trunk only; the planner's counts include the modules; DPO is refused (layout parity, pipelines
and context axes included: tests/test_deepseek_v3.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, run_tiny

from meshtrain import convert
from meshtrain.config.loader import UserError, load_config
from meshtrain.interop import hf, quantize
from meshtrain.models import FAMILIES
from meshtrain.models.base import scan_blocks
from meshtrain.ops.packing import Documents
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.parallel.sharding import param_shardings
from meshtrain.run.int8_export import export_int8

TINY = str(ROOT / "configs" / "deepseek_v3_tiny.yaml")
MTP = "model.mtp_depth=2"
RUN = (MTP, "train.steps=3", "parallel.mesh=1")  # the one-device run the tests share
# Layout parity with MTP on (1 device = data=2,expert=4 = fsdp=2,tensor=2) is tests/test_deepseek_v3.py's
# test_tiny_config_trains_on_a_mesh_as_on_one_device, which trains the tiny config with model.mtp_depth=2.


def rms_norm(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def mean_nll(h_BxLxD, scale, eps, embedding_VxD, targets_BxL):
    """The tied head's mean cross-entropy over every position given."""
    log_probs = jax.nn.log_softmax(rms_norm(h_BxLxD, scale, eps) @ embedding_VxD.T)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets_BxL[..., None], axis=-1))


def direct_objective(model, params, tokens_BxL1):
    """(objective, (loss, mtp_loss)): the trunk's blocks (no loss code), then each depth k on the
    positions whose target t_{i+k+1} exists, i < L - k (causal: the later ones change nothing)."""
    c = model.cfg
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    L, eps = inputs.shape[1], c.norm_eps
    h = scan_blocks(model.block, params["blocks"], model.embed(params, inputs))[0]
    loss = mean_nll(h, params["final_norm"]["scale"], eps, params["embedding"], targets)
    depth_losses = []
    for k in range(1, c.mtp_depth + 1):
        p = jax.tree.map(lambda w, k=k: w[k - 1], params["mtp"])
        h = h[:, :L - k]  # h^{k-1} at positions 0 .. L - k - 1
        e = params["embedding"][inputs[:, k:]]  # Emb(t_{i+k})
        x = jnp.concatenate([rms_norm(e, p["enorm"]["scale"], eps), rms_norm(h, p["hnorm"]["scale"], eps)], -1)
        h = model.dense_block(p["block"], x @ p["mtp_proj"])[0]
        depth_losses.append(mean_nll(h, p["norm"]["scale"], eps, params["embedding"], targets[:, k:]))
    mtp = sum(depth_losses) / c.mtp_depth
    return loss + c.mtp_loss_weight * mtp, (loss, mtp)


def test_first_step_equals_the_direct_computation():
    trainer, _, _ = run_tiny(*RUN, devices=jax.devices()[:1], config=TINY)
    model = trainer.program.model
    params = model.init(jax.random.key(trainer.program.train.seed))
    assert params["mtp"]["mtp_proj"].shape == (2, 64, 32) and params["mtp"]["block"]["w_gate"].shape == (2, 32, 48)
    tokens = np.asarray(trainer.train_batches(0))
    (_, (loss, mtp)), grads = jax.jit(jax.value_and_grad(lambda p: direct_objective(model, p, tokens),
                                                         has_aux=True))(params)
    first = trainer.history[0]
    np.testing.assert_allclose([first["loss"], first["mtp_loss"], first["grad_norm"]],
                               [loss, mtp, optax.tree.norm(grads)], rtol=1e-5)
    assert float(jnp.abs(grads["mtp"]["mtp_proj"]).max()) > 0 and mtp > loss  # harder: tokens further ahead
    assert all(np.isfinite(r["mtp_loss"]) for r in trainer.history if "loss" in r)
    eval_loss, _ = trainer.eval_step(trainer.program.state_from_params(params)["params"], trainer.train_batches(0))
    np.testing.assert_allclose(eval_loss, loss, rtol=1e-5)  # the next-token loss only


def test_export_writes_the_trunk_and_says_so(tmp_path, capsys):
    """convert --to-hf of a run with MTP: one notice line, a DeepseekV3ForCausalLM folder without MTP
    layers whose import is the run's trunk, bitwise (fp32); convert --quantize int8 leaves them out too."""
    trainer, _, _ = run_tiny(*RUN, devices=jax.devices()[:1], config=TINY)
    trainer.save_checkpoint(wait=True)
    capsys.readouterr()
    assert convert.main(["--to-hf", str(trainer.out), str(tmp_path / "hf"), "--mesh", "fsdp=-1"]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "without its training-only parameters (mtp" in notices[0]
    spec = hf.read_spec(tmp_path / "hf")
    model = FAMILIES["deepseek_v3"](spec)
    shardings = param_shardings(model, build_mesh(parse_mesh("1", 1), jax.devices()[:1]))
    params = hf.load_params(tmp_path / "hf", model, shardings)
    trained = trainer.unpermuted_params()
    assert spec.mtp_depth == 0 and params.keys() == trained.keys() - {"mtp"}
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), jax.device_get(params),
                                     {k: v for k, v in trained.items() if k != "mtp"}))  # the trunk, bitwise
    export_int8(trainer.out, tmp_path / "int8", devices=jax.devices()[:1])  # the run's one device
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "without its training-only parameters (mtp" in notices[0]
    assert quantize.load(tmp_path / "int8")[0].keys() == trained.keys() - {"mtp"}


def test_each_depth_trains_the_targets_the_main_loss_trains_within_the_document():
    model = FAMILIES["deepseek_v3"](load_config(TINY, [MTP]).model)
    targets = jnp.array([[5, 6, ~7, 8, 9, 10]])  # ~7: masked (a loss mask)
    segments = jnp.array([[0, 0, 0, 0, 1, 1]])  # a document starts at position 4
    got = np.asarray(model.mtp_targets(targets, Documents(segments, None)))
    trained = np.where(got >= 0, got, -1)  # depth k at i: targets[i + k], within i's document
    np.testing.assert_array_equal(trained[0, 0], [6, -1, 8, -1, 10, -1])
    np.testing.assert_array_equal(trained[1, 0], [-1, 8, -1, -1, -1, -1])
    np.testing.assert_allclose(model.mtp_shares(targets, Documents(segments, None)), [3 / 6, 1 / 6])
    assert np.all(np.asarray(model.mtp_targets(targets))[:, 0, 4:] == [[10, -1], [-1, -1]])  # no documents


def test_the_planner_counts_the_modules():
    """N grows by the modules' parameters and the head's V x D once more per depth; the attention
    term by one layer per depth."""
    off, on = (FAMILIES["deepseek_v3"](load_config(TINY, o).model) for o in ([], [MTP]))
    p_off, p_on = (jax.eval_shape(m.init, jax.random.key(0)) for m in (off, on))
    modules = sum(x.size for x in jax.tree.leaves(p_on["mtp"]))
    assert on.num_params(p_on) == off.num_params(p_off) + modules
    c, S = on.cfg, 16
    head = c.vocab_size * c.d_model
    assert on.active_matmul_params(p_on) == off.active_matmul_params(p_off) + modules + 2 * head
    assert on.block_matmul_params(p_on) == off.block_matmul_params(p_off) + modules
    attention = 12 * c.num_heads * (c.head_dim + c.v_head_dim) / 2 * S
    assert on.flops_per_token(p_on, S) == pytest.approx(off.flops_per_token(p_off, S) + 6 * (modules + 2 * head)
                                                        + 2 * attention)


def test_what_is_not_built_is_refused_in_one_line():
    with pytest.raises(UserError, match="train.objective=dpo trains the next-token policy only"):
        load_config(TINY, [MTP, "train.objective=dpo"])
    with pytest.raises(UserError, match="mtp_depth"):
        load_config(TINY, ["model.mtp_depth=-1"])
    with pytest.raises(UserError, match="mtp_loss_weight"):
        load_config(TINY, ["model.mtp_loss_weight=-0.1"])
