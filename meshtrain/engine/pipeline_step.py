"""A pipelined step: the gradient function and the forward-only scores of a `pipeline` mesh, each one
`jax.shard_map` over the manual axes whose body is a stage's program (meshtrain/engine/pipeline.py
`StageProgram`) stepping through its schedule's timetable."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.engine import stage_state
from meshtrain.engine.pipeline import StageProgram
from meshtrain.ops import remat as remat_lib
from meshtrain.ops.precision import cast_for_compute
from meshtrain.ops.trainable import freeze
from meshtrain.parallel import data_parallel
from meshtrain.parallel.batching import Gradients, StepInputs, stage_rows
from meshtrain.parallel.schedules import Schedule, forwards_of, lookup, timetable
from meshtrain.parallel.sharding import manual_axes_rules
from meshtrain.parallel.tick_tables import executor_tables, pairs_forward_backward, tick_phases


def _split(specs):
    """(the outer parameters, the stacked blocks)."""
    return {k: v for k, v in specs.items() if k != "blocks"}, specs["blocks"]


def _tables(schedule: Schedule, stages: int, micro: int, virtual: int, residuals: str = "save"):
    """(the executor's tables, its buffer sizes, its phases) for `schedule`'s timetable."""
    tables = executor_tables(timetable(schedule, stages, micro, virtual, residuals))
    slots = {k: int(tables.pop(k)) for k in ("input_slots", "residual_slots", "cotangent_slots", "deferred_slots")}
    return tables, slots, tick_phases(tables)


class _Staging:
    """What the training and the forward-only passes share: the manual axes (`data` too when data >
    1: each data shard pipelines its own rows), the parameters' layouts in and out of the shard_map,
    the stage's parameters (whole over `data` once per step under ZeRO-3) and the layer."""

    def __init__(self, model, plan, mesh, param_specs):
        self.model, self.plan, self.mesh, self.param_specs = model, plan, mesh, param_specs
        self.stages, self.virtual = mesh.shape["pipeline"], plan.virtual_stages
        self.micro = plan.num_microbatches(self.stages)
        self.data_manual = data_parallel.is_manual(mesh.shape[data_parallel.AXIS], pipelined=True)
        self.manual = {"pipeline", data_parallel.AXIS} if self.data_manual else {"pipeline"}
        # unfolded in and out, gathered and reduced per device block (data_parallel.unfold)
        self.param_layouts = data_parallel.layouts(param_specs)
        self.outer_in, self.blocks_in = _split(data_parallel.local_specs(self.param_layouts, self.manual))
        self.tokens_spec = P(None, data_parallel.AXIS) if self.data_manual else P()
        keep = model.cfg.trainable  # the frozen weights' gradients are never computed (meshtrain/ops/trainable.py)
        self.layer = remat_lib.apply(lambda p, *args, **kw: model.block(freeze(p, keep, ("blocks",)), *args, **kw),
                                     plan.remat, model.saveable)
        self.placement = lookup(plan.schedule).placement
        self.kinds = stage_state.stage_kinds(model, self.stages, self.virtual, self.placement)

    def rows_specs(self, micro_rows):
        """The shard_map specs of the microbatches' rows [M, b, ...]: b split over `data` when manual."""
        return jax.tree.map(lambda _: self.tokens_spec, micro_rows)

    def unfolded(self, params):
        """(outer, blocks) in the compute dtype, unfolded for the shard_map (local reshapes)."""
        return _split(data_parallel.unfolded(cast_for_compute(params, self.plan.precision), self.param_specs,
                                             self.mesh.shape, self.mesh))

    def stage_params(self, blocks, outer):
        """Inside the shard_map: this stage's (outer, blocks), whole over `data` under ZeRO-3."""
        if not self.data_manual:
            return outer, blocks
        params = data_parallel.gather({**outer, "blocks": blocks}, {**self.outer_in, "blocks": self.blocks_in},
                                      self.param_layouts)
        return _split(data_parallel.folded(params, self.param_specs))

    def program(self, schedule, residuals, tables, slots, blocks, outer, micro_rows, **kw):
        pairs = pairs_forward_backward(schedule, self.mesh.shape.get("expert", 1))
        return StageProgram(self.model, self.layer, schedule, residuals, self.stages, self.micro, self.virtual,
                            tables, slots, blocks, outer, micro_rows, kinds=self.kinds, pairs=pairs, **kw)


def make_pipeline_grads(model, plan, mesh, param_specs, grad_specs, objective, compressor=None, error_specs=None):
    """A gradient function (meshtrain/parallel/batching.py): one step's forward and backward of
    `objective` (meshtrain/objectives/base.py), pipelined as `plan` (a ParallelPlan) says. With data >
    1, `data` is manual too: each data shard pipelines its own rows, and the gradients are reduced
    over it once per step (meshtrain/parallel/data_parallel.py). With a `compressor`
    (meshtrain/parallel/compression.py) that reduction is int8 with error feedback: the inputs'
    `grad_error` (laid out as `error_specs`) in, the new residuals out."""
    st = _Staging(model, plan, mesh, param_specs)
    schedule, residuals, micro, manual = lookup(plan.schedule), plan.residuals, st.micro, st.manual
    tables, slots, phases = _tables(schedule, st.stages, micro, st.virtual, residuals)
    grad_layouts = data_parallel.layouts(grad_specs)
    outer_out, blocks_out = _split(data_parallel.local_specs(grad_layouts, manual))
    errors_local = data_parallel.local_specs(error_specs, manual) if compressor else None

    def per_stage(blocks, outer, micro_rows, step_inputs: StepInputs):
        scale, shared = step_inputs.loss_scale, step_inputs.shared
        with manual_axes_rules(manual):  # activations are constrained over the compiler-managed axes only
            outer, blocks = st.stage_params(blocks, outer)
            stage = st.program(schedule, residuals, tables, slots, blocks, outer, micro_rows,
                               head=objective.head(shared), scale=scale, aux_weight=objective.aux_weight(shared))
            metrics, g_blocks, g_outer = stage.run(phases)
            if not st.data_manual:
                return Gradients(metrics, {**g_outer, "blocks": g_blocks})
            metrics = jax.lax.pmean(metrics, data_parallel.AXIS)  # the data-parallel reduction, once per step
            grads, local_sizes = {**g_outer, "blocks": g_blocks}, {**mesh.shape, "pipeline": 1}  # this stage's
            if compressor:  # one compressed exchange for all the gradients
                grads, errors = compressor.reduce_mean(grads, step_inputs.grad_error, manual, scale)
                return Gradients(metrics, data_parallel.unfolded(grads, grad_specs, local_sizes), errors)
            grads = data_parallel.unfolded(grads, grad_specs, local_sizes)
            return Gradients(metrics, data_parallel.reduce_mean(grads, {**outer_out, "blocks": blocks_out},
                                                                grad_layouts))

    grads_out = {**outer_out, "blocks": blocks_out}
    staged = lambda blocks, outer, micro_rows, step_inputs: jax.shard_map(
        per_stage, mesh=mesh, out_specs=Gradients(P(), grads_out, errors_local), axis_names=manual,
        in_specs=(st.blocks_in, st.outer_in, st.rows_specs(micro_rows),
                  data_parallel.input_specs(step_inputs, None, errors_local)),
        check_vma=False)(blocks, outer, micro_rows, step_inputs)

    def metrics_and_grads(params, inputs: StepInputs) -> Gradients:
        outer, blocks = st.unfolded(params)  # the gradients folded on the way out (local reshapes)
        micro_rows = stage_rows(model, objective, inputs.rows, micro)
        out = staged(blocks, outer, micro_rows, inputs.with_rows(None))
        return dataclasses.replace(out, grads=data_parallel.folded(out.grads, grad_specs, mesh))

    return metrics_and_grads


def make_pipeline_scores(model, plan, mesh, param_specs, objective):
    """(params, rows) -> the objective's per-row forward scores (`Objective.score_head`, e.g. the
    summed response log-probs), forward only through the pipeline's stages: the schedule's forwards
    alone (`forwards_of`), no residuals, no gradients; each stage holds its own layers only, as in
    training. An objective's forward pass before the gradients, and its evaluation, on a pipeline mesh."""
    st = _Staging(model, plan, mesh, param_specs)
    schedule, micro = forwards_of(plan.schedule), st.micro
    tables, slots, phases = _tables(schedule, st.stages, micro, st.virtual)
    head = lambda p_outer, y, mb: (jnp.zeros((), jnp.float32), objective.score_head(p_outer, y, mb))

    def per_stage(blocks, outer, micro_rows):
        with manual_axes_rules(st.manual):
            outer, blocks = st.stage_params(blocks, outer)
            stage = st.program(schedule, "save", tables, slots, blocks, outer, micro_rows, head=head, trains=False)
            return stage.outputs(stage.ticks(phases))

    def scores(params, rows):
        outer, blocks = st.unfolded(jax.lax.stop_gradient(params))
        micro_rows = stage_rows(model, objective, rows, micro)
        staged = jax.shard_map(per_stage, mesh=mesh, in_specs=(st.blocks_in, st.outer_in, st.rows_specs(micro_rows)),
                               out_specs=st.tokens_spec, axis_names=st.manual, check_vma=False)
        out_M = staged(blocks, outer, micro_rows)
        return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(-1, *o.shape[2:]), out_M)  # row j * M + m, as split

    return scores
