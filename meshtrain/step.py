"""Train and eval steps on pure pytrees: loss -> grads (accumulated over microbatches) -> clip ->
nonfinite guard -> AdamW. The state is {'step', 'params', 'opt_state', 'skipped_steps'}; the batch
is [batch, seq_len + 1] tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from meshtrain.precision import cast_for_compute
from meshtrain.sharding import constrain


def lr_schedule(ocfg, total_steps: int):
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    warmup = min(ocfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, ocfg.lr, warmup, max(total_steps, warmup + 1),
                                              end_value=ocfg.lr * ocfg.min_lr_ratio)


def make_optimizer(ocfg, total_steps: int, logical_axes):
    """Global-norm clipping, then AdamW; weight decay only on matrices (not norms). The state's tree
    does not depend on any hyperparameter (clip_norm=0 is an identity in the clipping slot), so a
    checkpoint resumes with other optimizer settings."""
    decay_mask = jax.tree.map(lambda names: len([n for n in names if n != "layers"]) >= 2, logical_axes,
                              is_leaf=lambda n: isinstance(n, tuple))
    adamw = optax.adamw(lr_schedule(ocfg, total_steps), b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps,
                        weight_decay=ocfg.weight_decay, mask=decay_mask)
    clip = optax.clip_by_global_norm(ocfg.clip_norm) if ocfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, adamw)


def applied_lr(schedule, opt_state):
    """The learning rate an update applies: the schedule at the optimizer's own count, which
    skipped (NaN/Inf) steps do not advance."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    count = next(s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s))
    return schedule(count)


def cross_entropy(logits_BxLxV, targets_BxL):
    """Mean next-token loss. The target logit is picked with a one-hot product, not a gather, so a
    vocabulary split over `tensor` stays split (XLA's gather partitioning fails inside pipeline stages)."""
    logits = logits_BxLxV.astype(jnp.float32)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets_BxL, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return (jax.nn.logsumexp(logits, axis=-1) - target_logit).mean()


def make_loss_fn(model, precision: str):
    def loss_fn(params, tokens_BxL1):
        logits = model.apply(cast_for_compute(params, precision), tokens_BxL1[:, :-1])
        return cross_entropy(logits, tokens_BxL1[:, 1:])

    return loss_fn


def split_microbatches(tokens_BxL1, num_micro: int):
    """[B, L+1] -> [M, B/M, L+1] with microbatch m = rows i*M + m, so that every microbatch spans
    all data-parallel shards (a contiguous split would leave most devices idle)."""
    B = tokens_BxL1.shape[0]
    return tokens_BxL1.reshape(B // num_micro, num_micro, -1).swapaxes(0, 1)


def make_train_step(model, tx, schedule, precision: str, microbatches: int, grad_specs, mesh, pipeline=None):
    """`pipeline`: None, or (schedule, microbatches, virtual_stages, data_manual) to run the stacked
    layers as pipeline stages over the mesh's `pipeline` axis (meshtrain/pipeline.py)."""
    loss_fn = make_loss_fn(model, precision)
    grad_fn = jax.value_and_grad(loss_fn)
    pin_grads = lambda g: jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
                                       g, grad_specs)
    if pipeline is not None:
        from meshtrain.pipeline import make_pipeline_grads

        grad_fn = make_pipeline_grads(model, precision, mesh, *pipeline)

    def train_step(state, tokens_BxL1):
        params = state["params"]
        if microbatches == 1:
            loss, grads = grad_fn(params, tokens_BxL1)
        else:
            def accumulate(carry, micro_tokens):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(params, constrain(micro_tokens, ("batch", "seq")))
                return (loss_sum + loss, pin_grads(jax.tree.map(jnp.add, grad_sum, grads))), None

            zeros = pin_grads(jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                            split_microbatches(tokens_BxL1, microbatches))
            loss, grads = loss / microbatches, jax.tree.map(lambda g: g / microbatches, grads)
        grads = pin_grads(grads)  # ZeRO-2/3: sharded over `data`, so XLA reduce-scatters
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        # Nonfinite guard: a NaN/Inf loss or gradient updates nothing (the global norm is NaN/Inf
        # if any gradient element is), but the step still advances so the next batch is new.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {"step": state["step"] + 1,
                     "params": keep_if_bad(optax.apply_updates(params, updates), params),
                     "opt_state": keep_if_bad(opt_state, state["opt_state"]),
                     "skipped_steps": state["skipped_steps"] + (~finite).astype(jnp.int32)}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": applied_lr(schedule, state["opt_state"]), "finite": finite,
                   "skipped_steps": new_state["skipped_steps"]}
        return new_state, metrics

    return train_step
