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
from meshtrain.config.validate import check_layout, resolve_attention
from meshtrain.core.console import notice_once
from meshtrain.data.mixture import trains_on_mask
from meshtrain.engine.pipeline import layer_order
from meshtrain.engine.step import lr_schedule, make_optimizer, make_scores, make_train_step
from meshtrain.models import FAMILIES
from meshtrain.objectives import objective
from meshtrain.ops.attention import BACKENDS
from meshtrain.ops.fp8 import matmul_for
from meshtrain.ops.optimizers import OPTIMIZERS, map_param_states
from meshtrain.ops.packing import Packing, packing_of
from meshtrain.ops.precision import initial_loss_scale
from meshtrain.ops.trainable import select
from meshtrain.ops.ulysses import context_layout
from meshtrain.parallel import compression
from meshtrain.parallel.mesh import build_mesh, parse_mesh, simulate_cpu_devices
from meshtrain.parallel.sharding import (
    activation_rules,
    check_replication,
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
        train.objective names the objective (meshtrain/objectives/), which says what a batch row holds
        (under dpo, preference pairs [B, 2 (L + 1)]) and what the state keeps beside the parameters."""
        self.spec, self.plan, self.optim, self.train = model, plan, optim, train
        t = train
        self.sizes = parse_mesh(plan.mesh, len(devices) if devices is not None else jax.device_count())
        self.rules = make_rules(plan.rules, plan.sequence_parallel)
        backend = devices[0].platform if devices is not None else jax.default_backend()  # a plan's GPU target
        plan, self.attention_note = resolve_attention(model, plan, t.seq_len, self.sizes, backend, packing is not None)
        if self.attention_note:  # said once per process: a planner's search builds many programs alike
            notice_once(f"parallel.attention=auto: cuDNN's fused attention does not take this model here "
                        f"({self.attention_note}); running {plan.attention}")
        self.plan = plan  # the kernels the program runs (parallel.attention=auto resolved)
        self.backend = backend  # the platform it is lowered for: "cpu", or a plan's "cuda"
        check_layout(model, plan, t, self.sizes, self.rules, backend)
        self.mesh = build_mesh(self.sizes, devices)
        attention, order = context_layout(plan.context_strategy, BACKENDS[plan.attention], self.sizes["context"],
                                          t.seq_len, plan.ulysses_degree)
        self.model = FAMILIES[model.family](model, attention=attention, sequence_order=order,
                                            packing=packing, matmul=matmul_for(plan.precision))
        # Input tokens [B, L+1] split on the batch only (L+1 divides by nothing); the model's
        # activations take the `seq` rule.
        self.batch_sharding = NamedSharding(self.mesh, spec_for(("batch", None), self.rules, self.mesh))
        self.objective = objective(t.objective)(self.model, plan, t, loss_mask)
        n = self.objective.sequences_per_row
        self.batch_shape = (t.batch_size, (t.seq_len + 1) * n)
        self.tokens_per_step = t.batch_size * t.seq_len * n  # tokens/s counts these

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
        for name in self.objective.initial_state(abstract_params):  # e.g. DPO's frozen reference: as the parameters
            self.state_shardings[name] = self.state_shardings["params"]
        self.param_specs = jax.tree.map(lambda s: s.spec, self.state_shardings["params"])
        specs = {"params": self.param_specs, "grads": self.grad_specs, "batch": self.batch_sharding.spec,
                 "owned": self.owned_specs, **other}
        self.step_fn = make_train_step(self.model, self.tx, self.schedule, plan, self.mesh, specs, self.objective,
                                       layer_norms=t.grad_norms_every > 0)
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
        return state | self.objective.initial_state(params)  # e.g. DPO's reference model: these, frozen

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
        """The jitted evaluation of a held-out batch (`Objective.evaluation`): (params in storage
        order, batch, *`eval_inputs(state)`) -> its metrics, replicated; for next-token training (the
        mean loss, its weight), so an eval set's mean is sum(loss x weight) / sum(weight). It runs the
        train step's microbatches one at a time, so an evaluation never holds more activations than a
        training microbatch; an objective's forward scores run through the stages on a pipeline. The
        trainer runs it; the planner compiles it."""
        micro = self.plan.num_microbatches(self.sizes["pipeline"])
        score = make_scores(self.model, self.plan, self.mesh, self.param_specs, self.objective)
        evaluate = self.objective.evaluation(score, micro, self.in_model_order)
        extra = tuple(self.state_shardings[name] for name in self.objective.initial_state(self.param_specs))
        return jax.jit(evaluate, in_shardings=(self.state_shardings["params"], self.batch_sharding, *extra),
                       out_shardings=NamedSharding(self.mesh, P()))

    def eval_inputs(self, state) -> tuple:
        """What the eval step takes after (params, batch) from the train `state` (or its abstract
        form): the objective's state entries (DPO's reference parameters where the state keeps them)."""
        return self.objective.eval_inputs(state)

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
