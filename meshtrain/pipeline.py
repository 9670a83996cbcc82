"""The SPMD pipeline executor: one program, run by every stage inside `jax.shard_map` over the
`pipeline` axis, steps through a schedule's timetable (meshtrain/schedules.py) tick by tick.

At each tick a stage looks up its own action and runs one branch of a `lax.switch`: idle (no
compute, so the time bubble is the schedule's bubble), the forward of one chunk of one
microbatch, or its backward. Then every stage sends one activation to the next model stage and one
cotangent to the previous one (`ppermute`, circular so that interleaved chunks wrap from the last
device to the first). Received tensors wait in ring buffers sized from the timetable: `stash`
holds a chunk's input until its backward, `grads_in` a cotangent until its backward runs.

The backward recomputes its chunk's forward from the stashed input (`jax.grad` at backward time)
instead of keeping residuals, so a stage holds one input activation per in-flight microbatch: at
most `stages` for 1F1B whatever the number of microbatches, all M for GPipe.

The embedding and the head are not split into stages: the first stage embeds each microbatch as
it enters and the last stage applies the head and the loss as it leaves, so no activation buffer
grows with the number of microbatches. Gradients accumulate locally over microbatches. They are
summed over the pipeline axis (embedding, final norm, head), and averaged over `data` (when `data`
is a manual axis too, i.e. zero <= 1) once per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.precision import cast_for_compute
from meshtrain.schedules import executor_tables, timetable
from meshtrain.sharding import manual_axes_rules
from meshtrain.step import cross_entropy, split_microbatches


def layer_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
    """Storage row r of the stacked layers holds model layer order[r]. Device s stores its chunks
    v = 0..V-1 in consecutive rows (so the `layers` axis shards over `pipeline` in plain blocks);
    chunk v of stage s is model stage v * stages + s. The identity unless virtual > 1."""
    per_chunk = num_layers // (stages * virtual)
    return np.array([(v * stages + s) * per_chunk + j
                     for s in range(stages) for v in range(virtual) for j in range(per_chunk)])


def make_pipeline_grads(model, precision: str, mesh, schedule: str, micro: int, virtual: int, data_manual: bool):
    """(params, tokens [B, L+1]) -> (loss, grads): one step's forward and backward, pipelined."""
    stages = mesh.shape["pipeline"]
    tables = executor_tables(timetable(schedule, stages, micro, virtual))
    stash_slots, grad_slots = int(tables.pop("stash_slots")), int(tables.pop("grad_slots"))
    manual = {"pipeline", "data"} if data_manual else {"pipeline"}

    def per_stage(*args):
        with manual_axes_rules(manual):  # activations are constrained over the compiler-managed axes only
            return stage_program(*args)

    def stage_program(blocks, outer, tokens_MxbxL1):
        s = jax.lax.axis_index("pipeline")
        chunks = jax.tree.map(lambda p: p.reshape(virtual, -1, *p.shape[1:]), blocks)
        tab = {k: jnp.asarray(v) for k, v in tables.items()}
        x_shape = jax.eval_shape(lambda o, t: model.embed(o, t[:, :-1]), outer, tokens_MxbxL1[0])
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        f32_zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)
        carry = {"stash": jnp.zeros((stash_slots, virtual, *x_shape.shape), x_shape.dtype),
                 "grads_in": jnp.zeros((grad_slots, virtual, *x_shape.shape), x_shape.dtype),
                 "g_chunks": f32_zeros(chunks), "g_outer": f32_zeros(outer), "loss": jnp.zeros((), jnp.float32)}

        # Dynamic slices, not gathers (XLA cannot partition some gathers inside a manual region).
        take = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
        put = lambda x, value, i: jax.lax.dynamic_update_index_in_dim(x, value, i, 0)
        slot = lambda buffer, m, v, slots: take(take(buffer, m % slots), v)

        def chunk_forward(p_chunk, p_outer, m, v, x_stashed):
            """The chunk's output; the first model stage embeds the microbatch instead of reading the stash."""
            first = (s == 0) & (v == 0)
            x = jax.lax.cond(first, lambda: model.embed(p_outer, take(tokens_MxbxL1, m)[:, :-1]), lambda: x_stashed)
            return model.run_blocks(p_chunk, x)

        def microbatch_loss(p_outer, y, m):
            return cross_entropy(model.head(p_outer, y), take(tokens_MxbxL1, m)[:, 1:])

        def idle(c, m, v):
            return c, zeros_x, zeros_x

        def forward(c, m, v):
            y = chunk_forward(take_chunk(v), outer, m, v, slot(c["stash"], m, v, stash_slots))
            last = (s == stages - 1) & (v == virtual - 1)  # the last model stage applies the head and loss
            loss = jax.lax.cond(last, lambda: microbatch_loss(outer, y, m), lambda: jnp.zeros((), jnp.float32))
            return {**c, "loss": c["loss"] + loss}, y, zeros_x

        def backward(c, m, v):
            """Recompute the chunk from its stashed input and pull back the cotangent of its output
            (on the last model stage: of the microbatch's share of the mean loss)."""
            g_out = slot(c["grads_in"], m, v, grad_slots)
            last = (s == stages - 1) & (v == virtual - 1)

            def objective(p_chunk, p_outer, x_stashed):
                y = chunk_forward(p_chunk, p_outer, m, v, x_stashed)
                return jax.lax.cond(last, lambda: microbatch_loss(p_outer, y, m) / micro,
                                    lambda: jnp.sum(y.astype(jnp.float32) * g_out.astype(jnp.float32)))

            g_chunk, g_outer, g_x = jax.grad(objective, argnums=(0, 1, 2))(
                take_chunk(v), outer, slot(c["stash"], m, v, stash_slots))
            g_chunks = jax.tree.map(lambda acc, g: put(acc, take(acc, v) + g.astype(jnp.float32), v),
                                    c["g_chunks"], g_chunk)
            g_outer = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), c["g_outer"], g_outer)
            return {**c, "g_chunks": g_chunks, "g_outer": g_outer}, zeros_x, g_x

        def take_chunk(v):
            return jax.tree.map(lambda p: take(p, v), chunks)

        def store(buffer, valid, m, v, slots, value):
            def write(b):
                return put(b, put(take(b, m % slots), value, v), m % slots)

            return jax.lax.cond(valid > 0, write, lambda b: b, buffer)

        def tick(c, t):
            at = lambda name: tab[name][t, s]
            c, send_f, send_b = jax.lax.switch(at("kind"), [idle, forward, backward], c, at("micro"), at("chunk"))
            recv_f = jax.lax.ppermute(send_f, "pipeline", [(i, (i + 1) % stages) for i in range(stages)])
            recv_b = jax.lax.ppermute(send_b, "pipeline", [(i, (i - 1) % stages) for i in range(stages)])
            c = {**c, "stash": store(c["stash"], at("recv_f"), at("recv_f_micro"), at("recv_f_chunk"), stash_slots, recv_f),
                 "grads_in": store(c["grads_in"], at("recv_b"), at("recv_b_micro"), at("recv_b_chunk"), grad_slots, recv_b)}
            return c, None

        carry, _ = jax.lax.scan(tick, carry, jnp.arange(len(tables["kind"])))
        loss = jax.lax.psum(carry["loss"], "pipeline") / micro
        g_outer = jax.lax.psum(carry["g_outer"], "pipeline")
        g_blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), carry["g_chunks"])
        if data_manual:  # the data-parallel reduction, once per step
            loss, g_outer, g_blocks = jax.lax.pmean((loss, g_outer, g_blocks), "data")
        return loss, g_blocks, g_outer

    blocks_spec = P("pipeline")
    tokens_spec = P(None, "data") if data_manual else P()
    staged = jax.shard_map(per_stage, mesh=mesh, in_specs=(blocks_spec, P(), tokens_spec),
                           out_specs=(P(), blocks_spec, P()), axis_names=manual, check_vma=False)

    def loss_and_grads(params, tokens_BxL1):
        compute = cast_for_compute(params, precision)
        outer = {k: v for k, v in compute.items() if k != "blocks"}
        loss, g_blocks, g_outer = staged(compute["blocks"], outer, split_microbatches(tokens_BxL1, micro))
        grads = {**g_outer, "blocks": g_blocks}
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    return loss_and_grads
