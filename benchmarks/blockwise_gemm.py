"""fp8_blockwise's GEMM alone (meshtrain/ops/fp8_blockwise_triton.py) against the GEMMs it stands beside:
bf16, and fp8 with one scale per tensor (XLA's cuBLASLt fp8 GEMM), on operands already quantized, on this
machine's first device: each one's time, TFLOP/s, the planner's prediction for the program that ran
(meshtrain/planner/kernel_time.py, the calibrated KERNEL_CONSTANTS: the Triton kernel at
`grouped_gemm_peak`, never measured for this kernel) and its error against the fp32 product of the same
quantized values (the error says whether the kernel is right on this device). `--tiles` times the kernel
per tile choice (BM, BN, warps, stages), which is how its shipped tiles are to be chosen. Off a GPU the
kernel runs in Pallas' interpreter: a check of this script, not a time; `--predict` prices the GEMMs for a
GPU without running them.

    python benchmarks/blockwise_gemm.py                               # CPU-sized: 512 x 512 x 1024
    python benchmarks/blockwise_gemm.py --predict h100 --m 16384 --n 14336 --k 4096   # priced for an H100, not run
    python benchmarks/blockwise_gemm.py --m 16384 --n 14336 --k 4096  # Llama 3 8B's MLP up projection, 4 x 4,096 tokens
    python benchmarks/blockwise_gemm.py --m 16384 --n 14336 --k 4096 --tiles
"""
import argparse
import functools
import os
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's modules before any namesakes
sys.path.insert(1, str(Path(__file__).resolve().parent))  # grouped_matmul.py's timing and pricing
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# (grouped_matmul imports meshtrain before JAX: no CUDA version-check traceback where no driver loads)
from grouped_matmul import gpu_program, predicted_s, profile_here, seconds  # noqa: E402

# --tiles: (BM, BN, WARPS, STAGES) of the kernel, the first the shipped one
TILES = [(128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (256, 128, 8, 3),
         (64, 256, 8, 3), (128, 128, 4, 4), (128, 256, 8, 4)]
# max |error| / max |reference|: the kernel and the fp32 product sum the same products; the kernel writes bf16
TOLERANCE = 2.0 ** -8


def operands(m: int, n: int, k: int):
    """x [m, k] and w^T [n, k] in bf16, each quantized as fp8_blockwise does (x in 1 x 128 tiles, w in 128 x 128
    blocks) and per tensor as fp8 does."""
    import jax
    import jax.numpy as jnp

    from meshtrain.ops.block_scaled import FP8_BLOCKWISE, mx_quantize
    from meshtrain.ops.fp8 import E4M3, quantize

    x = jax.random.normal(jax.random.key(0), (1, m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (1, n, k), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    blockwise = (*mx_quantize(x, FP8_BLOCKWISE), *mx_quantize(w, FP8_BLOCKWISE, two_d=True))
    tensorwise = (*quantize(x, E4M3), *quantize(w, E4M3))
    return x, w, blockwise, tensorwise


def steps(interpret: bool) -> dict:
    """jit of each GEMM: name -> (function, which operands)."""
    import jax
    import jax.numpy as jnp

    from meshtrain.ops import fp8_blockwise_triton as triton
    from meshtrain.ops.fp8 import scaled_einsum

    def blockwise(qa, sa, qb, sb):
        swap = lambda s: jnp.swapaxes(s, 1, 2)
        return triton.local_gemm(qa, qb, swap(sa), swap(sb), jnp.bfloat16, interpret=interpret)

    return {"bf16": (jax.jit(lambda x, w: jnp.einsum("bmk,bnk->bmn", x, w)), "bf16"),
            "fp8 tensorwise": (jax.jit(functools.partial(scaled_einsum, "bmk,bnk->bmn")), "tensorwise"),
            "fp8_blockwise (Triton)": (jax.jit(blockwise), "blockwise")}


def tiles(a, blockwise, interpret: bool):
    """The kernel's time per tile choice (TILES)."""
    from meshtrain.ops import fp8_blockwise_triton as triton

    names = ("BM", "BN", "WARPS", "STAGES")
    shipped = [getattr(triton, n) for n in names]
    print(f"| {', '.join(names)} | ms | TFLOP/s |\n|---|---|---|")
    for tile in TILES:
        for n, v in zip(names, tile):
            setattr(triton, n, v)
        try:
            step, _ = steps(interpret)["fp8_blockwise (Triton)"]
            ms = seconds(step, blockwise, a.repeats) * 1e3
            print(f"| {tile} | {ms:.3f} | {2.0 * a.m * a.n * a.k / ms / 1e9:.1f} |", flush=True)
        except Exception as e:  # a tile this device cannot take (shared memory): said, and the next one
            print(f"| {tile} | failed: {str(e).splitlines()[0][:120]} ||", flush=True)
    for n, v in zip(names, shipped):
        setattr(triton, n, v)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=512, help="rows of x (tokens)")
    p.add_argument("--n", type=int, default=512, help="the weight's outputs")
    p.add_argument("--k", type=int, default=1024, help="the contraction (a multiple of 128)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--predict", help="price the programs for this GPU (h100, h200, b200, gb200) by XLA's GPU compiler "
                                     "without one, and run nothing (default: time them here, and on a GPU price "
                                     "the programs that ran)")
    p.add_argument("--tiles", action="store_true", help="time the kernel per tile choice (a GPU)")
    a = p.parse_args()
    if a.k % 128:
        sys.exit(f"error: --k {a.k} is no whole number of fp8_blockwise's 128-blocks: pass a multiple of 128")
    import jax
    import jax.numpy as jnp
    import numpy as np

    if a.predict:
        from meshtrain.planner import compilers

        compilers.choose("gpu", a.predict, 1, 8)  # before JAX starts its CPU backend
    on = jax.devices()[0]
    interpret = on.platform != "gpu"
    x, w, blockwise, tensorwise = operands(a.m, a.n, a.k)
    if a.tiles:
        return tiles(a, blockwise, interpret)
    device = profile_here()
    args_of = {"bf16": (x, w), "tensorwise": tensorwise, "blockwise": blockwise}
    flops = 2.0 * a.m * a.n * a.k
    where = f"priced for one {a.predict.upper()}, not run" if a.predict else f"{on.device_kind} ({on.platform})" + (
        ": the Triton kernel in Pallas' interpreter, not a time" if interpret else "")
    print(f"[{a.m}, {a.k}] x [{a.k}, {a.n}], one GEMM on operands already quantized; {where}")
    print("| GEMM | measured | TFLOP/s | predicted | predicted / measured |\n|---|---|---|---|---|")
    priced = steps(interpret=False)  # the GPU's kernel, whatever runs here
    for name, (step, which) in steps(interpret).items():
        args = args_of[which]
        if a.predict:
            predicted = predicted_s(gpu_program(priced[name][0], args, a.predict), a.predict)
            print(f"| {name} | - | {flops / predicted / 1e12:.1f} (predicted) | {predicted * 1e3:.3f} ms | - |")
            continue
        measured = seconds(step, args, a.repeats)
        predicted = predicted_s(step.lower(*args).compile().as_text(), device) if device else None
        priced_here = "- | -" if predicted is None else f"{predicted * 1e3:.3f} ms | {predicted / measured:.2f}"
        print(f"| {name} | {measured * 1e3:.3f} ms | {flops / measured / 1e12:.1f} | {priced_here} |", flush=True)
    if a.predict:
        return
    from meshtrain.ops.block_scaled import _emulated_gemm  # the blockwise GEMM by its definition, summed in fp32

    qa, sa, qb, sb = blockwise
    want = np.asarray(_emulated_gemm(qa, qb, sa, sb, jnp.float32))
    got = np.asarray(steps(interpret)["fp8_blockwise (Triton)"][0](*blockwise), np.float32)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"the kernel against the fp32 blockwise product: max error {err:.1e} of its largest value (bf16 output)")
    if err > TOLERANCE:
        sys.exit(f"error: fp8_blockwise's kernel on {on.device_kind} differs from the fp32 product by {err:.1e}: "
                 f"it is wrong on this device")


if __name__ == "__main__":
    main()
