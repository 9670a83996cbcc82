"""The train step for one config on one mesh, ready to compile, with no data loaded and no
parameter materialised: mesh, sharding rules, model, abstract state, shardings and the step
function. The Trainer builds on it to train; the planner (`python -m meshtrain.plan`) lowers and
compiles it for a target mesh ahead of time."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.config import Config, UserError, validate
from meshtrain.mesh import build_mesh, parse_mesh, simulate_cpu_devices
from meshtrain.metrics import flops_per_token
from meshtrain.pipeline import layer_order
from meshtrain.sharding import (activation_rules, check_divisibility, check_replication, make_rules,
                                pipeline_microbatches, spec_for, state_shardings)
from meshtrain.step import lr_schedule, make_optimizer, make_train_step
from models import LanguageModel
from models.transformer import ATTENTION_BLOCK, MIN_ATTENTION_BLOCK, attention_block


class TrainProgram:
    def __init__(self, cfg: Config, devices=None):
        validate(cfg)
        if cfg.devices:
            simulate_cpu_devices(cfg.devices)
        if cfg.model.attention == "cudnn" and jax.default_backend() != "gpu":
            raise UserError("model.attention=cudnn needs an NVIDIA GPU; use model.attention=blockwise or xla here")
        if cfg.model.attention == "cudnn" and cfg.precision == "fp32":
            raise UserError("model.attention=cudnn runs in bf16 only; set precision=bf16, or use "
                            "model.attention=blockwise for fp32")
        seq_len = cfg.train.seq_len
        if cfg.model.attention == "blockwise" and attention_block(seq_len) < min(seq_len, MIN_ATTENTION_BLOCK):
            raise UserError(f"model.attention=blockwise splits train.seq_len={seq_len} into blocks of "
                            f"{attention_block(seq_len)} positions (its largest divisor up to {ATTENTION_BLOCK}); "
                            f"use a seq_len with a divisor from {MIN_ATTENTION_BLOCK} to {ATTENTION_BLOCK}, "
                            f"e.g. a multiple of {MIN_ATTENTION_BLOCK}")
        if cfg.model.remat == "offload" and jax.default_backend() == "cpu":
            raise UserError("model.remat=offload moves activations to host memory and needs a GPU/TPU; "
                            "use full or save_matmuls on CPU")
        self.cfg, t = cfg, cfg.train
        self.sizes = parse_mesh(cfg.mesh, len(devices) if devices is not None else jax.device_count())
        self.rules = make_rules(cfg.rules)
        check_divisibility(cfg, self.sizes, self.rules)
        self.mesh = build_mesh(self.sizes, devices)
        self.model = LanguageModel(cfg.model)
        # Input tokens [B, L+1] split on the batch only (L+1 divides by nothing); the model's
        # activations take the `seq` rule.
        self.batch_sharding = NamedSharding(self.mesh, spec_for(("batch", None), self.rules, self.mesh))
        self.batch_shape = (t.batch_size, t.seq_len + 1)

        abstract_params = jax.eval_shape(self.model.init, jax.random.key(t.seed))
        self.logical_axes = self.model.logical_axes(abstract_params)
        check_replication(abstract_params, self.logical_axes, self.rules, self.mesh, cfg.zero)
        self.schedule = lr_schedule(cfg.optim, t.steps)
        self.tx = make_optimizer(cfg.optim, t.steps, self.logical_axes)

        stages = self.sizes["pipeline"]
        virtual = cfg.pipeline.virtual_stages if stages > 1 else 1
        self.layer_order = layer_order(cfg.model.num_layers, stages, virtual)
        pipeline = None
        if stages > 1:
            pipeline = (cfg.pipeline.schedule, pipeline_microbatches(cfg, stages), virtual, cfg.pipeline.residuals)

        self.abstract_state = jax.eval_shape(self.init_state, jax.random.key(t.seed))
        self.state_shardings, self.grad_specs = state_shardings(self.abstract_state, self.logical_axes, self.rules,
                                                                self.mesh, cfg.zero, self.tx)
        specs = {"params": jax.tree.map(lambda s: s.spec, self.state_shardings["params"]),
                 "grads": self.grad_specs, "batch": self.batch_sharding.spec}
        self.step_fn = make_train_step(self.model, self.tx, self.schedule, cfg.precision, t.microbatches, cfg.zero,
                                       self.mesh, specs, pipeline)
        self.num_params = self.model.num_params(abstract_params)
        matmul_params = self.model.num_params(abstract_params, embedding=cfg.model.tie_embeddings)
        m = self.model.cfg
        self.flops_per_token = flops_per_token(matmul_params, m.num_layers, m.d_model, t.seq_len)

    def init_state(self, key):
        params = self.model.init(key)
        params["blocks"] = self.reorder_blocks(params["blocks"], self.layer_order)  # storage order
        zero = jnp.zeros((), jnp.int32)
        return {"step": zero, "params": params, "opt_state": self.tx.init(params), "skipped_steps": zero}

    @staticmethod
    def reorder_blocks(blocks, rows):
        """blocks[rows] on the stacked layers axis; no gather at all when `rows` is the identity
        (every layout except interleaved pipelines)."""
        if np.array_equal(rows, np.arange(len(rows))):
            return blocks
        return jax.tree.map(lambda p: p[rows], blocks)

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
