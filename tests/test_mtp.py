"""deepseek_v3's multi-token prediction (issue 41, section 1; DeepSeek-V3 section 2.2) on
configs/deepseek_v3_tiny.yaml with model.mtp_depth=2: the first step's loss, mtp_loss and gradient
norm equal a direct computation written here (the modules on truncated rows, jnp cross-entropies);
each depth's targets follow the loss mask and packed documents; data x expert and fsdp x tensor train
as one device; the planner's counts include the modules; pipeline, context and DPO are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, max_param_diff, run_tiny

from meshtrain.config.loader import UserError, load_config
from meshtrain.config.validate import check_layout
from meshtrain.models import FAMILIES
from meshtrain.models.base import scan_blocks
from meshtrain.ops.packing import Documents
from meshtrain.parallel.sharding import make_rules

TINY = str(ROOT / "configs" / "deepseek_v3_tiny.yaml")
MTP = "model.mtp_depth=2"


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
        p = jax.tree.map(lambda w: w[k - 1], params["mtp"])
        h = h[:, :L - k]  # h^{k-1} at positions 0 .. L - k - 1
        e = params["embedding"][inputs[:, k:]]  # Emb(t_{i+k})
        x = jnp.concatenate([rms_norm(e, p["enorm"]["scale"], eps), rms_norm(h, p["hnorm"]["scale"], eps)], -1)
        h = model.dense_block(p["block"], x @ p["mtp_proj"])[0]
        depth_losses.append(mean_nll(h, p["norm"]["scale"], eps, params["embedding"], targets[:, k:]))
    mtp = sum(depth_losses) / c.mtp_depth
    return loss + c.mtp_loss_weight * mtp, (loss, mtp)


def test_first_step_equals_the_direct_computation():
    trainer, losses, _ = run_tiny(MTP, "parallel.mesh=1", devices=jax.devices()[:1], config=TINY)
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


@pytest.mark.parametrize("mesh", ["data=2,expert=4", "fsdp=2,tensor=2"])
def test_trains_on_a_mesh_as_on_one_device(mesh):
    ref, ref_losses, ref_params = run_tiny(MTP, "parallel.mesh=1", devices=jax.devices()[:1], config=TINY)
    trainer, losses, params = run_tiny(MTP, f"parallel.mesh={mesh}", devices=jax.devices()[:8 if "expert" in mesh
                                                                                            else 4], config=TINY)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    mtp = lambda t: [r["mtp_loss"] for r in t.history if "loss" in r]
    np.testing.assert_allclose(mtp(trainer), mtp(ref), rtol=1e-5, atol=0)
    assert max_param_diff(params, ref_params) < 1e-5 and losses[-1] != losses[0]


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
    cfg = load_config(TINY, [MTP])
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "pipeline": 2, "context": 1}
    with pytest.raises(UserError, match="model.mtp_depth=2 runs without a pipeline axis"):
        check_layout(cfg.model, cfg.parallel, cfg.train, sizes, make_rules(), "cpu")
    with pytest.raises(UserError, match="model.mtp_depth=2 runs without a context axis"):
        check_layout(cfg.model, cfg.parallel, cfg.train, {**sizes, "pipeline": 1, "context": 2}, make_rules(), "cpu")
    with pytest.raises(UserError, match="train.objective=dpo trains the next-token policy only"):
        load_config(TINY, [MTP, "train.objective=dpo"])
    with pytest.raises(UserError, match="mtp_depth"):
        load_config(TINY, ["model.mtp_depth=-1"])
    with pytest.raises(UserError, match="mtp_loss_weight"):
        load_config(TINY, ["model.mtp_loss_weight=-0.1"])
