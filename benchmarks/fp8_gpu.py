"""fp8 matmuls as XLA's GPU compiler builds them, without a GPU: a projection's einsum, forward and
both gradients, as meshtrain/ops/fp8.py writes it (the fp8 tensors into the dot, the scales as the
GEMM's alpha) beside the quantize-dequantize (QDQ) form it replaced (an einsum of q x s in bf16),
each compiled for one H100 (meshtrain/planner/compilers.py) with its GEMMs counted by operand type
(meshtrain/planner/kernels.py); then both run on this CPU, and how far apart their numbers are.

    python benchmarks/fp8_gpu.py                              # llama_1b's MLP up projection, 8 x 2048 tokens
    python benchmarks/fp8_gpu.py --batch 2 --seq 16 --d 32 --f 64   # tiny
"""
import argparse
import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.ops.fp8 import E4M3, E5M2, dequantize, fp8_einsum, quantize
from meshtrain.planner import compilers, kernels

SPEC = "bld,df->blf"


def qdq_einsum(x, w, g):
    """The replaced form: an einsum of the dequantized operands, its vjp of the dequantized e5m2 cotangent."""
    dq = lambda t, dtype: dequantize(*quantize(t, dtype))
    y, vjp = jax.vjp(functools.partial(jnp.einsum, SPEC), dq(x, E4M3), dq(w, E4M3))
    return (y, *vjp(dq(g, E5M2)))


def gemm_einsum(x, w, g):
    y, vjp = jax.vjp(functools.partial(fp8_einsum, SPEC), x, w)
    return (y, *vjp(g))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--f", type=int, default=8192)
    a = p.parse_args()
    gpu = compilers.choose("gpu", "h100", 1, 8).devices[0]
    shapes = ((a.batch, a.seq, a.d), (a.d, a.f), (a.batch, a.seq, a.f))
    on_gpu = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(gpu)) for s in shapes]
    print(f"{SPEC} with x {shapes[0]}, w {shapes[1]}, bf16; forward + both gradients, compiled for one H100")
    print("| form | GEMMs by operand types (the GPU program) |")
    print("|---|---|")
    for name, fn in (("QDQ (replaced)", qdq_einsum), ("fp8 operands into the dot (meshtrain)", gemm_einsum)):
        sites = Counter()
        for site in kernels.gemm_sites(jax.jit(fn).lower(*on_gpu).compile().as_text()):
            sites[site["types"]] += site["times"]
        print(f"| {name} | {', '.join(f'{t} {n:.0f}' for t, n in sorted(sites.items())) or 'none'} |")
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s) * scale, jnp.bfloat16) for s, scale in zip(shapes, (1.0, 0.02, 1.0))]
    for name, old, new in zip(("y", "dx", "dw"), jax.jit(qdq_einsum)(*args), jax.jit(gemm_einsum)(*args)):
        old, new = np.asarray(old, np.float32), np.asarray(new, np.float32)
        print(f"on the CPU, {name}: {np.mean(old != new):.1%} of the elements differ, by at most "
              f"{np.max(np.abs(old - new)) / np.max(np.abs(old)):.2e} of the largest |value|")


if __name__ == "__main__":
    main()
