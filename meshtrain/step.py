"""Train and eval steps on pure pytrees: loss -> grads (accumulated over microbatches) -> clip ->
nonfinite guard -> AdamW. The state is {'step', 'params', 'opt_state', 'skipped_steps'}; the batch
is [batch, seq_len + 1] tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshtrain import data_parallel
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


def make_loss_fn(model, precision: str):
    def loss_fn(params, tokens_BxL1):
        compute = cast_for_compute(params, precision)
        x_BxLxD = model.run_blocks(compute["blocks"], model.embed(compute, tokens_BxL1[:, :-1]))
        return model.loss(compute, x_BxLxD, tokens_BxL1[:, 1:])

    return loss_fn


def split_microbatches(tokens_BxL1, num_micro: int):
    """[B, L+1] -> [M, B/M, L+1] with microbatch m = rows i*M + m, so that every microbatch spans
    all data-parallel shards (a contiguous split would leave most devices idle)."""
    B = tokens_BxL1.shape[0]
    return tokens_BxL1.reshape(B // num_micro, num_micro, -1).swapaxes(0, 1)


def accumulate(grad_fn, microbatches: int, accumulator_specs):
    """(params, tokens) -> (mean loss, mean gradients) over `microbatches` slices of the batch, summed
    in a scan. The accumulator is pinned to `accumulator_specs` (PartitionSpecs over the axes that
    are not manual here), so the sum is kept sharded and never reduced inside the loop."""
    if microbatches == 1:
        return grad_fn
    pin = lambda tree: jax.tree.map(jax.lax.with_sharding_constraint, tree, accumulator_specs)

    def loss_and_grads(params, tokens_BxL1):
        def add(carry, micro_tokens):
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(params, constrain(micro_tokens, ("batch", "seq")))
            return (loss_sum + loss, pin(jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads))), None

        zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))  # fp32 sums
        (loss, grads), _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), zeros),
                                        split_microbatches(tokens_BxL1, microbatches))
        return loss / microbatches, jax.tree.map(lambda g: g / microbatches, grads)

    return loss_and_grads


def make_train_step(model, tx, schedule, precision: str, microbatches: int, zero: int, mesh, specs: dict,
                    pipeline=None):
    """`specs`: PartitionSpecs of 'params', 'grads' (pytrees) and 'batch'. `pipeline`: None, or
    (schedule, microbatches, virtual_stages, residuals) to run the stacked layers as pipeline stages
    over the mesh's `pipeline` axis (meshtrain/pipeline.py). Where `data` is manual
    (data_parallel.is_manual), each data shard computes on the compute-dtype parameters and its own
    rows, accumulates locally and the gradients are reduced over `data` once per step."""
    grad_specs = specs["grads"]
    if pipeline is not None:
        from meshtrain.pipeline import make_pipeline_grads

        grad_fn = make_pipeline_grads(model, precision, mesh, *pipeline, specs["params"], grad_specs)
    elif data_parallel.is_manual(mesh.shape[data_parallel.AXIS], microbatches=microbatches, zero=zero):
        local = accumulate(jax.value_and_grad(make_loss_fn(model, precision)), microbatches,
                           data_parallel.local_specs(grad_specs, set(mesh.axis_names) - {data_parallel.AXIS}))
        per_shard = data_parallel.data_parallel(local, mesh, specs["params"], grad_specs, specs["batch"])
        grad_fn = lambda params, tokens: per_shard(cast_for_compute(params, precision), tokens)  # gathers bf16
    else:
        grad_fn = accumulate(jax.value_and_grad(make_loss_fn(model, precision)), microbatches, grad_specs)

    def train_step(state, tokens_BxL1):
        params = state["params"]
        loss, grads = grad_fn(params, tokens_BxL1)
        # the reduced gradients' layout (where XLA reduces, this is its ZeRO-2/3 reduce-scatter)
        grads = jax.tree.map(lambda g, p, s: jax.lax.with_sharding_constraint(g.astype(p.dtype), s),
                             grads, params, grad_specs)
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
