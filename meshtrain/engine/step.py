"""The train step on pure pytrees: the objective's inputs (meshtrain/objectives/) -> grads
(accumulated over microbatches, by one of three executors) -> clip -> nonfinite guard -> the
optimizer (meshtrain/ops/optimizers.py). The state is {'step', 'params', 'opt_state',
'skipped_steps', 'loss_scale'}, 'grad_error' under int8 gradient compression
(meshtrain/parallel/compression.py), and the objective's own entries (`Objective.initial_state`);
the batch is the objective's ([batch, seq_len + 1] tokens, or `sequences_per_row` sequences a row)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from meshtrain.engine.pipeline_step import make_pipeline_grads, make_pipeline_scores
from meshtrain.objectives.base import forward_scores
from meshtrain.ops import offload
from meshtrain.ops.optimizers import LR_SCHEDULES, OPTIMIZERS
from meshtrain.ops.precision import cast_for_compute, scales_loss, update_loss_scale
from meshtrain.ops.trainable import merge, select
from meshtrain.parallel import compression, data_parallel
from meshtrain.parallel.batching import Gradients, StepInputs, accumulate
from meshtrain.parallel.sharding import gathered


def lr_schedule(ocfg, total_steps: int):
    """`optim.schedule` over `total_steps` (meshtrain/ops/optimizers.py LR_SCHEDULES)."""
    return LR_SCHEDULES[ocfg.schedule](ocfg, total_steps)


def optimizer_parts(ocfg, total_steps: int, logical_axes):
    """(global-norm clipping, `optim.optimizer`): meshtrain/ops/optimizers.py OPTIMIZERS, which
    reads the parameters' logical axes (weight decay on matrices, not norms; which dimensions form
    each matrix). clip_norm=0 is an identity in the clipping slot."""
    clip = optax.clip_by_global_norm(ocfg.clip_norm) if ocfg.clip_norm > 0 else optax.identity()
    return clip, OPTIMIZERS[ocfg.optimizer].build(ocfg, lr_schedule(ocfg, total_steps), logical_axes)


def make_optimizer(ocfg, total_steps: int, logical_axes):
    """The chain of `optimizer_parts`. The state's tree does not depend on any other hyperparameter,
    so a checkpoint resumes with other optimizer settings."""
    return optax.chain(*optimizer_parts(ocfg, total_steps, logical_axes))


def kept_unless(applied, new, old):
    """`new` where the step is `applied`, else `old` (the nonfinite guard's choice, leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)


def in_place_update(tx):
    """The step's optimizer update with the state on the device: (grads, opt_state, trained,
    applied, unscale, grad_norm) -> (new trained parameters, new opt_state), both kept as they were
    where `applied` (the nonfinite guard) is false; the gradients are finished (`unscale`, the global
    `grad_norm`: what meshtrain/ops/offload.py `offloaded_update`, the host-memory one, reads)."""
    def update(grads, opt_state, trained, applied, unscale=None, grad_norm=None):
        updates, new_state = tx.update(grads, opt_state, trained)
        return (kept_unless(applied, optax.apply_updates(trained, updates), trained),
                kept_unless(applied, new_state, opt_state))

    return update


def applied_lr(schedule, opt_state):
    """The learning rate an update applies: the schedule at the optimizer's own count, which
    skipped (NaN/Inf) steps do not advance."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    count = next(s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s))
    return schedule(count)


def metrics_and_grads(loss, keep=lambda path: True):
    """`loss` ((params, rows, shared) -> (objective, metrics): an objective's, meshtrain/objectives/)
    -> a gradient function (meshtrain/parallel/batching.py): the metrics and the gradients of the
    objective, times the inputs' loss scale when there is one (fp16, meshtrain/ops/precision.py), by
    the parameters `keep` accepts (`ModelSpec.trainable`) only: the others are constants."""
    def fn(params, inputs: StepInputs) -> Gradients:
        def objective(trained):
            value, metrics = loss(merge(params, trained), inputs.rows, inputs.shared)
            return (value if inputs.loss_scale is None else value * inputs.loss_scale), metrics

        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(select(params, keep))
        return Gradients(metrics, grads)

    return fn


def grad_norms_by_group(grads, embed_stacks: tuple = ()) -> dict:
    """The gradient norms of each stacked layer ('layer': [layers] of `blocks`, storage order, over
    every block parameter; 'embed_stacks': [layers] of the stacks the embedding runs before `blocks`
    (the model's `embed_stacks`, e.g. deepseek_v3's dense first layers), model order) and of each
    parameter kind ('kind': {name: norm}, a block parameter over all layers, e.g. 'wq', or a top-level
    one, e.g. 'embedding' or a whole embed stack). One sum of squares per layer and leaf: the same
    reads as the global norm's, plus [layers]-sized results."""
    squares = lambda g: jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim)))
    per_layer = lambda stack: sum(squares(g) for g in jax.tree.leaves(stack))
    per_kind_L = {name: per_layer(sub) for name, sub in grads["blocks"].items()}
    kind = {name: jnp.sqrt(jnp.sum(s_L)) for name, s_L in per_kind_L.items()}
    kind |= {name: optax.tree.norm(sub) for name, sub in grads.items() if name != "blocks"}
    before = [jnp.sqrt(per_layer(grads[name])) for name in embed_stacks if jax.tree.leaves(grads.get(name, {}))]
    return {"layer": jnp.sqrt(sum(per_kind_L.values())), "embed_stacks": jnp.concatenate(before) if before else
            jnp.zeros((0,), jnp.float32), "kind": kind}


def balance_routers(model, params, metrics, batch_shape, applied, sequences_per_row: int = 1):
    """The parameters with each routed layer's `router_bias` moved toward balance
    (the MoE model's `balanced_router_bias`, models/routed.py), unless the step was skipped, and the metrics with
    'expert_load' as counts [routed layers, E] (storage order) and 'batch_load_max', the worst
    layer's busiest expert's count over the mean count (1 = balanced over the whole global batch).
    `batch_shape`: the step's [B, n (L + 1)], n `sequences_per_row` (the objective's)."""
    c = model.cfg
    n = sequences_per_row
    rows, seq = n * batch_shape[0], batch_shape[1] // n - 1
    bias, count_NxE = model.balanced_router_bias(params["blocks"]["router_bias"], metrics["expert_load"],
                                                 rows * seq * c.experts_per_token)
    blocks = {**params["blocks"], "router_bias": jnp.where(applied, bias, params["blocks"]["router_bias"])}
    load_max = jnp.max(count_NxE) * c.num_experts / (rows * seq * c.experts_per_token)
    return {**params, "blocks": blocks}, {**metrics, "expert_load": count_NxE, "batch_load_max": load_max}


def make_scores(model, plan, mesh, param_specs, objective):
    """The objective's forward-only scores ((params, rows) -> per-row outputs, `Objective.scores`)
    a microbatch at a time, through the pipeline's stages on a pipeline (`make_pipeline_scores`):
    the forward pass before the gradients (`scores_first`) and the evaluation's."""
    stages = mesh.shape["pipeline"]
    if stages > 1:
        return make_pipeline_scores(model, plan, mesh, param_specs, objective)
    return forward_scores(objective.scores, plan.num_microbatches(stages))


def make_train_step(model, update, schedule, plan, mesh, specs: dict, objective, layer_norms: bool = False,
                    reuse: bool = False):
    """The step of `objective` (meshtrain/objectives/base.py) for `plan` (a ParallelPlan) on `mesh`.
    `specs`: PartitionSpecs of 'params', 'grads' (pytrees) and 'batch', and under int8 compression
    'owned' (the gradients' ZeRO-2 layout) and 'grad_error' (the residuals'). With a `pipeline` axis
    > 1 the stacked layers run as pipeline stages (meshtrain/engine/pipeline.py). Where `data` is
    manual (data_parallel.is_manual), each data shard computes on the compute-dtype parameters and
    its own rows, accumulates locally and the gradients are reduced over `data` once per step (in
    int8 with error feedback under compression, which keeps the residuals of a skipped step).
    Otherwise XLA partitions the step from the shardings. With `plan.gathers_once` the microbatches
    share one gather of the compute-dtype weights (over the storage axes, sharding.py `gathered`), made
    before their loop, and the gradients are of that copy. Under fp16 the gradients are of the scaled
    objective and unscaled here (meshtrain/ops/precision.py), and by the objective's divisor
    (`Objective.finish`). An objective's forward-only pass before the gradients (`scores_first`)
    runs a microbatch at a time, through the pipeline's stages on a pipeline (`make_scores`).
    `update`: the optimizer's (`in_place_update`, or with the state in host memory
    meshtrain/ops/offload.py `offloaded_update`). `layer_norms` (train.grad_norms_every > 0)
    adds the metric 'grad_norms' (`grad_norms_by_group`). `reuse`: the step of an objective that
    `reuses_scores` without its forward-only passes (its `step_inputs` gets `score` None)."""
    grad_specs, stages = specs["grads"], mesh.shape["pipeline"]  # of the trainable parameters
    keep = model.cfg.trainable
    micro = plan.num_microbatches(stages)
    compressor = None
    if compression.applies(plan, mesh.shape):
        compressor = compression.Int8Reduction(mesh, grad_specs, select(specs["owned"], keep), plan.compression_block,
                                               plan.zero)  # the trained parameters' gradients (LoRA: adapters')
    compressed = {"compressor": compressor, "error_specs": specs.get("grad_error")}
    scores = objective.scores_first and not reuse
    score = make_scores(model, plan, mesh, specs["params"], objective) if scores else None
    gather = None
    if plan.gathers_once(mesh.shape):  # the compute-dtype weights gathered before the microbatch loop
        gather = lambda params: gathered(cast_for_compute(params, plan.precision), specs["params"])
    if stages > 1:
        grad_fn = make_pipeline_grads(model, plan, mesh, specs["params"], grad_specs, objective, **compressed)
    elif data_parallel.is_manual(mesh.shape[data_parallel.AXIS], microbatches=micro, zero=plan.zero,
                                 compressed=compressor is not None):
        others = set(mesh.axis_names) - {data_parallel.AXIS}
        local = accumulate(metrics_and_grads(objective.loss, keep), micro,
                           data_parallel.local_specs(grad_specs, others), gather)
        per_shard = data_parallel.data_parallel(local, mesh, specs["params"], grad_specs, specs["batch"],
                                                **compressed)
        # the gathers move compute-dtype parameters
        grad_fn = lambda params, inputs: per_shard(cast_for_compute(params, plan.precision), inputs)
    else:
        grad_fn = accumulate(metrics_and_grads(objective.loss, keep), micro, grad_specs, gather)

    def train_step(state, batch):
        params, loss_scale = state["params"], state["loss_scale"]
        trained = select(params, keep)  # the optimizer's parameters (LoRA: the adapters)
        scale = loss_scale["scale"] if scales_loss(plan) else None
        rows, shared = objective.step_inputs(state, batch, score)
        out = grad_fn(params, StepInputs(rows, shared, scale, state["grad_error"] if compressor else None))
        model_metrics, divisor = objective.finish(out.metrics, rows, shared)
        loss = model_metrics["loss"]
        # the gradients are of the objective times these
        divisors = [d for d in (scale, divisor) if d is not None]
        # the reduced gradients' layout (where XLA reduces, this is its ZeRO-2/3 reduce-scatter)
        unscale = (lambda g: g / math.prod(divisors)) if divisors else (lambda g: g)
        # those the backward wrote to host memory (parallel.offload=optimizer+params) stay there as they
        # are: the norm and the update read them a layer at a time, dividing them on the device
        finished = lambda g, p, s: jax.lax.with_sharding_constraint(unscale(g.astype(p.dtype)), s)
        grads = jax.tree.map(lambda g, p, s: g if offload.on_host(g) else finished(g, p, s), out.grads, trained,
                             grad_specs)
        grad_norm = offload.global_norm(grads, unscale)
        # Nonfinite guard: a NaN/Inf loss or gradient updates nothing (the global norm is NaN/Inf
        # if any gradient element is), but the step still advances so the next batch is new. Under
        # fp16 a NaN/Inf gradient is first an overflow: skipped too, but it halves the loss scale.
        loss_scale, overflow, bad = update_loss_scale(plan, loss_scale, jnp.isfinite(loss), jnp.isfinite(grad_norm))
        applied = ~(bad | overflow)
        new_trained, opt_state = update(grads, state["opt_state"], trained, applied, unscale, grad_norm)
        new_params = merge(params, new_trained)
        if "expert_load" in model_metrics:  # aux-loss-free balancing, after the optimizer (models/routed.py)
            new_params, model_metrics = balance_routers(model, new_params, model_metrics, rows["tokens"].shape,
                                                        applied, objective.sequences_per_row)
        new_state = {**state, "step": state["step"] + 1,
                     "params": new_params,
                     "opt_state": opt_state,
                     "skipped_steps": state["skipped_steps"] + bad.astype(jnp.int32), "loss_scale": loss_scale,
                     **objective.next_state(state, batch, rows)}
        if compressor:  # a skipped step's residuals may hold its NaN/Inf: they are dropped with it
            new_state["grad_error"] = kept_unless(applied, out.grad_error, state["grad_error"])
        metrics = {**model_metrics, "grad_norm": grad_norm, "lr": applied_lr(schedule, state["opt_state"]),
                   "finite": ~bad, "skipped_steps": new_state["skipped_steps"]}
        if layer_norms:
            metrics["grad_norms"] = grad_norms_by_group(grads, model.embed_stacks)
        if scales_loss(plan):
            metrics.update(loss_scale=state["loss_scale"]["scale"], overflows=loss_scale["overflows"])
        return new_state, metrics

    return train_step
