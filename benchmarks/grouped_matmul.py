"""The dropless experts' grouped matmul (meshtrain/ops/grouped_matmul.py `grouped_matmul`) on a buffer that is partly
empty, as expert parallelism's worst-case receive buffer is (1/8 filled at Qwen3-30B-A3B's pod: k 8,
E/ep 16, ep 8, balanced): forward and backward time against a full buffer, on this machine's first
device. The loop runs every tile of the buffer, filled or not, so the time barely falls with the
fill: what the planner's roofline counts (`slot_matmul_params`, docs/experts.md). The group ids are
an argument, as in the model, so XLA cannot fold the schedule.

    python benchmarks/grouped_matmul.py                      # CPU-sized: 8,192 rows, D 256, F 512
    python benchmarks/grouped_matmul.py --rows 65536 --d 2048 --f 768 --dtype bfloat16   # a GPU
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.ops.grouped_matmul import grouped_matmul


def timed(rows: int, d: int, f: int, groups: int, fill: int, dtype, repeats: int) -> float:
    """Seconds per forward + backward of one grouped matmul with rows // fill of `rows` filled (the
    rest padding, group id `groups`, sorted last as `sorted_swiglu` sorts them)."""
    rng = np.random.default_rng(0)
    filled = rows // fill
    group = jnp.asarray(np.sort(np.concatenate([rng.integers(0, groups, filled), np.full(rows - filled, groups)])),
                        jnp.int32)
    x = jnp.asarray(rng.normal(size=(rows, d)), dtype)
    w = jnp.asarray(rng.normal(size=(groups, d, f)) / np.sqrt(d), dtype)
    loss = lambda x, w, g: jnp.sum(grouped_matmul(x, w, g).astype(jnp.float32) ** 2)
    step = jax.jit(jax.grad(loss, (0, 1)))
    jax.block_until_ready(step(x, w, group))
    started = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(step(x, w, group))
    return (time.perf_counter() - started) / repeats


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--f", type=int, default=512)
    p.add_argument("--groups", type=int, default=16, help="local experts, E/ep")
    p.add_argument("--fill", type=int, default=8, help="the buffer is 1/fill filled")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    full, partly = (timed(a.rows, a.d, a.f, a.groups, fill, jnp.dtype(a.dtype), a.repeats) for fill in (1, a.fill))
    print(f"{jax.devices()[0].device_kind}: {a.rows} rows, D {a.d}, F {a.f}, {a.groups} experts, {a.dtype}")
    print(f"full buffer: {full * 1e3:.1f} ms; 1/{a.fill} filled: {partly * 1e3:.1f} ms per forward+backward "
          f"({partly / full:.2f}x)")


if __name__ == "__main__":
    main()
