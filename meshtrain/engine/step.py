"""Train and eval steps on pure pytrees: loss -> grads (accumulated over microbatches) -> clip ->
nonfinite guard -> the optimizer (meshtrain/ops/optimizers.py). The state is {'step', 'params',
'opt_state', 'skipped_steps', 'loss_scale'}, and 'grad_error' under int8 gradient compression
(meshtrain/parallel/compression.py), 'reference' under DPO (meshtrain/engine/dpo.py); the batch is
[batch, seq_len + 1] tokens, [batch, 2 (seq_len + 1)] preference pairs under DPO."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from meshtrain.engine.dpo import make_dpo_loss_fn, make_reference_log_probs, reference_params
from meshtrain.engine.pipeline import make_pipeline_grads, make_pipeline_log_probs
from meshtrain.models.lora import row_keys
from meshtrain.ops import remat as remat_lib
from meshtrain.ops.optimizers import LR_SCHEDULES, OPTIMIZERS
from meshtrain.ops.precision import cast_for_compute, scales_loss, update_loss_scale
from meshtrain.ops.trainable import merge, select
from meshtrain.parallel import compression, data_parallel
from meshtrain.parallel.batching import Gradients, StepInputs, accumulate, model_inputs


def lr_schedule(ocfg, total_steps: int):
    """`optim.schedule` over `total_steps` (meshtrain/ops/optimizers.py LR_SCHEDULES)."""
    return LR_SCHEDULES[ocfg.schedule](ocfg, total_steps)


def make_optimizer(ocfg, total_steps: int, logical_axes):
    """Global-norm clipping, then `optim.optimizer` (meshtrain/ops/optimizers.py OPTIMIZERS), which
    reads the parameters' logical axes (weight decay on matrices, not norms; which dimensions form
    each matrix). The state's tree does not depend on any other hyperparameter (clip_norm=0 is an
    identity in the clipping slot), so a checkpoint resumes with other optimizer settings."""
    clip = optax.clip_by_global_norm(ocfg.clip_norm) if ocfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, OPTIMIZERS[ocfg.optimizer].build(ocfg, lr_schedule(ocfg, total_steps), logical_axes))


def applied_lr(schedule, opt_state):
    """The learning rate an update applies: the schedule at the optimizer's own count, which
    skipped (NaN/Inf) steps do not advance."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    count = next(s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s))
    return schedule(count)


def make_loss_fn(model, precision: str, remat: str = "none", loss_mask: bool = False):
    """(params, tokens [B, L+1]) -> (objective, metrics): the mean cross-entropy plus the model's
    auxiliary losses, and the metrics (meshtrain/parallel/batching.py). The blocks run under the plan's remat
    policy; their statistics are reported as means over layers. `loss_mask`: the tokens carry a loss
    mask (meshtrain/data/tokens.py `with_mask`): the inputs are its ids, an untrained target adds
    nothing, and the loss is still divided by all B x L positions (`trained_share` rescales it).
    `aux_weight` multiplies the auxiliary losses (the trained share, which the step divides out).
    `mtp_shares` ([D], `mtp_shares`; the train step's, None in evaluation): the objective adds the
    multi-token prediction loss, mtp_loss_weight x the mean of the D depths' losses (DeepSeek-V3
    eq. 25), weighted as the auxiliary losses are, and the metric 'mtp_loss' is that mean.
    `dropout_keys` ([B, 2], the train step's, models/lora.py `row_keys`): LoRA dropout is on."""
    layer = remat_lib.apply(model.block, remat, model.saveable)

    def loss_fn(params, tokens_BxL1, aux_weight=1.0, mtp_shares=None, dropout_keys=None):
        compute = cast_for_compute(params, precision)
        inputs, targets, docs = model_inputs(model, tokens_BxL1, loss_mask)
        x_BxLxD, stats = model.trunk(compute, inputs, docs, layer, dropout_keys)
        loss = model.loss(compute, x_BxLxD, targets)
        objective, metrics = loss + aux_weight * model.auxiliary_loss(stats), {"loss": loss, **stats}
        if mtp_shares is not None:
            mtp = jnp.mean(model.mtp_losses(compute, x_BxLxD, inputs, targets, docs, mtp_shares))
            objective, metrics["mtp_loss"] = objective + aux_weight * model.cfg.mtp_loss_weight * mtp, mtp
        return objective, metrics

    return loss_fn


def mtp_shares(model, tokens_BxL1, loss_mask: bool = False):
    """[D]: each multi-token prediction depth's trained share of the step batch (None without MTP)."""
    if not model.mtp_depth:
        return None
    _, targets, docs = model_inputs(model, tokens_BxL1, loss_mask)
    return model.mtp_shares(targets, docs)


def trained_share(tokens_BxL1):
    """The fraction of the batch's B x L targets that are trained (>= 0), at least one token's: the
    executors average the masked loss over all positions, so loss / share is the sum of the trained
    tokens' losses over their number, for the whole batch and every layout."""
    trained_BxL = tokens_BxL1[:, 1:] >= 0
    return jnp.maximum(jnp.mean(trained_BxL, dtype=jnp.float32), 1.0 / trained_BxL.size)


def trained_tokens(tokens_BxL1):
    """How many of the batch's targets are trained (>= 0), in fp32."""
    return jnp.sum(tokens_BxL1[:, 1:] >= 0, dtype=jnp.float32)


def metrics_and_grads(loss_fn, keep=lambda path: True):
    """`loss_fn` -> a gradient function (meshtrain/parallel/batching.py): the metrics and the gradients
    of the objective, times the inputs' loss scale when there is one (fp16, meshtrain/ops/precision.py),
    by the parameters `keep` accepts (`ModelSpec.trainable`) only: the others are constants."""
    def fn(params, inputs: StepInputs) -> Gradients:
        # DPO's reference log-probs (meshtrain/engine/dpo.py) or, under a loss mask, the trained share by which
        # the auxiliary losses are weighted: never both (config/validate.py: DPO takes no mask from data.train_on)
        extra = [x for x in (inputs.reference, inputs.trained_share) if x is not None]
        mtp = {} if inputs.mtp_shares is None else {"mtp_shares": inputs.mtp_shares}
        noise = {} if inputs.dropout_keys is None else {"dropout_keys": inputs.dropout_keys}

        def objective(trained):
            value, metrics = loss_fn(merge(params, trained), inputs.tokens, *extra, **mtp, **noise)
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


def balance_routers(model, params, metrics, batch_shape, applied, pairs: bool = False):
    """The parameters with each routed layer's `router_bias` moved toward balance
    (the MoE model's `balanced_router_bias`, models/routed.py), unless the step was skipped, and the metrics with
    'expert_load' as counts [routed layers, E] (storage order) and 'batch_load_max', the worst
    layer's busiest expert's count over the mean count (1 = balanced over the whole global batch).
    `batch_shape`: the step's tokens [B, L + 1], or [B, 2 (L + 1)] preference pairs (`pairs`)."""
    c = model.cfg
    rows, seq = (2 * batch_shape[0], batch_shape[1] // 2 - 1) if pairs else (batch_shape[0], batch_shape[1] - 1)
    bias, count_NxE = model.balanced_router_bias(params["blocks"]["router_bias"], metrics["expert_load"],
                                                 rows * seq * c.experts_per_token)
    blocks = {**params["blocks"], "router_bias": jnp.where(applied, bias, params["blocks"]["router_bias"])}
    load_max = jnp.max(count_NxE) * c.num_experts / (rows * seq * c.experts_per_token)
    return {**params, "blocks": blocks}, {**metrics, "expert_load": count_NxE, "batch_load_max": load_max}


def make_train_step(model, tx, schedule, plan, mesh, specs: dict, layer_norms: bool = False,
                    loss_mask: bool = False, dpo=None, seed: int = 0):
    """The step for `plan` (a ParallelPlan) on `mesh`. `specs`: PartitionSpecs of 'params', 'grads'
    (pytrees) and 'batch', and under int8 compression 'owned' (the gradients' ZeRO-2 layout) and
    'grad_error' (the residuals'). With a `pipeline` axis > 1 the stacked layers run as pipeline
    stages (meshtrain/engine/pipeline.py). Where `data` is manual (data_parallel.is_manual), each data shard
    computes on the compute-dtype parameters and its own rows, accumulates locally and the gradients
    are reduced over `data` once per step (in int8 with error feedback under compression, which
    keeps the residuals of a skipped step). Otherwise XLA partitions the step from the shardings.
    Under fp16 the gradients are of the scaled objective and unscaled here (meshtrain/ops/precision.py).
    `layer_norms` (train.grad_norms_every > 0) adds the metric 'grad_norms' (`grad_norms_by_group`).
    `loss_mask` (chat data, data.train_on=assistant): the loss and its gradients average over the
    trained tokens only (`trained_share`), and the metric 'trained_tokens' counts them. `dpo`
    (train.dpo, under train.objective=dpo): the batch is preference pairs and the objective DPO's
    (meshtrain/engine/dpo.py), the reference log-probs taken first from `reference_params(state)`
    (on a pipeline, by a forward-only pass through its stages: `make_pipeline_log_probs`). Under LoRA
    dropout (model.lora.dropout > 0) each row of the batch gets its key from (`seed`, the state's
    step) (models/lora.py `row_keys`), which travels with the row through every executor's split."""
    grad_specs, stages = specs["grads"], mesh.shape["pipeline"]  # of the trainable parameters
    keep = model.cfg.trainable
    micro = plan.num_microbatches(stages)
    compressor = None
    if compression.applies(plan, mesh.shape):
        compressor = compression.Int8Reduction(mesh, grad_specs, select(specs["owned"], keep), plan.compression_block,
                                               plan.zero)  # the trained parameters' gradients (LoRA: adapters')
    compressed = {"compressor": compressor, "error_specs": specs.get("grad_error")}
    if dpo is not None:
        loss_fn = make_dpo_loss_fn(model, plan.precision, plan.remat, dpo.beta, dpo.label_smoothing)
        reference_fn = (make_pipeline_log_probs(model, plan, mesh, specs["params"]) if stages > 1 else
                        make_reference_log_probs(model, plan.precision, micro))
    else:
        loss_fn = make_loss_fn(model, plan.precision, plan.remat, loss_mask)
    if stages > 1:
        grad_fn = make_pipeline_grads(model, plan, mesh, specs["params"], grad_specs, loss_mask=loss_mask,
                                      dpo=dpo, **compressed)
    elif data_parallel.is_manual(mesh.shape[data_parallel.AXIS], microbatches=micro, zero=plan.zero,
                                 compressed=compressor is not None):
        others = set(mesh.axis_names) - {data_parallel.AXIS}
        local = accumulate(metrics_and_grads(loss_fn, keep), micro, data_parallel.local_specs(grad_specs, others))
        per_shard = data_parallel.data_parallel(local, mesh, specs["params"], grad_specs, specs["batch"],
                                                **compressed)
        # the gathers move compute-dtype parameters
        grad_fn = lambda params, inputs: per_shard(cast_for_compute(params, plan.precision), inputs)
    else:
        grad_fn = accumulate(metrics_and_grads(loss_fn, keep), micro, grad_specs)

    def train_step(state, tokens_BxL1):
        params, loss_scale = state["params"], state["loss_scale"]
        trained = select(params, keep)  # the optimizer's parameters (LoRA: the adapters)
        scale = loss_scale["scale"] if scales_loss(plan) else None
        # cast before the forward's gathers, as the policy's parameters are
        reference = None if dpo is None else reference_fn(
            cast_for_compute(reference_params(state, model.cfg), plan.precision), tokens_BxL1)
        share = trained_share(tokens_BxL1) if loss_mask else None
        keys = None
        if model.cfg.lora.rank and model.cfg.lora.dropout:
            keys = jax.lax.with_sharding_constraint(row_keys(seed, state["step"], tokens_BxL1.shape[0]),
                                                    specs["batch"])
        out = grad_fn(params, StepInputs(tokens_BxL1, scale, state["grad_error"] if compressor else None,
                                         reference=reference, trained_share=share,
                                         mtp_shares=mtp_shares(model, tokens_BxL1, loss_mask), dropout_keys=keys))
        model_metrics = out.metrics
        divisors = [] if scale is None else [scale]  # the gradients are of the objective times these
        if loss_mask:  # the mean over trained tokens (the model's statistics and auxiliary losses stay
            # means over all tokens: the gradient functions weight those by the share)
            model_metrics = {**model_metrics, "loss": model_metrics["loss"] / share,
                             "trained_tokens": trained_tokens(tokens_BxL1)}
            divisors.append(share)
        loss = model_metrics["loss"]
        # the reduced gradients' layout (where XLA reduces, this is its ZeRO-2/3 reduce-scatter)
        unscale = (lambda g: g / math.prod(divisors)) if divisors else (lambda g: g)
        grads = jax.tree.map(lambda g, p, s: jax.lax.with_sharding_constraint(unscale(g.astype(p.dtype)), s),
                             out.grads, trained, grad_specs)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], trained)
        # Nonfinite guard: a NaN/Inf loss or gradient updates nothing (the global norm is NaN/Inf
        # if any gradient element is), but the step still advances so the next batch is new. Under
        # fp16 a NaN/Inf gradient is first an overflow: skipped too, but it halves the loss scale.
        loss_scale, overflow, bad = update_loss_scale(plan, loss_scale, jnp.isfinite(loss), jnp.isfinite(grad_norm))
        applied = ~(bad | overflow)
        keep_if_skipped = lambda new, old: jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)
        new_params = merge(params, keep_if_skipped(optax.apply_updates(trained, updates), trained))
        if "expert_load" in model_metrics:  # aux-loss-free balancing, after the optimizer (models/routed.py)
            new_params, model_metrics = balance_routers(model, new_params, model_metrics, tokens_BxL1.shape,
                                                        applied, pairs=dpo is not None)
        new_state = {**state, "step": state["step"] + 1,
                     "params": new_params,
                     "opt_state": keep_if_skipped(opt_state, state["opt_state"]),
                     "skipped_steps": state["skipped_steps"] + bad.astype(jnp.int32), "loss_scale": loss_scale}
        if compressor:  # a skipped step's residuals may hold its NaN/Inf: they are dropped with it
            new_state["grad_error"] = keep_if_skipped(out.grad_error, state["grad_error"])
        metrics = {**model_metrics, "grad_norm": grad_norm, "lr": applied_lr(schedule, state["opt_state"]),
                   "finite": ~bad, "skipped_steps": new_state["skipped_steps"]}
        if layer_norms:
            metrics["grad_norms"] = grad_norms_by_group(grads, model.embed_stacks)
        if scales_loss(plan):
            metrics.update(loss_scale=state["loss_scale"]["scale"], overflows=loss_scale["overflows"])
        return new_state, metrics

    return train_step
