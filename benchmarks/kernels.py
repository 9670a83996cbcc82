"""Temporaries of the loss and attention kernels, forward + backward, from compiled programs on one
CPU device (fp32): the plain head + cross-entropy (full [B, L, V] logits) vs the vocab-tiled one
(meshtrain/ops/loss.py), and XLA attention ([B, H, L, L] scores) vs the blockwise kernel
(meshtrain/ops/attention.py), over sequence lengths.

    python benchmarks/kernels.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from meshtrain.ops.attention import BACKENDS  # noqa: E402
from meshtrain.ops.loss import cross_entropy  # noqa: E402


def temp_bytes(fn, *shapes) -> int:
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    grads = jax.grad(fn, argnums=tuple(i for i, (_, d) in enumerate(shapes) if d == jnp.float32))
    return jax.jit(grads).lower(*args).compile().memory_analysis().temp_size_in_bytes


def plain_loss(x_BxLxD, w_DxV, targets_BxL):
    logits = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxL).mean()


def main():
    B, D, V = 8, 64, 128_256
    print(f"Head + loss, batch {B}, width {D}, vocab {V:,}\n"
          "| seq | logits GB | plain GB | tiled GB |\n|---|---|---|---|")
    for L in (1024, 2048, 4096):
        shapes = (((B, L, D), jnp.float32), ((D, V), jnp.float32), ((B, L), jnp.int32))
        plain, tiled = temp_bytes(plain_loss, *shapes), temp_bytes(cross_entropy, *shapes)
        print(f"| {L} | {B * L * V * 4 / 1e9:.2f} | {plain / 1e9:.2f} | {tiled / 1e9:.2f} |", flush=True)
    B, H, K = 1, 8, 16
    print(f"\nAttention, batch {B}, {H} heads of {K}\n"
          "| seq | scores MiB | xla MiB | blockwise MiB |\n|---|---|---|---|")
    for L in (1024, 2048, 4096, 8192):
        shapes = [((B, L, H, K), jnp.float32)] * 3
        per_kernel = [temp_bytes(lambda q, k, v, kernel=kernel: jnp.sum(BACKENDS[kernel](q, k, v)), *shapes)
                      for kernel in ("xla", "blockwise")]
        print(f"| {L} | {B * H * L * L * 4 / 2**20:.0f} | {per_kernel[0] / 2**20:.0f} | {per_kernel[1] / 2**20:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
