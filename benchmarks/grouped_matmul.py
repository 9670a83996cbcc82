"""The dropless experts' grouped matmul (meshtrain/ops/grouped_matmul.py `grouped_matmul`) alone, forward and
backward, on this machine's first device: its time against the planner's prediction for the program
that ran (meshtrain/planner/kernel_time.py, the calibrated KERNEL_CONSTANTS) and against a dense batched
matmul of the same FLOPs (the routed rows split evenly over the groups), each on a full buffer and on
one 1/fill filled (expert parallelism's worst-case receive buffer is 1/8 filled at Qwen3-30B-A3B's pod:
k 8, E/ep 16, ep 8, balanced), and its results against the loop's in fp32 (the error says whether the
kernels are right on this device). On a GPU the kernels are the Pallas Triton ones, which cost the rows
routed; elsewhere the loop over (tile, group) steps, which costs every tile of the buffer. The group ids
are an argument, as in the model, so XLA cannot fold the schedule.

    python benchmarks/grouped_matmul.py                      # CPU-sized: 8,192 rows, D 256, F 512
    python benchmarks/grouped_matmul.py --predict h100       # the same, priced for an H100 by XLA's GPU compiler
    python benchmarks/grouped_matmul.py --rows 131072 --d 2048 --f 768 --groups 128 --fill 1 --dtype bfloat16
    python benchmarks/grouped_matmul.py --rows 262144 --d 2048 --f 768 --groups 16 --fill 8 --dtype bfloat16

On a GPU the third line is one qwen3_30b_a3b expert projection per GPU on its pod (fsdp=64: 4 sequences
of 4,096 tokens, 8 experts each, all 128 experts local), the fourth the expert-parallel buffer of the
issue (ep=8).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's modules before any namesakes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import meshtrain  # noqa: E402, F401  (before JAX: no CUDA version-check traceback where no driver loads)

# max |error| / max |reference|, per operand dtype; fp32 dots run in TF32 on a GPU by default, XLA's and Triton's
TOLERANCE = {"float32": 2e-3, "bfloat16": 2e-2}
# Measured on an H200 (2026-12-04, JAX 0.11.2; forward + both backward products; every kernel on its
# shipped tile, each within bf16's tolerance of the fp32 loop):
# (buffer rows, D, F, experts, 1/fill filled, ms, calibrates `grouped_gemm_peak`), fitted with --fit
MEASURED_H200 = [(131072, 2048, 768, 128, 1, 4.156, True), (262144, 2048, 768, 16, 1, 6.257, True),
                 (262144, 2048, 768, 16, 8, 2.009, False)]
# --tiles: (BM, BK, BN, warps, stages) of the Triton kernels (meshtrain/ops/grouped_matmul_triton.py), the first
# Triton's usual tile, the third the shipped one
TILES = [(128, 64, 128, 4, 3), (128, 64, 128, 8, 3), (128, 64, 256, 8, 3), (128, 128, 128, 8, 3),
         (128, 32, 128, 4, 4), (64, 64, 128, 4, 4), (256, 64, 128, 8, 3), (64, 64, 256, 8, 3), (128, 64, 64, 4, 4),
         (256, 64, 256, 8, 3), (128, 64, 256, 8, 4)]
# --tiles tgmm: tgmm's own (rows step, BK, BN, warps, stages)
TGMM_TILES = [(128, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 3),
              (32, 128, 128, 4, 4), (64, 64, 256, 8, 3), (64, 128, 256, 8, 3), (32, 128, 256, 8, 4),
              (64, 256, 128, 8, 3), (32, 64, 128, 4, 5), (128, 128, 128, 8, 3)]


def inputs(rows: int, d: int, f: int, groups: int, fill: int, dtype):
    """x [rows, d], w [groups, d, f] and sorted group ids with rows // fill filled, the rest padding
    (group id `groups`, sorted last as `sorted_swiglu` sorts them)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    filled = rows // fill
    group = np.sort(np.concatenate([rng.integers(0, groups, filled), np.full(rows - filled, groups)]))
    x = jnp.asarray(rng.normal(size=(rows, d)), dtype)
    w = jnp.asarray(rng.normal(size=(groups, d, f)) / np.sqrt(d), dtype)
    return x, w, jnp.asarray(group, jnp.int32)


def grouped_step(rows_routed: int, kernels: str = "auto"):
    """jit of (x, w, group) -> (y, dx, dw) of sum(y^2): the forward and both backward products (padding
    rows of y and dx: 0 on the loop, not written by the Triton kernels; `error` compares the others)."""
    import jax
    import jax.numpy as jnp

    from meshtrain.ops.grouped_matmul import grouped_matmul

    def loss(x, w, g):
        y = grouped_matmul(x, w, g, rows_routed, kernels)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    def step(x, w, g):
        (_, y), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w, g)
        return y, dx, dw

    return jax.jit(step)


def dense_step():
    """jit of the dense batched matmul [G, m, d] @ [G, d, f], forward and both backward products."""
    import jax
    import jax.numpy as jnp

    loss = lambda x, w: jnp.sum(jnp.einsum("gmd,gdf->gmf", x, w).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, (0, 1)))


def seconds(step, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(step(*args))
    started = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(step(*args))
    return (time.perf_counter() - started) / repeats


def gpu_program(step, args, device: str) -> str:
    """`step`'s program as XLA's GPU compiler builds it for `device` (h100, h200, b200, gb200) without a GPU
    (compile-only devices, as `plan --compiler gpu`), for shapes and dtypes of `args`."""
    import jax

    from meshtrain.planner import compilers

    target = compilers.choose("gpu", device, 1, 8)
    mesh = jax.sharding.Mesh(np.array(target.devices[:1]), ("one",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args]
    with target.compiling(), jax.set_mesh(mesh):
        return step.lower(*shapes).compile().as_text()


def predicted_s(text: str, device: str) -> float:
    """The planner's seconds for a program's HLO `text` on `device`, with the shipped KERNEL_CONSTANTS."""
    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.planner import kernel_time

    return kernel_time.step_time(text, DEVICE_PROFILES[device], {})["step_s"]


def profile_here() -> str | None:
    """This machine's GPU's DEVICE_PROFILES name (h100, h200...), None off one the planner knows."""
    import jax

    from meshtrain.core.metrics import DEVICE_PROFILES, named_in

    here = jax.devices()[0]
    return named_in(here.device_kind, DEVICE_PROFILES) if here.platform == "gpu" else None


def error(step, reference, args) -> float:
    """max over y, dx (their rows of a group) and dw of max |step - reference| / max |reference|, the
    reference on fp32 operands at full matmul precision."""
    import jax
    import jax.numpy as jnp

    x, w, group = args
    got = step(*args)
    with jax.default_matmul_precision("highest"):
        want = reference(x.astype(jnp.float32), w.astype(jnp.float32), group)
    real = (group < w.shape[0])[:, None]
    rows = lambda y, dx, dw: (jnp.where(real, y, 0), jnp.where(real, dx, 0), dw)
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
               for a, b in zip(rows(*got), rows(*want)))


def kernels_ms(x, w, group, routed: int, repeats: int) -> dict:
    """Milliseconds of each Triton kernel alone (forward gmm, dx's gmm_t, dw's tgmm) at the module's tiles (in
    Pallas' interpreter off a GPU: a check of this function, not a time)."""
    import jax

    from meshtrain.ops import grouped_matmul as gm
    from meshtrain.ops import grouped_matmul_triton as triton

    interpret = jax.devices()[0].platform != "gpu"
    dy = jax.random.normal(jax.random.key(0), (x.shape[0], w.shape[2]), x.dtype)
    tiled = lambda a: gm._tiles(a, triton.BM)

    def run(kernel):
        def f(x, w, g, dy):
            steps, group_R = gm._triton_steps(g, w.shape[0], 1)
            if kernel == "tgmm":
                return triton.tgmm(tiled(x), tiled(dy), group_R, w.shape[0], 1, routed, interpret=interpret)
            return triton.gmm(tiled(dy if kernel == "gmm_t" else x), w, steps, group_R, routed,
                              transpose=kernel == "gmm_t", interpret=interpret)
        return seconds(jax.jit(f), (x, w, group, dy), repeats) * 1e3

    return {kernel: run(kernel) for kernel in ("gmm", "gmm_t", "tgmm")}


def tiles(a, dtype):
    """The three kernels' times per tile choice (TILES; tgmm's own, TGMM_TILES, with --tiles tgmm) on the full
    buffer: which tiles to ship."""
    from meshtrain.ops import grouped_matmul_triton as triton

    x, w, group = inputs(a.rows, a.d, a.f, a.groups, 1, dtype)
    names = ["BM", "BK", "BN", "WARPS", "STAGES"]
    names = ["TGMM_" + n for n in names] if a.tiles == "tgmm" else names
    print(f"| {', '.join(names)} | gmm ms | gmm_t ms | tgmm ms | sum |\n|---|---|---|---|---|")
    shipped = [getattr(triton, n) for n in names]
    for tile in TGMM_TILES if a.tiles == "tgmm" else TILES:
        for n, v in zip(names, tile):
            setattr(triton, n, v)
        try:
            ms = kernels_ms(x, w, group, a.rows, a.repeats)
            print(f"| {tile} | {ms['gmm']:.3f} | {ms['gmm_t']:.3f} | {ms['tgmm']:.3f} | {sum(ms.values()):.3f} |",
                  flush=True)
        except Exception as e:  # a tile this device cannot take (shared memory): said, and the next one
            print(f"| {tile} | failed: {str(e).splitlines()[0][:120]} ||||", flush=True)
    for n, v in zip(names, shipped):
        setattr(triton, n, v)


def fit():
    """`grouped_gemm_peak` (meshtrain/core/metrics.py KERNEL_CONSTANTS) fitted on MEASURED_H200's calibration
    rows: the share of the peak at which the programs XLA's GPU compiler builds for an H200 (no GPU) price
    the Triton kernels so that the worst |log(predicted / measured)| is least; the table with it."""
    import math

    import jax
    import jax.numpy as jnp

    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.planner import kernel_time

    texts = []
    for rows, d, f, groups, fill, _, _ in MEASURED_H200:
        args = [jax.ShapeDtypeStruct(s, t) for s, t in (((rows, d), jnp.bfloat16), ((groups, d, f), jnp.bfloat16),
                                                        ((rows,), jnp.int32))]
        texts.append(gpu_program(grouped_step(rows // fill), args, "h200"))
    profile = DEVICE_PROFILES["h200"]
    ms = lambda text, peak: 1e3 * kernel_time.step_time(
        text, {**profile, "kernels": {**profile["kernels"], "grouped_gemm_peak": peak}}, {})["step_s"]
    worst = lambda peak: max(abs(math.log(ms(t, peak) / row[5])) for t, row in zip(texts, MEASURED_H200) if row[6])
    best = min((p / 1000 for p in range(200, 1001, 5)), key=worst)
    shipped = profile["kernels"]["grouped_gemm_peak"]
    print(f"grouped_gemm_peak fitted on the calibration rows: {best:.3f} (shipped {shipped})")
    print("| buffer rows | experts | filled | measured | predicted, shipped | predicted, fitted | role |\n"
          "|---|---|---|---|---|---|---|")
    for text, (rows, _, _, groups, fill, measured, calibrates) in zip(texts, MEASURED_H200):
        print(f"| {rows:,} | {groups} | 1/{fill} | {measured:.3f} ms | {ms(text, shipped):.3f} ms "
              f"({ms(text, shipped) / measured:.2f}) | {ms(text, best):.3f} ms ({ms(text, best) / measured:.2f}) | "
              f"{'calibration' if calibrates else 'held out'} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192, help="the buffer's rows")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--f", type=int, default=512)
    p.add_argument("--groups", type=int, default=16, help="local experts, E/ep")
    p.add_argument("--fill", type=int, default=8, help="the partly filled buffer is 1/fill filled")
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--predict", help="price the program for this GPU (h100, h200, b200, gb200) by XLA's GPU compiler "
                                     "without one (default: on a GPU, the program it ran)")
    p.add_argument("--fit", action="store_true", help="fit `grouped_gemm_peak` on MEASURED_H200 (no GPU needed)")
    p.add_argument("--tiles", nargs="?", const="all", choices=("all", "tgmm"),
                   help="time each Triton kernel per tile choice (a GPU): all kernels' tiles, or tgmm's own")
    a = p.parse_args()
    if a.fit:
        return fit()
    import jax
    import jax.numpy as jnp

    if a.predict:
        from meshtrain.planner import compilers

        compilers.choose("gpu", a.predict, 1, 8)  # before JAX starts its CPU backend
    dtype = jnp.dtype(a.dtype)
    on = jax.devices()[0]
    if a.tiles:
        return tiles(a, dtype)
    print(f"{on.device_kind} ({on.platform}): buffer of {a.rows:,} rows, D {a.d}, F {a.f}, {a.groups} experts, "
          f"{a.dtype}; forward + both backward products")
    print("| buffer | rows routed | grouped matmul | TFLOP/s | predicted | predicted / measured | dense batched "
          "matmul, same FLOPs | grouped / dense | error vs fp32 loop |\n|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for fill in sorted({1, a.fill}):
        x, w, group = inputs(a.rows, a.d, a.f, a.groups, fill, dtype)
        routed = a.rows // fill
        step, args = grouped_step(routed), (x, w, group)
        compiled = step.lower(*args).compile()  # timed, and on a GPU priced: the program that ran
        measured = seconds(compiled, args, a.repeats)
        device = a.predict or profile_here()
        predicted = (float("nan") if device is None else
                     predicted_s(gpu_program(step, args, device) if a.predict else compiled.as_text(), device))
        m = routed // a.groups
        dense = seconds(dense_step(), (x[:a.groups * m].reshape(a.groups, m, a.d), w), a.repeats)
        err = error(step, grouped_step(routed, "loop"), args)
        worst = max(worst, err)
        flops = 6.0 * routed * a.d * a.f
        ratio = "n/a" if a.predict else f"{predicted / measured:.2f}"  # a GPU's prediction, this CPU's time
        print(f"| 1/{fill} filled | {routed:,} | {measured * 1e3:.3f} ms | {flops / measured / 1e12:.1f} | "
              f"{predicted * 1e3:.3f} ms | {ratio} | {dense * 1e3:.3f} ms | {measured / dense:.2f} | "
              f"{err:.1e} |", flush=True)
    if worst > TOLERANCE[a.dtype]:
        sys.exit(f"error: the grouped matmul on {on.device_kind} differs from the fp32 loop by {worst:.1e} "
                 f"(tolerance {TOLERANCE[a.dtype]:.0e} for {a.dtype}): its kernels are wrong on this device")


if __name__ == "__main__":
    main()
