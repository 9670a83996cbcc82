"""Attention kernels: the blockwise (online-softmax) kernel computes the XLA kernel's values and
gradients (fp32) at any block size, with grouped-query heads, inside the model too, while never
forming the [B, H, L, L] scores; cuDNN refuses fp32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import meshtrain.ops.attention as attention_lib
from meshtrain.config.loader import UserError
from meshtrain.ops.attention import BACKENDS, blockwise_attention, xla_attention


def qkv(B=2, L=24, H=4, G=2, K=8):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (B, L, H, K)), jax.random.normal(kk, (B, L, G, K)),
            jax.random.normal(kv, (B, L, G, K)))


@pytest.mark.parametrize("block", [24, 8, 6, 1])
def test_blockwise_equals_xla_values_and_gradients(block):
    q, k, v = qkv()
    cotangent = jax.random.normal(jax.random.key(1), q.shape)
    pull = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, block=block)
    xla = xla_attention
    np.testing.assert_allclose(blockwise(q, k, v), xla(q, k, v), atol=1e-5)
    for a, b in zip(pull(blockwise), pull(xla)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_blockwise_model_matches_xla_model(monkeypatch):
    from meshtrain.models import LanguageModel
    from meshtrain.objectives.next_token import make_loss_fn

    monkeypatch.setattr(attention_lib, "ATTENTION_BLOCK", 4)  # 4 blocks over the tiny model's 16 positions
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 256)
    results = {}
    for kernel in ("xla", "blockwise"):  # the backend is given to the model from outside
        model = LanguageModel(tiny_config().model, attention=BACKENDS[kernel])
        params = model.init(jax.random.key(0))
        results[kernel] = jax.value_and_grad(make_loss_fn(model, "fp32"), has_aux=True)(params, tokens)
        results[kernel] = (results[kernel][0][0], results[kernel][1])
    np.testing.assert_allclose(results["blockwise"][0], results["xla"][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results["blockwise"][1]), jax.tree.leaves(results["xla"][1])):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.fast
def test_blockwise_never_forms_the_scores():
    """Forward + backward at L=4096, 8 heads: XLA's temporaries hold [B, H, L, L] fp32 scores (512 MiB);
    the blockwise kernel's depend on its 512-position block, not on L: under an eighth of that."""
    B, L, H, K = 1, 4096, 8, 16
    spec = jax.ShapeDtypeStruct((B, L, H, K), jnp.float32)
    temp = lambda kernel: jax.jit(jax.grad(lambda q, k, v: jnp.sum(BACKENDS[kernel](q, k, v)), argnums=(0, 1, 2))) \
        .lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
    scores = B * H * L * L * 4
    blockwise, xla = temp("blockwise"), temp("xla")
    print(f"temporaries: blockwise {blockwise / 2**20:.1f} MiB, xla {xla / 2**20:.1f} MiB, "
          f"scores {scores / 2**20:.0f} MiB")
    assert blockwise < scores / 8 < scores <= xla


@pytest.mark.fast
def test_cudnn_needs_a_gpu_and_bf16():
    from meshtrain.engine.program import TrainProgram

    build = lambda *overrides: TrainProgram.from_config(
        tiny_config("parallel.mesh=1", "parallel.attention=cudnn", *overrides), devices=jax.devices()[:1])
    if jax.default_backend() != "gpu":
        with pytest.raises(UserError, match="parallel.attention=cudnn needs an NVIDIA GPU"):
            build("parallel.precision=bf16")
    else:
        with pytest.raises(UserError, match="runs in bf16 only; set parallel.precision=bf16"):
            build("parallel.precision=fp32")
        build("parallel.precision=bf16")


@pytest.mark.fast
def test_blockwise_refuses_a_sequence_it_would_split_into_tiny_blocks():
    from meshtrain.engine.program import TrainProgram

    with pytest.raises(UserError,
                       match=r"splits train.seq_len=1031 into blocks of 1 positions .*e.g. a multiple of 128"):
        TrainProgram.from_config(tiny_config("parallel.mesh=1", "parallel.attention=blockwise", "train.seq_len=1031"),
                                 devices=jax.devices()[:1])
