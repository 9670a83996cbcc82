"""The vocab-tiled head + cross-entropy: the plain loss's value and gradients (fp32, 1e-5) for one
chunk or many, with the vocabulary split over `tensor`, and compiled temporaries far below the
[B, L, V] fp32 logits that the plain loss materialises."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.ops.loss import LOSS_CHUNK_TOKENS, chunk_positions, cross_entropy
from meshtrain.parallel.mesh import build_mesh
from meshtrain.parallel.sharding import activation_rules, make_rules


def plain_loss(x_BxLxD, w_DxV, targets_BxL):
    logits = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxL).mean()


def inputs(B=4, L=12, D=16, V=50):
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kx, (B, L, D)), jax.random.normal(kw, (D, V)) * 0.5,
            jax.random.randint(kt, (B, L), 0, V))


def assert_same_loss_and_grads(tiled, x, w, t):
    value, grads = jax.value_and_grad(tiled, argnums=(0, 1))(x, w, t)
    ref_value, ref_grads = jax.value_and_grad(plain_loss, argnums=(0, 1))(x, w, t)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [12, 4, 3, 1])
def test_tiled_loss_equals_the_plain_loss(chunk):
    x, w, t = inputs()
    budget = 4 * 50 * 4 * chunk  # B x C x V fp32 logits per chunk
    assert chunk_positions(4, 12, 50, budget, least_tokens=1) == chunk
    assert_same_loss_and_grads(lambda x, w, t: cross_entropy(x, w, t, budget, least_tokens=1), x, w, t)


def test_tiled_loss_with_the_vocabulary_split_over_tensor():
    mesh = build_mesh({"data": 1, "fsdp": 2, "tensor": 4, "pipeline": 1}, jax.devices()[:8])
    rules = make_rules()
    x, w, t = inputs(B=4, L=12, D=16, V=64)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x, w, t = put(x, P("fsdp")), put(w, P("fsdp", "tensor")), put(t, P("fsdp"))

    def tiled(x, w, t):
        with activation_rules(rules, mesh):
            return cross_entropy(x, w, t, budget=2 * 3 * 64 * 4, least_tokens=1)  # 4 chunks of 3 positions

    with jax.set_mesh(mesh):
        assert_same_loss_and_grads(jax.jit(tiled), x, w, t)


def test_tiled_loss_with_the_head_split_over_fsdp_beside_expert():
    """expert x fsdp (the MoE pods): the head's gradient is summed over the batch shards in two steps
    (reduce-scattered over fsdp onto the head's shards, all-reduced over expert): the same values."""
    mesh = build_mesh({"expert": 4, "fsdp": 2}, jax.devices()[:8])
    x, w, t = inputs(B=8, L=12, D=16, V=64)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x, w, t = put(x, P(("expert", "fsdp"))), put(w, P("fsdp")), put(t, P(("expert", "fsdp")))

    def tiled(x, w, t):
        with activation_rules(make_rules(), mesh):
            return cross_entropy(x, w, t, budget=3 * 64 * 4, least_tokens=1)  # 4 chunks of 3 positions

    with jax.set_mesh(mesh):
        assert_same_loss_and_grads(jax.jit(tiled), x, w, t)


@pytest.mark.fast
def test_no_full_logits_for_a_128k_vocabulary():
    """Vocab 128,256, seq 4096, batch 8, one device: the tiled loss's forward + backward keeps its
    temporaries at about two chunks' logits (and the head's gradients), below a sixth of the [B, L, V]
    fp32 logits (16.8 GB); the plain loss's exceed them."""
    B, L, D, V = 8, 4096, 64, 128_256
    args = (jax.ShapeDtypeStruct((B, L, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, L), jnp.int32))
    temp = lambda loss: jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile() \
        .memory_analysis().temp_size_in_bytes
    logits_bytes = B * L * V * 4
    tiled, plain = temp(cross_entropy), temp(plain_loss)
    print(f"temporaries: tiled {tiled / 1e9:.3f} GB, plain {plain / 1e9:.3f} GB, logits {logits_bytes / 1e9:.3f} GB")
    chunk_bytes = 4 * LOSS_CHUNK_TOKENS * V  # the chunk holds its least tokens: 1.05 GB of logits
    assert tiled < 2.5 * chunk_bytes < logits_bytes / 6 < logits_bytes <= plain
