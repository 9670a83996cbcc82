"""The deepseek_v3 family (issue 41, section 1) against transformers' own DeepseekV3ForCausalLM (CPU
torch, fp32, random weights from tiny configs, nothing downloaded): logits both ways (import, and
export of meshtrain's own random weights), bitwise import/export round trips, with q_lora_rank set and
None, 2 expert groups, a dense first layer, a nonzero selection bias and yarn in one case; the bias
never trained; configs/deepseek_v3_tiny.yaml trains (its biases moving, with 2 multi-token prediction
modules) on data x expert, fsdp x tensor and context (ring, hybrid) meshes as on one device, and (its
biases moving, without MTP) on pipelines, the first stage running the dense layer, as qwen3_moe's biases
do on an interleaved one; generation from the compressed-latent cache gives the full forward's greedy
tokens, on one device and on expert x tensor; what is not built is refused in one line."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, max_param_diff, run_tiny

from meshtrain.config.loader import UserError, load_config
from meshtrain.core.formulas import kv_cache_bytes
from meshtrain.engine.decode import generate, place
from meshtrain.engine.step import grad_norms_by_group, make_optimizer
from meshtrain.interop import hf
from meshtrain.models import FAMILIES
from meshtrain.objectives.next_token import make_loss_fn
from meshtrain.parallel.mesh import AXES, build_mesh, parse_mesh
from meshtrain.parallel.sharding import param_shardings
from meshtrain.run.health import grad_norm_fields
from meshtrain.testing import full_forward_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = str(ROOT / "configs" / "deepseek_v3_tiny.yaml")
TOKENS = np.random.default_rng(0).integers(0, 300, (2, 40))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}  # softmax x m(0.8)^2 = 1.23
HF_TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
               n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, initializer_range=0.2,
               max_position_embeddings=64)
CASES = {"q_lora, yarn": dict(q_lora_rank=24, rope_parameters=YARN),
         "full-rank q": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})}


def save_hf(folder, **overrides):
    """A random DeepseekV3ForCausalLM with random norm scales and selection biases (transformers
    starts them at 1 and 0, where a misplaced one would not show)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**HF_TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(folder)
    return folder


def hf_logits(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def close(ours, theirs) -> bool:
    """Within 2e-5 of the largest logit (measured: <= 1.1e-5 of logits up to 10)."""
    diff, scale = float(np.abs(np.asarray(ours) - theirs).max()), float(np.abs(theirs).max())
    print(f"logits: max |diff| {diff:.2e} of max |logit| {scale:.2f}")
    return diff <= 2e-5 * scale


def imported(folder):
    spec = hf.read_spec(folder)
    model = FAMILIES[spec.family](spec)
    return model, hf.load_params(folder, model, param_shardings(model, build_mesh(parse_mesh("1", 1),
                                                                                  jax.devices()[:1])))


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers_bitwise(tmp_path, case):
    folder = save_hf(tmp_path / "hf", **CASES[case])
    model, params = imported(folder)
    c = model.cfg
    assert (c.family, c.first_k_dense_replace, c.router_groups, c.head_dim) == ("deepseek_v3", 1, 2, 24)
    assert params["dense_blocks"]["w_gate"].shape == (1, 64, 96) and params["blocks"]["router_bias"].shape == (1, 8)
    apply = jax.jit(model.apply)
    theirs = hf_logits(folder)
    assert np.abs(theirs).max() > 1.0  # logits large enough for the comparison to mean something
    assert close(apply(params, TOKENS), theirs)

    hf.save_params(params, c, tmp_path / "back")  # the round trip: the same bytes and config
    original, back = hf.SafetensorsFolder(folder), hf.SafetensorsFolder(tmp_path / "back")
    assert original.tensors.keys() == back.tensors.keys()
    assert all(np.array_equal(x.view(np.uint8), back.get(n).view(np.uint8)) for n, x in original.tensors.items())
    assert hf.read_spec(tmp_path / "back") == hf.read_spec(folder)

    mine = jax.tree.map(lambda x: x * 1.5, model.init(jax.random.key(1)))  # meshtrain's weights, exported
    mine["blocks"]["router_bias"] = jax.random.uniform(jax.random.key(2), (1, 8), minval=-0.3, maxval=0.3)
    hf.save_params(mine, c, tmp_path / "mine")
    assert close(apply(mine, TOKENS), hf_logits(tmp_path / "mine"))


def test_the_selection_bias_is_never_trained():
    """Its gradient is 0 (stop_gradient) and the optimizer decays no vector: AdamW with weight
    decay leaves a nonzero bias as it is while the router moves."""
    spec = load_config(TINY).model
    model = FAMILIES["deepseek_v3"](spec)
    params = model.init(jax.random.key(0))
    params["blocks"]["router_bias"] = jnp.full((2, 8), 0.2).at[:, 3].set(-0.5)
    x_BxLxD = model.embed(params, TOKENS[:, :16] % 256)

    def loss(p):  # one routed block
        return jnp.sum(model.block(jax.tree.map(lambda w: w[0], p["blocks"]), x_BxLxD)[0] ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    assert not np.any(np.asarray(grads["blocks"]["router_bias"])) and np.any(np.asarray(grads["blocks"]["router"]))
    ocfg = load_config(TINY, ["optim.weight_decay=0.1", "optim.warmup_steps=0"]).optim
    tx = make_optimizer(ocfg, 10, model.logical_axes(params))
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert not np.any(np.asarray(updates["blocks"]["router_bias"])) and np.any(np.asarray(updates["blocks"]["router"]))


def test_router_metrics_are_means_over_the_routed_layers():
    """The step's router_aux_loss, dropped and expert_load_max are means over the 2 routed layers
    (the stack `blocks`), not over all 3 with the dense first one: each routed layer's statistics
    from its own block, averaged here; the objective adds router_aux_loss x its weight."""
    spec = load_config(TINY, ["model.router_aux_loss=0.01", "model.capacity_factor=1.0"]).model
    model = FAMILIES["deepseek_v3"](spec)
    params = jax.tree.map(lambda w: w * 3, model.init(jax.random.key(0)))
    tokens = jnp.asarray(TOKENS[:, :17] % 256)
    objective, metrics = jax.jit(make_loss_fn(model, "fp32"))(params, tokens)
    x_BxLxD = model.embed(params, tokens[:, :-1])
    per_layer = []
    for i in range(model.routed_layers):
        x_BxLxD, stats = model.block(jax.tree.map(lambda w, i=i: w[i], params["blocks"]), x_BxLxD)
        per_layer.append(stats)
    for name in ("router_aux_loss", "dropped", "expert_load_max"):
        np.testing.assert_allclose(metrics[name], np.mean([s[name] for s in per_layer]), rtol=1e-6)
    assert metrics["expert_load_max"] >= 1 and metrics["dropped"] > 0
    np.testing.assert_allclose(objective, metrics["loss"] + 0.01 * metrics["router_aux_loss"], rtol=1e-6)


def test_layer_gradient_norms_count_the_dense_first_layers():
    """train.grad_norms_every's per-layer fields in model order: grad_norm_layer_0 is the dense first
    layer's, 1 and 2 the routed ones' (stored in a pipeline's order, put back); with the other kinds
    they add up to the global norm."""
    model = FAMILIES["deepseek_v3"](load_config(TINY).model)
    params = model.init(jax.random.key(0))
    tokens = jnp.asarray(TOKENS[:, :17] % 256)
    grads = jax.jit(jax.grad(lambda p, t: make_loss_fn(model, "fp32")(p, t)[0]))(params, tokens)
    fields = grad_norm_fields(jax.device_get(grad_norms_by_group(grads, model.embed_stacks)), [1, 0])
    expected = [optax.tree.norm(grads["dense_blocks"]),
                *(optax.tree.norm(jax.tree.map(lambda g, i=i: g[i], grads["blocks"])) for i in (1, 0))]
    np.testing.assert_allclose([fields[f"grad_norm_layer_{i}"] for i in range(3)], expected, rtol=1e-6)
    assert "grad_norm_layer_3" not in fields
    rest = sum(fields[f"grad_norm_{k}"] ** 2 for k in grads if k not in ("blocks", "dense_blocks"))
    total = sum(fields[f"grad_norm_layer_{i}"] ** 2 for i in range(3)) + rest
    np.testing.assert_allclose(total, optax.tree.norm(grads) ** 2, rtol=1e-5)


BIAS = "model.router_bias_update_rate=0.01"  # aux-loss-free balancing on: the biases move after each step
# multi-token prediction on (tests/test_mtp.py checks its objective), over packed documents: token 216,
# the synthetic chain's most frequent, ends one (18 times in the 5 steps' 1,280 inputs), so the depths'
# trained positions differ between rows and data shards
MTP = ("model.mtp_depth=2", "data.document_mask=true", "data.eos_id=216")


@pytest.mark.parametrize("mesh", ["data=2,expert=4,microbatches=2", "fsdp=2,tensor=2",
                                  "context=2,expert=4,attention=ring",
                                  "context=4,data=2,attention=ring,context_strategy=hybrid,ulysses_degree=2",
                                  "data=2,pipeline=2,schedule=gpipe,microbatches=2,residuals=recompute"])
def test_tiny_config_trains_on_a_mesh_as_on_one_device(mesh):
    """The same losses, mtp_loss and parameters (the 2 MTP modules' too), router biases included
    (they move by +-0.01 a step on the global batch's loads: the manual data executor's per-shard
    loads sum exactly; each layer's from its own loads), with 2 microbatches on data x expert; on a
    context axis the ring (its load-balanced storage order: the depths' tokens ahead are taken in true
    order) and the hybrid (ulysses in pairs, a ring of 2 across them); on a pipeline the first stage
    runs the dense first layer with the embedding (`outer_layers`: whole on every stage), the stages'
    per-layer loads reach the bias update as the layer scan's do, and the last stage runs the MTP
    modules on its output, each microbatch's packed documents with it."""
    ref, ref_losses, ref_params = run_tiny("parallel.mesh=1", BIAS, *MTP, devices=jax.devices()[:1], config=TINY)
    axes = dict(part.split("=") for part in mesh.split(","))
    mesh = ",".join(f"{a}={n}" for a, n in axes.items() if a in AXES)
    keys = [f"parallel.{k}={v}" for k, v in axes.items() if k not in AXES]
    devices = int(np.prod([int(n) for a, n in axes.items() if a in AXES]))
    trainer, losses, params = run_tiny(f"parallel.mesh={mesh}", *keys, BIAS, *MTP,
                                       devices=jax.devices()[:devices], config=TINY)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    mtp = lambda t: [r["mtp_loss"] for r in t.history if "loss" in r]
    np.testing.assert_allclose(mtp(trainer), mtp(ref), rtol=1e-5, atol=0)
    assert params["mtp"]["mtp_proj"].shape == (2, 64, 32)
    assert max_param_diff(params, ref_params) < 1e-5 and losses[-1] != losses[0]
    bias = np.asarray(params["blocks"]["router_bias"])
    assert len(np.unique(bias, axis=0)) == len(bias) and np.array_equal(bias, ref_params["blocks"]["router_bias"])
    assert all(r["batch_load_max"] >= 1 for r in trainer.history if "loss" in r)
    if "pipeline" in axes:
        assert trainer.program.logical_axes["dense_blocks"]["w_gate"] == ("outer_layers", "embed", "mlp")
        assert trainer.program.state_shardings["params"]["dense_blocks"]["w_gate"].spec[0] is None


def trains_as_on_one_device(config, mesh, *more, devices):
    """`config` with the bias update on `mesh`: the 1-device run's losses and parameters (fp32, 1e-5),
    its router biases bitwise (they move by +-0.01 a step from the per-layer loads, counted exactly)."""
    _, ref_losses, ref_params = run_tiny("parallel.mesh=1", BIAS, devices=jax.devices()[:1], config=config)
    trainer, losses, _ = run_tiny(f"parallel.mesh={mesh}", BIAS, *more, devices=jax.devices()[:devices],
                                  config=config)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    params = trainer.unpermuted_params()  # interleaved stages store the layers in their own order
    assert max_param_diff(params, ref_params) < 1e-5 and losses[-1] != losses[0]
    bias = np.asarray(params["blocks"]["router_bias"])
    assert len(np.unique(bias, axis=0)) == len(bias) and np.array_equal(bias, ref_params["blocks"]["router_bias"])
    return trainer


def test_the_bias_update_of_another_moe_family_on_an_interleaved_pipeline():
    """qwen3_moe's 4 layers in 2 stages x 2 chunks, stored in the order [0, 2, 1, 3]: each stage's
    loads land on its own storage rows, where its biases are."""
    trainer = trains_as_on_one_device(str(ROOT / "configs" / "qwen3_moe_tiny.yaml"), "pipeline=2",
                                      "parallel.schedule=interleaved", "parallel.virtual_stages=2", devices=2)
    assert trainer.program.layer_order.tolist() == [0, 2, 1, 3]


def test_latent_cache_generates_the_full_forwards_greedy_tokens():
    """Prompts of 5, 9 and 2 tokens + 8 new, fp32, the tiny config's random weights x 3 (distinct
    logits): the cache holds kv_lora_rank + qk_rope_head_dim = 24 values per layer and position (what
    the planner's formula counts), and decoding from it, wkv_b absorbed, gives what rerunning the whole
    forward does, on one device and on expert=2,tensor=2 (rows padded to 4, heads split, cache not)."""
    model = FAMILIES["deepseek_v3"](load_config(TINY).model)
    params = jax.tree.map(lambda w: w * 3, model.init(jax.random.key(0)))
    cache = jax.eval_shape(lambda: model.init_cache(3, 16))
    assert {k: a.shape for k, a in cache.items()} == {"dense_blocks": (1, 3, 16, 24), "blocks": (2, 3, 16, 24)}
    assert sum(a.size * 4 for a in jax.tree.leaves(cache)) == kv_cache_bytes(3 * 16, 3, model.cfg.cached_values())
    rows = [np.asarray(TOKENS[0, :n] % 256, np.int32) for n in (5, 9, 2)]
    expected = full_forward_greedy(model, params, rows, 8)
    mesh = build_mesh(parse_mesh("expert=2,tensor=2", 4), jax.devices()[:4])
    sharded = place(model, mesh, params=params)
    assert sharded["blocks"]["wkv_b"].sharding.spec[2] == "tensor"
    for got in (generate(model, params, rows, 8), generate(model, sharded, rows, 8, mesh=mesh)):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


def test_what_is_not_built_is_refused_in_one_line():
    from meshtrain.config.validate import check_layout
    from meshtrain.parallel.sharding import make_rules

    cfg = load_config(TINY)
    sizes = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1, "pipeline": 2, "context": 1}
    with pytest.raises(UserError, match="first_k_dense_replace=1 on a pipeline with fsdp and tensor both > 1"):
        check_layout(cfg.model, cfg.parallel, cfg.train, sizes, make_rules(), "cpu")
    with pytest.raises(UserError, match="first_k_dense_replace=3 leaves none of the 3 layers routed"):
        load_config(TINY, ["model.first_k_dense_replace=3"])
    with pytest.raises(UserError, match="router_groups=3 must divide model.num_experts=8"):
        load_config(TINY, ["model.router_groups=3"])
    with pytest.raises(UserError, match="adapters on deepseek_v3's latent attention"):
        load_config(TINY, ["model.lora.rank=4", "model.lora.targets=[q,k,v,o]"])
