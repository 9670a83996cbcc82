"""The compile unit: what is trained (`ModelSpec`), how it runs (`ParallelPlan`) and how it learns
(`OptimSpec`), for one batch shape (`TrainConfig`), on one mesh: the sharding rules, the model of
its family with the plan's attention backend and sequence layout, the abstract state, its
shardings and the step function. Nothing is materialised and no data is loaded. The Trainer has
one to train; the planner (`python -m meshtrain.plan`) lowers and compiles one for a target mesh
ahead of time."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.config.spec import ModelSpec, OptimSpec, ParallelPlan, TrainConfig
from meshtrain.config.validate import check_layout
from meshtrain.data.mixture import trains_on_mask
from meshtrain.engine.dpo import keeps_reference, make_dpo_eval
from meshtrain.engine.pipeline import layer_order, make_pipeline_log_probs
from meshtrain.engine.step import (
    lr_schedule,
    make_loss_fn,
    make_optimizer,
    make_train_step,
    trained_share,
    trained_tokens,
)
from meshtrain.models import FAMILIES
from meshtrain.ops.attention import BACKENDS
from meshtrain.ops.fp8 import matmul_for
from meshtrain.ops.optimizers import OPTIMIZERS, map_param_states
from meshtrain.ops.packing import Packing, packing_of
from meshtrain.ops.precision import initial_loss_scale
from meshtrain.ops.trainable import select
from meshtrain.ops.ulysses import context_layout
from meshtrain.parallel import compression
from meshtrain.parallel.batching import split_microbatches
from meshtrain.parallel.mesh import build_mesh, parse_mesh, simulate_cpu_devices
from meshtrain.parallel.sharding import (
    activation_rules,
    check_replication,
    constrain,
    make_rules,
    owned_specs,
    spec_for,
    stage_replicated,
    state_shardings,
)


class TrainProgram:
    def __init__(self, model: ModelSpec, plan: ParallelPlan, optim: OptimSpec, train: TrainConfig, devices=None,
                 packing: Packing | None = None, loss_mask: bool = False):
        """`packing`: how a training window splits into documents (meshtrain/ops/packing.py; None:
        attend across them), from `data.document_mask` (`from_config`). `loss_mask`: the batches
        carry chat data's loss mask and the loss averages over the trained tokens (data.train_on).
        Under train.objective=dpo the batches are preference pairs [B, 2 (L + 1)] (their mask marks
        the responses) and the state holds the reference parameters (meshtrain/engine/dpo.py)."""
        self.dpo = train.dpo if train.objective == "dpo" else None
        loss_mask = loss_mask and self.dpo is None
        self.loss_mask = loss_mask
        self.spec, self.plan, self.optim, self.train = model, plan, optim, train
        t = train
        self.sizes = parse_mesh(plan.mesh, len(devices) if devices is not None else jax.device_count())
        self.rules = make_rules(plan.rules, plan.sequence_parallel)
        backend = devices[0].platform if devices is not None else jax.default_backend()  # a plan's GPU target
        check_layout(model, plan, t, self.sizes, self.rules, backend)
        self.mesh = build_mesh(self.sizes, devices)
        attention, order = context_layout(plan.context_strategy, BACKENDS[plan.attention], self.sizes["context"],
                                          t.seq_len, plan.ulysses_degree)
        self.model = FAMILIES[model.family](model, attention=attention, sequence_order=order,
                                            packing=packing, matmul=matmul_for(plan.precision))
        # Input tokens [B, L+1] split on the batch only (L+1 divides by nothing); the model's
        # activations take the `seq` rule.
        self.batch_sharding = NamedSharding(self.mesh, spec_for(("batch", None), self.rules, self.mesh))
        self.batch_shape = (t.batch_size, (t.seq_len + 1) * (1 if self.dpo is None else 2))
        self.tokens_per_step = t.batch_size * t.seq_len * (1 if self.dpo is None else 2)  # tokens/s counts these

        abstract_params = jax.eval_shape(self.model.init, jax.random.key(t.seed))
        self.logical_axes = self.model.logical_axes(abstract_params)
        check_replication(abstract_params, self.logical_axes, self.rules, self.mesh, plan.zero)
        horizon = optim.schedule_steps or t.steps  # the trainer sets it from the run's record
        self.schedule = lr_schedule(optim, horizon)
        self.trained = lambda tree: select(tree, model.trainable)  # what the optimizer trains (LoRA: adapters)
        self.tx = make_optimizer(optim, horizon, self.trained(self.logical_axes))

        self.owned_specs = owned_specs(abstract_params, self.logical_axes, self.rules, self.mesh, plan.zero)
        stages = self.sizes["pipeline"]
        self.layer_order = layer_order(model.stacked_layers(), stages, plan.virtual_stages if stages > 1 else 1)
        self.abstract_state = jax.eval_shape(self.init_state, jax.random.key(t.seed))
        other = {}  # state entries laid out beside params and opt_state
        if "grad_error" in self.abstract_state:
            other["grad_error"] = compression.error_shapes_and_specs(self.trained(abstract_params),
                                                                     self.trained(self.owned_specs), self.sizes,
                                                                     plan.zero)[1]
        self.state_shardings, self.grad_specs = state_shardings(self.abstract_state, self.logical_axes, self.rules,
                                                                self.mesh, plan.zero, map_param_states, other,
                                                                self.trained)
        if self.dpo is not None and keeps_reference(self.model.cfg):  # the frozen reference: as the parameters
            self.state_shardings["reference"] = self.state_shardings["params"]
        specs = {"params": jax.tree.map(lambda s: s.spec, self.state_shardings["params"]),
                 "grads": self.grad_specs, "batch": self.batch_sharding.spec, "owned": self.owned_specs, **other}
        self.step_fn = make_train_step(self.model, self.tx, self.schedule, plan, self.mesh, specs,
                                       layer_norms=t.grad_norms_every > 0, loss_mask=loss_mask, dpo=self.dpo,
                                       seed=t.seed)
        self.num_params = self.model.num_params(abstract_params)
        self.trainable_params = sum(x.size for x in jax.tree.leaves(self.trained(abstract_params)))
        self.flops_per_token = self.model.flops_per_token(abstract_params, t.seq_len)

    def optimizer_state_bytes(self) -> tuple[int, int, int]:
        """The optimizer state's bytes (meshtrain/ops/optimizers.py `state_bytes`) in all, of the
        stage-replicated parameters and of the experts': `formulas.zero_bytes`'s `optimizer_state`."""
        state_bytes = OPTIMIZERS[self.optim.optimizer].state_bytes
        axes = jax.tree.leaves(self.trained(self.logical_axes), is_leaf=lambda n: isinstance(n, tuple))
        params = jax.tree.leaves(self.trained(self.abstract_state["params"]))
        rows = [(state_bytes(leaf.shape, a), a) for leaf, a in zip(params, axes)]
        return (sum(b for b, _ in rows), sum(b for b, a in rows if stage_replicated(a)),
                sum(b for b, a in rows if "experts" in a))

    @classmethod
    def from_config(cls, cfg, devices=None, tokenizer_eos: int | None = None) -> TrainProgram:
        """`tokenizer_eos`: the data's tokenizer's EOS id, which `data.document_mask` splits at
        unless `data.eos_id` names one."""
        if cfg.devices:
            simulate_cpu_devices(cfg.devices)
        return cls(cfg.model, cfg.parallel, cfg.optim, cfg.train, devices, packing_of(cfg.data, tokenizer_eos),
                   trains_on_mask(cfg.data))

    def init_state(self, key):
        return self.state_from_params(self.model.init(key))

    def state_from_params(self, params):
        """Step 0 with these parameters (in model order), a fresh optimizer state, and zero residuals
        where int8 gradient compression applies (meshtrain/parallel/compression.py)."""
        params = dict(params)
        params["blocks"] = self.reorder_blocks(params["blocks"], self.layer_order)  # storage order
        zero = jnp.zeros((), jnp.int32)
        state = {"step": zero, "params": params, "opt_state": self.tx.init(self.trained(params)), "skipped_steps": zero,
                 "loss_scale": initial_loss_scale(self.plan)}
        if compression.applies(self.plan, self.sizes):
            state["grad_error"] = self.fresh_grad_error(params)
        if self.dpo is not None and keeps_reference(self.model.cfg):  # DPO's reference model: these, frozen
            state["reference"] = params
        return state

    def fresh_grad_error(self, params):
        """Zero residuals of the trained parameters' gradients (LoRA: the adapters' only)."""
        return compression.init_error(self.trained(params), self.trained(self.owned_specs), self.sizes, self.plan.zero)

    def optional_state(self) -> dict:
        """State entries a checkpoint may lack (meshtrain/run/checkpoint.py `restore`): a function making
        each afresh, in its sharding. Compression's residuals are per data shard: a checkpoint of
        another data size (or without compression) resumes with zeros."""
        make = lambda fn, key: lambda: jax.jit(fn, out_shardings=self.state_shardings[key])()
        optional = {"loss_scale": make(lambda: initial_loss_scale(self.plan), "loss_scale")}
        if "grad_error" in self.abstract_state:
            params = self.abstract_state["params"]
            optional["grad_error"] = make(lambda: self.fresh_grad_error(params), "grad_error")
        return optional

    @staticmethod
    def reorder_blocks(blocks, rows):
        """blocks[rows] on the stacked layers axis; no gather at all when `rows` is the identity
        (every layout except interleaved pipelines)."""
        if np.array_equal(rows, np.arange(len(rows))):
            return blocks
        return jax.tree.map(lambda p: p[rows], blocks)

    def in_model_order(self, params):
        """Stacked layers from storage order back to model order (a no-op order unless interleaved)."""
        return {**params, "blocks": self.reorder_blocks(params["blocks"], np.argsort(self.layer_order))}

    def eval_step(self):
        """The jitted eval step: (params in storage order, tokens) -> (the mean loss, its weight),
        replicated: the weight is 1, or with a loss mask the batch's trained tokens, so an eval set's
        mean is sum(loss x weight) / sum(weight) (meshtrain/run/trainer.py `validation`). The
        batch is cut into the train step's microbatches and their losses summed in a scan (equal
        sizes: the mean of the means is the batch's mean), so an evaluation never holds more
        activations than a training microbatch. The trainer runs it; the planner compiles it. With a
        loss mask, the mean over the batch's trained tokens (`trained_share`). Under DPO, (params,
        held-out pairs, *`eval_inputs(state)`) -> {loss, reward_accuracy, reward_margin}
        (meshtrain/engine/dpo.py `make_dpo_eval`)."""
        micro = self.plan.num_microbatches(self.sizes["pipeline"])
        replicated = NamedSharding(self.mesh, P())
        if self.dpo is not None:  # on a pipeline, the log-probs by a forward-only pass through its stages
            log_probs = None
            if self.sizes["pipeline"] > 1:
                param_specs = jax.tree.map(lambda s: s.spec, self.state_shardings["params"])
                log_probs = make_pipeline_log_probs(self.model, self.plan, self.mesh, param_specs)
            dpo_eval = make_dpo_eval(self.model, self.plan.precision, micro, self.dpo.beta, self.dpo.label_smoothing,
                                     log_probs)
            extra = (self.state_shardings["reference"],) if "reference" in self.state_shardings else ()
            return jax.jit(dpo_eval, in_shardings=(self.state_shardings["params"], self.batch_sharding, *extra),
                           out_shardings=replicated)
        eval_loss = make_loss_fn(self.model, self.plan.precision, loss_mask=self.loss_mask)

        def all_positions(params, tokens_BxL1):
            if micro == 1:
                return eval_loss(params, tokens_BxL1)[1]["loss"]
            add = lambda total, tokens: (total + eval_loss(params, constrain(tokens, ("batch", None)))[1]["loss"], None)
            return jax.lax.scan(add, jnp.zeros((), jnp.float32), split_microbatches(tokens_BxL1, micro))[0] / micro

        def mean_loss(params, tokens_BxL1):
            loss = all_positions(self.in_model_order(params), tokens_BxL1)
            if not self.loss_mask:
                return loss, jnp.ones((), jnp.float32)
            return loss / trained_share(tokens_BxL1), trained_tokens(tokens_BxL1)

        return jax.jit(mean_loss, in_shardings=(self.state_shardings["params"], self.batch_sharding),
                       out_shardings=replicated)

    def eval_inputs(self, state) -> tuple:
        """What the eval step takes after (params, batch) from the train `state` (or its abstract
        form): DPO's reference parameters where the state keeps them, else nothing."""
        return (state["reference"],) if "reference" in self.state_shardings else ()

    def lower(self):
        """The jitted step (pjit: in/out shardings, donated state) lowered for abstract inputs."""
        batch = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        with self.context():
            return jax.jit(self.step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                           out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())),
                           donate_argnums=0).lower(self.abstract_state, batch)

    def context(self):
        """Mesh and activation rules in force while tracing and running."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(activation_rules(self.rules, self.mesh))
        return stack
