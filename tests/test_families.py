"""Model families as one-module plug-ins (meshtrain/models/): the registry's surface (a dense model
has no MoE keys, configs of earlier runs still load), and the qwen3, qwen3_moe and gemma3 families
against transformers' Qwen3ForCausalLM, Qwen3MoeForCausalLM and Gemma3ForCausalLM (CPU torch, fp32,
random weights from tiny configs, nothing downloaded): logits and loss, bitwise import/export round
trips, the refused config.json forms; their tiny configs train on a sharded mesh (gemma3's: pipeline
stages holding different kinds of layer) as on one device and decode with a KV cache (gemma3's local
layers: a ring buffer of their window) as the full forward computes."""
import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import ROOT, max_param_diff, run_tiny

from meshtrain.config.loader import UserError, load_config
from meshtrain.engine.decode import generate
from meshtrain.interop import hf
from meshtrain.models import FAMILIES, make_spec, with_family
from meshtrain.models.base import scan_blocks
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.parallel.sharding import param_shardings
from meshtrain.testing import full_forward_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=24, initializer_range=0.2, rms_norm_eps=1e-6, rope_theta=1000000.0)  # head_dim != 64 / 4
TOKENS = np.random.default_rng(0).integers(0, 300, (2, 33))  # [B, L + 1]
QWEN3_TINY, QWEN3_MOE_TINY, GEMMA3_TINY = (str(ROOT / "configs" / f"{name}.yaml")
                                           for name in ("qwen3_tiny", "qwen3_moe_tiny", "gemma3_tiny"))
GEMMA3 = dict({k: v for k, v in COMMON.items() if k != "rope_theta"}, intermediate_size=96, query_pre_attn_scalar=16,
              sliding_window=8, layer_types=["sliding_attention", "full_attention"],  # the window < 32 positions
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def save_hf(folder, kind, **overrides):
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=96, **{**COMMON, **overrides}))
    elif kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**GEMMA3, **overrides}))
    else:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                             norm_topk_prob=True, **{**COMMON, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # the norms' scales start at 1: random ones, so a misplaced scale shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def hf_outputs(folder):
    """Hugging Face's logits on TOKENS[:, :-1] and its mean next-token loss over TOKENS."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.tensor(TOKENS).long()
    with torch.no_grad():
        return model(tokens[:, :-1]).logits.numpy(), model(tokens, labels=tokens).loss.item()


def imported(folder, mesh="1", devices=1):
    spec = hf.read_spec(folder)
    model = FAMILIES[spec.family](spec)
    on = build_mesh(parse_mesh(mesh, devices), jax.devices()[:devices])
    return model, hf.load_params(folder, model, param_shardings(model, on))


def ours(model, params):
    """Our logits on TOKENS[:, :-1] and our training loss (cross-entropy; the MoE auxiliary losses,
    which Hugging Face leaves out unless output_router_logits, apart)."""
    x = scan_blocks(model.block, params["blocks"], model.embed(params, TOKENS[:, :-1]), kinds=model.layer_kinds)[0]
    return np.asarray(model.head(params, x)), float(model.loss(params, x, TOKENS[:, 1:]))


def exports_bitwise(model, params, folder, back, hf_logits):
    """Export gives the imported tensors bitwise and the same config, and transformers loads it."""
    hf.save_params(params, model.cfg, back)
    original, exported = hf.SafetensorsFolder(folder), hf.SafetensorsFolder(back)
    assert original.tensors.keys() == exported.tensors.keys()
    assert all(np.array_equal(x, exported.get(name)) for name, x in original.tensors.items())
    assert hf.read_spec(back) == hf.read_spec(folder)
    np.testing.assert_allclose(hf_outputs(back)[0], hf_logits, atol=0, rtol=0)


@pytest.mark.parametrize("kind, tied", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_import_matches_transformers_and_exports_bitwise(tmp_path, kind, tied):
    folder = save_hf(tmp_path / "hf", kind, tie_word_embeddings=tied)
    model, params = imported(folder)
    assert model.cfg.family == kind and model.cfg.tie_embeddings == tied and model.cfg.head_dim == 24
    (logits, loss), (hf_logits, hf_loss) = ours(model, params), hf_outputs(folder)
    assert np.abs(hf_logits).max() > 1.0  # logits large enough for the comparison to mean something
    np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=0)
    assert abs(loss - hf_loss) < 1e-4
    plain = FAMILIES["llama" if kind == "qwen3" else "moe"]  # the same weights without the q/k norms
    blocks = {k: v for k, v in params["blocks"].items() if k not in ("q_norm", "k_norm")}
    assert np.abs(ours(plain(with_family(model.cfg, plain.name)), {**params, "blocks": blocks})[0]
                  - hf_logits).max() > 1e-2

    exports_bitwise(model, params, folder, tmp_path / "back", hf_logits)


def test_gemma3_matches_transformers_and_exports_bitwise(tmp_path):
    """A local layer (window 8 of 32 positions, rope base 10^4) and a global one (10^6, linear x8);
    query_pre_attn_scalar 16 != head_dim 24; random norm weights (gain 1 + w)."""
    folder = save_hf(tmp_path / "hf", "gemma3")
    model, params = imported(folder)
    assert model.cfg.layer_windows() == (8, 0) and model.cfg.rope_scaling == "linear"
    (logits, loss), (hf_logits, hf_loss) = ours(model, params), hf_outputs(folder)
    assert np.abs(hf_logits).max() > 1.0
    np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=0)
    assert abs(loss - hf_loss) < 1e-4
    every_layer_global = FAMILIES["gemma3"](dataclasses.replace(model.cfg, sliding_window_pattern=1))
    assert np.abs(ours(every_layer_global, params)[0] - hf_logits).max() > 1e-2

    exports_bitwise(model, params, folder, tmp_path / "back", hf_logits)


def test_sharded_import_equals_one_device(tmp_path):
    """Each device reads its shard of the experts (and of the q/k norms' scales, by their axes)."""
    folder = save_hf(tmp_path / "hf", "qwen3_moe")
    _, one = imported(folder)
    _, sharded = imported(folder, "fsdp=2,expert=2", devices=4)
    assert max_param_diff(jax.device_get(sharded), jax.device_get(one)) == 0
    experts = sharded["blocks"]["expert_gate"]  # [layers, experts, D, F]: split over expert and fsdp
    assert all(s.data.size * 4 == experts.size for s in experts.addressable_shards)


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\] is not implemented by meshtrain's qwen3_moe model"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not implemented"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False is not implemented"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not implemented"),
    ({"attention_bias": True}, "attention_bias=True is not implemented"),
])
def test_unsupported_qwen3_moe_configs_are_refused(tmp_path, change, message):
    config = hf.hf_config(load_config(QWEN3_MOE_TINY).model)
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=message):
        hf.read_spec(tmp_path)


LOCAL_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not implemented by meshtrain's gemma3_text"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not implemented"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not implemented"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types is not a repeating pattern"),
    ({"rope_parameters": LOCAL_ROPE}, "the sliding_attention layers' rope scaling 'linear' is not implemented"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}},
     "rope scaling 'yarn' is not implemented"),
])
def test_unsupported_gemma3_configs_are_refused(tmp_path, change, message):
    config = hf.hf_config(load_config(GEMMA3_TINY).model)
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=message):
        hf.read_spec(tmp_path)


def test_a_dense_model_has_no_expert_keys_and_earlier_records_still_load(tmp_path):
    llama, qwen3 = load_config(None).model, load_config(QWEN3_TINY).model
    assert not any(hasattr(m, k) for m in (llama, qwen3) for k in ("num_experts", "capacity_factor"))
    old = tmp_path / "old.yaml"  # a llama run's config.yaml of the flat spec: every family's keys
    old.write_text("model: {family: llama, num_layers: 2, num_experts: 0, experts_per_token: 2, "
                   "num_shared_experts: 0, capacity_factor: 0.0, router_aux_loss: 0.01, router_z_loss: 0.001}\n")
    assert load_config(str(old)).model == dataclasses.replace(llama, num_layers=2)
    record = {**dataclasses.asdict(llama), "num_experts": 0, "router_z_loss": 0.001}  # run.json of then
    assert make_spec(record) == llama
    order = tmp_path / "order.yaml"  # the family decides the keys, wherever it stands
    order.write_text("model: {num_experts: 8, experts_per_token: 2, family: qwen3_moe}\n")
    assert load_config(str(order)).model.num_experts == 8
    with pytest.raises(UserError, match="the qwen3 family has no num_experts .*; set model.family=moe"):
        load_config(QWEN3_TINY, ["model.num_experts=4"])
    with pytest.raises(UserError, match="model.num_experts=0: every qwen3_moe block routes to experts"):
        load_config(None, ["model.family=qwen3_moe"])


@pytest.mark.parametrize("config, mesh, devices", [(QWEN3_TINY, "fsdp=2,tensor=2", 4),
                                                   (QWEN3_MOE_TINY, "data=2,expert=2", 4),
                                                   (GEMMA3_TINY, "pipeline=2", 2)])
def test_tiny_configs_train_on_a_mesh_as_on_one_device(config, mesh, devices):
    """gemma3's pipeline stages hold different kinds of layer: local, local; global, local."""
    _, ref_losses, ref_params = run_tiny("parallel.mesh=1", devices=jax.devices()[:1], config=config)
    _, losses, params = run_tiny(f"parallel.mesh={mesh}", devices=jax.devices()[:devices], config=config)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert max_param_diff(params, ref_params) < 1e-5 and losses[-1] != losses[0]


@pytest.mark.parametrize("config", [QWEN3_TINY, QWEN3_MOE_TINY])
def test_cached_decoding_matches_the_full_forward(config):
    """Generation's cached forward (prefill, then a token at a time) normalizes q and k as training does."""
    spec = load_config(config).model
    model = FAMILIES[spec.family](spec)
    params = model.init(jax.random.key(0))
    tokens = TOKENS[:, :10] % spec.vocab_size
    full = np.asarray(model.apply(params, tokens))
    x, cache = model.decode(params, tokens[:, :8], model.init_cache(2, 10), np.zeros(2, np.int32))
    logits = [np.asarray(model.head(params, x))]
    for t in range(8, 10):
        x, cache = model.decode(params, tokens[:, t:t + 1], cache, np.full(2, t, np.int32))
        logits.append(np.asarray(model.head(params, x)))
    np.testing.assert_allclose(np.concatenate(logits, axis=1), full, atol=1e-5, rtol=0)


def test_gemma3_generates_the_full_forwards_greedy_tokens():
    """`generate` past the window (prompts of 19 and 5 tokens + 12 new, window 8), the 19-token
    prompt prefilled in chunks of 12 (a chunk longer than the window; the short row's second chunk
    all padding, which its ring never takes), on the one-device run's trained weights x 3 (distinct
    logits, so the argmax is no tie). The local layers' caches hold 8 positions."""
    trainer, _, trained = run_tiny("parallel.mesh=1", devices=jax.devices()[:1], config=GEMMA3_TINY)
    model, params = trainer.program.model, jax.tree.map(lambda a: a * 3, trained)
    cache = jax.eval_shape(lambda: model.init_cache(2, 30))
    assert cache["k_window"].shape[:3] == (3, 2, 8) and cache["k"].shape[:3] == (1, 2, 30)
    assert sum(a.size for a in jax.tree.leaves(cache)) == 2 * 2 * 2 * 16 * model.cfg.cached_positions(30)
    rows = [np.asarray(TOKENS[0, :19] % 256, np.int32), np.asarray(TOKENS[1, :5] % 256, np.int32)]
    got = generate(model, params, rows, 12, prefill_chunk=12)
    for a, b in zip(got, full_forward_greedy(model, params, rows, 12)):
        np.testing.assert_array_equal(a, b)
