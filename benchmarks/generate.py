"""Decode speed: cached generation (meshtrain/generate.py: one jitted prefill + while_loop over
the KV cache) against recomputing the forward for every new token, over the whole sequence so far
("full") or over the last train.seq_len tokens (nanoGPT's crop). Tokens/s counts every row. Speed
does not depend on the weights: a config's model gets random ones, a --run its own.

    python benchmarks/generate.py [--config configs/shakespeare_char.yaml | --run RUN] [--new 200]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.config.loader import load_config  # noqa: E402
from meshtrain.engine.decode import generate  # noqa: E402
from meshtrain.generate import load  # noqa: E402
from meshtrain.models import FAMILIES  # noqa: E402
from meshtrain.run.run_dir import run_config  # noqa: E402


def best_seconds(fn, reps: int) -> float:
    fn()  # compile
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def recompute(model, params, prompt, new: int, width: int | None, rows: int):
    """Greedy decoding by a jitted full forward per token over the last `width` positions (None: all)."""
    apply = jax.jit(lambda p, t: jnp.argmax(model.apply(p, t), -1))
    P = len(prompt)

    def run():
        tokens = jnp.zeros((rows, P + new), jnp.int32).at[:, :P].set(prompt)
        for t in range(new):
            end = P + t
            lo = max(0, end - width) if width else 0
            view = jax.lax.dynamic_slice_in_dim(tokens, lo, width, 1) if width else tokens
            tokens = tokens.at[:, end].set(apply(params, view)[:, end - 1 - lo])
        return jax.block_until_ready(tokens)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/shakespeare_char.yaml")
    ap.add_argument("--run", help="a training run (its weights) instead of --config's random ones")
    ap.add_argument("--new", type=int, default=200, help="new tokens per prompt")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.run:
        (model, params, _, _), cfg = load(args.run), run_config(args.run)
    else:
        cfg = load_config(args.config)
        model = FAMILIES[cfg.model.family](cfg.model)
        params = jax.jit(model.init)(jax.random.key(0))
    window, prompt = cfg.train.seq_len, np.arange(6, dtype=np.int32) % cfg.model.vocab_size
    print(f"{cfg.model.num_layers} layers, width {cfg.model.d_model}, {args.new} new tokens, "
          f"window {window}, {jax.devices()[0].device_kind}\n"
          f"| prompts | cached tokens/s | full recompute tokens/s | crop to {window} tokens/s |\n|---|---|---|---|")
    for rows in (1, 8):
        # the lambdas are called in this iteration; the defaults bind this iteration's rows
        cached = best_seconds(lambda prompts=[prompt] * rows: generate(model, params, prompts, args.new, window=window),
                              args.reps)
        full = best_seconds(recompute(model, params, prompt, args.new, None, rows), 1)
        crop = best_seconds(recompute(model, params, prompt, args.new, window, rows), 1)
        rate = lambda s, rows=rows: f"{rows * args.new / s:,.0f}"
        print(f"| {rows} | {rate(cached)} | {rate(full)} ({full / cached:.1f}x slower) | "
              f"{rate(crop)} ({crop / cached:.1f}x slower) |", flush=True)


if __name__ == "__main__":
    main()
