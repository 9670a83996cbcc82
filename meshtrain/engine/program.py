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
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.config.spec import ModelSpec, OptimSpec, ParallelPlan, TrainConfig
from meshtrain.config.validate import check_layout, resolve_attention
from meshtrain.core.console import notice_once
from meshtrain.core.errors import UserError
from meshtrain.data.mixture import trains_on_mask
from meshtrain.engine import decode
from meshtrain.engine.compiler_options import compiler_options
from meshtrain.engine.step import in_place_update, lr_schedule, make_scores, make_train_step, optimizer_parts
from meshtrain.models import FAMILIES
from meshtrain.objectives import objective
from meshtrain.ops import offload
from meshtrain.ops.attention import BACKENDS
from meshtrain.ops.optimizers import OPTIMIZERS, map_param_states
from meshtrain.ops.packing import Packing, packing_of
from meshtrain.ops.precision import initial_loss_scale
from meshtrain.ops.recipes import matmul_for, recipe_refusal
from meshtrain.ops.trainable import select
from meshtrain.ops.ulysses import context_layout
from meshtrain.parallel import compression, data_parallel
from meshtrain.parallel.mesh import build_mesh, parse_mesh, simulate_cpu_devices
from meshtrain.parallel.schedules import layer_order, lookup
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
                 packing: Packing | None = None, loss_mask: bool = False, rl=None, vocab: int | None = None):
        """`packing`: how a training window splits into documents (meshtrain/ops/packing.py; None:
        attend across them), from `data.document_mask` (`from_config`). `loss_mask`: the batches
        carry chat data's loss mask and the loss averages over the trained tokens (data.train_on).
        train.objective names the objective (meshtrain/objectives/), which says what a batch row holds
        (under dpo, preference pairs [B, 2 (L + 1)]; under grpo a rollout) and what the state keeps beside
        the parameters. `rl`: the config's rl section (grpo's settings); `vocab`: the data tokenizer's
        size (grpo's log-probabilities mask the ids past it, as its sampler does)."""
        self.spec, self.plan, self.optim, self.train = model, plan, optim, train
        t = train
        self.sizes = parse_mesh(plan.mesh, len(devices) if devices is not None else jax.device_count())
        self.rules = make_rules(plan.rules, plan.sequence_parallel)
        first = devices[0] if devices is not None else jax.devices()[0]
        backend = first.platform if devices is not None else jax.default_backend()  # a plan's GPU target
        if why := recipe_refusal(plan.precision, first):
            raise UserError(why)
        plan, self.attention_note = resolve_attention(model, plan, t.seq_len, self.sizes, backend, packing is not None)
        if self.attention_note:  # said once per process: a planner's search builds many programs alike
            notice_once(f"parallel.attention=auto: cuDNN's fused attention does not take this model here "
                        f"({self.attention_note}); running {plan.attention}")
        self.plan = plan  # the kernels the program runs (parallel.attention=auto resolved)
        self.backend = backend  # the platform it is lowered for: "cpu", or a plan's "cuda"
        self.compiler_options = compiler_options(backend)  # its steps' XLA options (engine/compiler_options.py)
        check_layout(model, plan, t, self.sizes, self.rules, backend)
        self.mesh = build_mesh(self.sizes, devices)
        attention, order = context_layout(plan.context_strategy, BACKENDS[plan.attention], self.sizes["context"],
                                          t.seq_len, plan.ulysses_degree)
        self.model = FAMILIES[model.family](model, attention=attention, sequence_order=order,
                                            packing=packing, matmul=matmul_for(plan.precision),
                                            expert_chunks=plan.expert_chunks, bf16_layers=plan.bf16_layers)
        # Input tokens [B, L+1] split on the batch only (L+1 divides by nothing); the model's
        # activations take the `seq` rule.
        self.batch_sharding = NamedSharding(self.mesh, spec_for(("batch", None), self.rules, self.mesh))
        self.objective = objective(t.objective)(self.model, plan, t, loss_mask, rl, vocab)
        n = self.objective.sequences_per_row
        self.batch_shape = (t.batch_size, (t.seq_len + 1) * n)
        self.step_batch = self.objective.batch_struct(self.batch_shape)  # what the step takes: tokens, or a rollout
        self.step_batch_shardings = jax.tree.map(lambda x: self.row_sharding(x.ndim), self.step_batch)
        self.tokens_per_step = t.batch_size * t.seq_len * n  # tokens/s counts these

        abstract_params = jax.eval_shape(self.model.init, jax.random.key(t.seed))
        self.logical_axes = self.model.logical_axes(abstract_params)
        check_replication(abstract_params, self.logical_axes, self.rules, self.mesh, plan.zero)
        horizon = optim.schedule_steps or t.steps  # the trainer sets it from the run's record
        self.schedule = lr_schedule(optim, horizon)
        self.trained = lambda tree: select(tree, model.trainable)  # what the optimizer trains (LoRA: adapters)
        trained_axes = self.trained(self.logical_axes)
        clip, inner = optimizer_parts(optim, horizon, trained_axes)
        self.tx = optax.chain(clip, inner)
        offload.check_layout(plan.offload, self.sizes, {
            "microbatches (parallel.microbatches > 1)": plan.num_microbatches(self.sizes["pipeline"]) > 1,
            "parallel.remat=none (set full or save_matmuls)": plan.remat == "none",
            "a data axis the step runs by hand (data > 1 at ZeRO 0/1)": data_parallel.is_manual(
                self.sizes["data"], zero=plan.zero), "int8 gradient compression": plan.grad_compression != "none",
            "LoRA (model.lora.rank)": bool(model.lora.rank), "train.grad_norms_every": t.grad_norms_every > 0,
            f"train.objective={t.objective}": t.objective != "sft",
            "aux-loss-free router balancing": "router_bias" in abstract_params["blocks"]})
        update = (in_place_update(self.tx) if plan.offload == "none" else
                  offload.offloaded_update(optim.clip_norm, inner, trained_axes))

        self.owned_specs = owned_specs(abstract_params, self.logical_axes, self.rules, self.mesh, plan.zero)
        stages = self.sizes["pipeline"]
        self.layer_order = layer_order(model.stacked_layers(), stages, plan.virtual_stages if stages > 1 else 1,
                                       lookup(plan.schedule).placement)
        self.abstract_state = jax.eval_shape(self.init_state, jax.random.key(t.seed))
        other = {}  # state entries laid out beside params and opt_state
        if "grad_error" in self.abstract_state:
            other["grad_error"] = compression.error_shapes_and_specs(self.trained(abstract_params),
                                                                     self.trained(self.owned_specs), self.sizes,
                                                                     plan.zero)[1]
        self.state_shardings, self.grad_specs = state_shardings(self.abstract_state, self.logical_axes, self.rules,
                                                                self.mesh, plan.zero, map_param_states, other,
                                                                self.trained)
        # parallel.offload: the optimizer state's parameter-shaped parts in pinned host memory, and under
        # optimizer+params the stacked layers' parameters too
        self.host_params = offload.host_param_leaves(self.logical_axes, plan.offload)
        for key, flags in self.host_arguments().items():
            self.state_shardings[key] = offload.in_host_memory(self.state_shardings[key], flags)
        for name, entry in jax.eval_shape(self.objective.initial_state, abstract_params).items():
            rows = name in self.objective.row_state()  # e.g. GRPO's kept rollout: as the batch's rows
            self.state_shardings[name] = (jax.tree.map(lambda x: self.row_sharding(x.ndim), entry) if rows else
                                          self.state_shardings["params"])  # e.g. DPO's frozen reference
        self.param_specs = jax.tree.map(lambda s: s.spec, self.state_shardings["params"])
        specs = {"params": self.param_specs, "grads": self.grad_specs, "batch": self.batch_sharding.spec,
                 "owned": self.owned_specs, **other}
        step = lambda reuse: make_train_step(self.model, update, self.schedule, plan, self.mesh, specs,
                                             self.objective, layer_norms=t.grad_norms_every > 0, reuse=reuse)
        typed = lambda fn: lambda state, batch: fn({**state, "params": self.typed_params(state["params"])}, batch)
        self.step_fn = typed(step(False))
        # an objective's steps that take the scores the state keeps (GRPO's later updates of a rollout)
        self.reuse_step_fn = typed(step(True)) if self.objective.reuses_scores() else None
        self.num_params = self.model.num_params(abstract_params)
        self.trainable_params = sum(x.size for x in jax.tree.leaves(self.trained(abstract_params)))
        self.flops_per_token = self.model.flops_per_token(abstract_params, t.seq_len)

    def row_sharding(self, ndim: int) -> NamedSharding:
        """[B, ...] arrays split as the batch's rows: on the batch axes only."""
        return decode.row_sharding(ndim, self.mesh, self.rules)

    def typed_params(self, params):
        """The parameters with those in host memory typed so when traced (`offload.to_host_where`: what
        the compile-only GPU devices' shardings cannot say); the parameters themselves elsewhere."""
        return offload.to_host_where(params, self.host_params) if self.plan.offload == "optimizer+params" else params

    def offloaded_bytes(self, parts: bool = False):
        """The device's share of what parallel.offload keeps in host memory: the moments
        (offload.host_bytes of `host_arguments`), and under optimizer+params the layers' parameters and as many gradient
        bytes; `parts`: (moments, parameters) apart."""
        host = self.host_arguments()
        moments, params = (offload.host_bytes(self.abstract_state[k], self.state_shardings[k], host[k])
                           for k in ("opt_state", "params"))
        return (moments, params) if parts else moments + 2 * params

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
    def from_config(cls, cfg, devices=None, tokenizer_eos: int | None = None,
                    tokenizer_vocab: int | None = None) -> TrainProgram:
        """`tokenizer_eos`: the data's tokenizer's EOS id, which `data.document_mask` splits at
        unless `data.eos_id` names one; `tokenizer_vocab`: its size (see `__init__`'s `vocab`)."""
        if cfg.devices:
            simulate_cpu_devices(cfg.devices)
        return cls(cfg.model, cfg.parallel, cfg.optim, cfg.train, devices, packing_of(cfg.data, tokenizer_eos),
                   trains_on_mask(cfg.data), cfg.rl, tokenizer_vocab)

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
        scored = self.objective.evaluation(score, micro, self.in_model_order)
        evaluate = lambda params, *rest: scored(self.typed_params(params), *rest)
        extra = tuple(self.state_shardings[name] for name in self.objective.initial_state(self.param_specs))
        return jax.jit(evaluate, in_shardings=(self.state_shardings["params"], self.batch_sharding, *extra),
                       out_shardings=NamedSharding(self.mesh, P()), compiler_options=self.compiler_options)

    def eval_inputs(self, state) -> tuple:
        """What the eval step takes after (params, batch) from the train `state` (or its abstract
        form): the objective's state entries (DPO's reference parameters where the state keeps them)."""
        return self.objective.eval_inputs(state)

    def lower(self, reuse: bool = False):
        """The jitted step (pjit: in/out shardings, donated state) lowered for abstract inputs; `reuse`:
        the step that takes the scores the state keeps (`reuse_step_fn`)."""
        batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.step_batch,
                             self.step_batch_shardings)
        with self.context():
            fn = self.reuse_step_fn if reuse else self.step_fn
            step = jax.jit(fn, in_shardings=(self.state_shardings, self.step_batch_shardings),
                           out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())),
                           donate_argnums=0, compiler_options=self.compiler_options)
            lowered = step.lower(self.abstract_state, batch)
        if self.plan.offload != "none" and self.backend != "cpu":  # compile-only GPU devices drop memory kinds
            offload.mark_host_arguments(lowered, jax.tree.leaves(self.host_arguments()) + [False])
        return lowered

    def host_arguments(self) -> dict:
        """Per leaf of the train state: whether it lives in host memory (parallel.offload)."""
        nowhere = jax.tree.map(lambda _: False, self.abstract_state)
        if self.plan.offload == "none":
            return nowhere
        return {**nowhere, "params": self.host_params,
                "opt_state": offload.host_leaves(self.abstract_state["opt_state"],
                                                 self.trained(self.abstract_state["params"]))}

    def context(self):
        """Mesh and activation rules in force while tracing and running."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(activation_rules(self.rules, self.mesh))
        return stack
