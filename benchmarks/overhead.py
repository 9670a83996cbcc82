"""Library overhead on one CPU device: meshtrain's full training loop (`Trainer.fit`: data,
compiled step, nonfinite guard, logging) against a minimal hand-written jitted JAX step of the same
model and math (same LanguageModel, AdamW + clipping, donated state, the same synthetic batch per
step; the baseline decays every parameter, meshtrain only matrices, which costs the same).
Prints tokens/s of each and the ratio, from interleaved repeats in one run (median of each), and
meshtrain's host time per step spent waiting for its batch (`data_wait_s`), with the batch built
ahead in a background thread (data.prefetch=1, the default) and in the loop (data.prefetch=0).

    python benchmarks/overhead.py [--steps 40] [--repeats 5]
"""
import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from meshtrain.config.loader import load_config  # noqa: E402
from meshtrain.data import synthetic_rows  # noqa: E402
from meshtrain.models import LanguageModel  # noqa: E402
from meshtrain.run.loggers import MetricsLog  # noqa: E402
from meshtrain.run.trainer import Trainer  # noqa: E402


def config(steps, prefetch=1):
    return load_config("configs/shakespeare_char.yaml", [
        f"data.prefetch={prefetch}", "parallel.mesh=1", "data.kind=synthetic", "optim.warmup_steps=5",
        f"train.steps={steps}", f"train.log_every={steps}", "train.eval_every=0", "checkpoint.resume=never",
        f"out={tempfile.mkdtemp()}"])


def hand_written(cfg):
    """The same training math in plain JAX: no mesh, no rules, no guard, no logging."""
    model = LanguageModel(cfg.model)
    o = cfg.optim
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, cfg.train.steps, o.lr * o.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))

    def loss_fn(params, tokens):
        logits = model.apply(params, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def init(key):
        params = model.init(key)
        return params, tx.init(params)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return init, jax.jit(step, donate_argnums=(0, 1))


def time_meshtrain(steps, prefetch):
    """(tokens/s, host seconds per step waiting for the batch), steps 2..steps as logged: excludes
    the compile and the final checkpoint save."""
    trainer = Trainer(config(steps, prefetch))
    trainer.fit(1, log=MetricsLog("/tmp/meshtrain-bench", primary=False))  # warm up
    last = trainer.fit(steps, log=MetricsLog("/tmp/meshtrain-bench", primary=False))[-1]
    return last["tokens_per_sec"], last["data_wait_s"]


def time_hand_written(steps, parts):
    init, step = parts
    cfg = config(steps)
    B, L, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    params, opt_state = init(jax.random.key(0))
    # the same synthetic batches as meshtrain's (data generation is not library overhead)
    batch = lambda k: jax.device_put(synthetic_rows(np.random.default_rng([0, 0, k]), 0, V, (B, L + 1)))
    params, opt_state, loss = step(params, opt_state, batch(0))
    loss.block_until_ready()
    start = time.perf_counter()
    for k in range(1, steps):
        params, opt_state, loss = step(params, opt_state, batch(k))
    loss.block_until_ready()
    return (steps - 1) * B * L / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    parts = hand_written(config(args.steps))
    runs = {"prefetch": [], "in the loop": [], "hand": []}
    for _ in range(args.repeats):
        runs["prefetch"].append(time_meshtrain(args.steps, 1))
        runs["in the loop"].append(time_meshtrain(args.steps, 0))
        runs["hand"].append((time_hand_written(args.steps, parts), None))
    median = lambda rows, i: statistics.median(r[i] for r in rows)
    h = median(runs["hand"], 0)
    print(f"| loop | tokens/s (median of {args.repeats}) | vs hand-written | host wait for the batch per step |\n"
          f"|---|---|---|---|")
    for name, label in (("prefetch", "meshtrain Trainer.fit, data.prefetch=1 (default)"),
                        ("in the loop", "meshtrain Trainer.fit, data.prefetch=0")):
        m = median(runs[name], 0)
        print(f"| {label} | {m:,.0f} | {m / h:.3f} | {median(runs[name], 1) * 1e3:.2f} ms |")
    print(f"| hand-written jitted step (batch built in the loop) | {h:,.0f} | 1.000 | |")


if __name__ == "__main__":
    main()
