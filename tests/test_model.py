"""Model properties: causality, GQA, remat and bf16 policies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from meshtrain.models import LanguageModel
from meshtrain.objectives.next_token import make_loss_fn
from meshtrain.ops.attention import xla_attention


@pytest.fixture(scope="module")
def model_and_params():
    model = LanguageModel(tiny_config().model)
    return model, model.init(jax.random.key(0))


def test_logits_are_causal(model_and_params):
    model, params = model_and_params
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    changed = tokens.at[:, 8:].set(7)
    a, b = model.apply(params, tokens), model.apply(params, changed)
    np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not np.allclose(a[:, 8:], b[:, 8:])


def test_grouped_query_attention_equals_repeated_kv_heads():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 6, 8, 4))
    k, v = jax.random.normal(kk, (2, 6, 2, 4)), jax.random.normal(kv, (2, 6, 2, 4))
    grouped = xla_attention(q, k, v)
    full = xla_attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2))
    np.testing.assert_allclose(grouped, full, atol=1e-5)
    reference = jax.nn.dot_product_attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2), is_causal=True)
    np.testing.assert_allclose(grouped, reference, atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "save_matmuls"])
def test_remat_policies_keep_gradients(remat, model_and_params):
    model, params = model_and_params
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 256)
    grads = {}
    for policy in ("none", remat):  # the plan's policy wraps the model's block from outside
        grads[policy] = jax.jit(jax.grad(make_loss_fn(model, "fp32", policy), has_aux=True))(params, tokens)[0]
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_remat_full_saves_activation_memory(model_and_params):
    _, params = model_and_params
    tokens = jnp.zeros((16, 65), jnp.int32)
    temp = {}
    model = LanguageModel(tiny_config("model.num_layers=8").model)
    p8 = model.init(jax.random.key(0))
    for policy in ("none", "full"):
        temp[policy] = jax.jit(jax.grad(make_loss_fn(model, "fp32", policy), has_aux=True)).lower(p8, tokens) \
            .compile().memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["none"]


def test_bf16_policy_stays_close_to_fp32(model_and_params):
    model, params = model_and_params
    tokens = jax.random.randint(jax.random.key(3), (4, 17), 0, 256)
    fp32 = make_loss_fn(model, "fp32")(params, tokens)[0]
    bf16 = make_loss_fn(model, "bf16")(params, tokens)[0]
    assert bf16.dtype == jnp.float32  # loss stays fp32
    assert abs(float(bf16) - float(fp32)) / float(fp32) < 1e-2
    assert jax.grad(make_loss_fn(model, "bf16"), has_aux=True)(params, tokens)[0]["blocks"]["wq"].dtype == jnp.float32


@pytest.mark.fast
def test_untied_head_and_logical_axes():
    model = LanguageModel(tiny_config("model.tie_embeddings=false").model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    axes = model.logical_axes(params)
    assert axes["lm_head"] == ("embed", "vocab")
    assert axes["blocks"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert params["blocks"]["wq"].shape == (4, 32, 8, 8)
    assert params["blocks"]["wk"].shape == (4, 32, 4, 8)
