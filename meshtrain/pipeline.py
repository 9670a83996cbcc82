"""The SPMD pipeline executor: one program, run by every stage inside `jax.shard_map` over the
`pipeline` axis, steps through a schedule's timetable (meshtrain/schedules.py) tick by tick.

In a tick a stage runs the actions of its slot, each behind a `lax.cond` on its own table entry
(so an idle stage computes nothing): the forward of one chunk of one microbatch, its backward,
and under zero-bubble a deferred weight gradient. Then stages exchange what the timetable sends:
activations to the next model stage, cotangents to the previous one (`ppermute`, circular so that
interleaved chunks wrap from the last device to the first). The ticks run as up to three scans
(warm-up, steady, cool-down), each holding only the actions and sends its ticks use: the warm-up
sends no cotangents, the cool-down no activations.

Residuals (`pipeline.residuals`):
- `save` (default): the forward runs each layer under `jax.vjp` and keeps the residuals its
  backward needs (with `model.remat`, only what the remat policy saves; the parameters are read
  again, never copied); the backward applies them, so no forward is run twice.
- `recompute`: a stage keeps only each chunk's input and reruns the chunk's forward in its
  backward (less memory, a third more compute).
Under zero-bubble (`zb`) the backward computes only the input gradient, layer by layer, and keeps
each layer's output cotangent; the weight gradient (W) runs later from those and the residuals.

The embedding and the head are not split into stages: the first stage embeds each microbatch as
it enters (and adds the embedding gradient in its backward), the last stage applies the head and
the loss in the forward and pulls the loss back to the chunk's output at once (so its backward
reads that cotangent like any other stage). Received tensors wait in ring buffers sized from the
timetable. Gradients accumulate locally over microbatches; they are summed over the pipeline axis
(embedding, final norm, head) and averaged over `data` (when `data` is a manual axis too, i.e.
zero <= 1) once per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain.precision import cast_for_compute
from meshtrain.schedules import executor_tables, tick_phases, timetable
from meshtrain.sharding import constrain, manual_axes_rules
from meshtrain.step import cross_entropy, split_microbatches
from models.transformer import remat_policy


def layer_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
    """Storage row r of the stacked layers holds model layer order[r]. Device s stores its chunks
    v = 0..V-1 in consecutive rows (so the `layers` axis shards over `pipeline` in plain blocks);
    chunk v of stage s is model stage v * stages + s. The identity unless virtual > 1."""
    per_chunk = num_layers // (stages * virtual)
    return np.array([(v * stages + s) * per_chunk + j
                     for s in range(stages) for v in range(virtual) for j in range(per_chunk)])


class LayerResiduals:
    """One layer's backward as data: `jax.vjp` of the layer, closure-converted so the residuals are
    explicit arrays. `save` keeps the ones that are not parameters; `pullback` rebuilds the vjp from
    them and the parameters (retracing the layer for the vjp's structure only: its forward is dead
    code, removed by XLA)."""

    def __init__(self, layer):
        self.layer = layer

    def _vjp(self, p_layer, x):
        y, vjp = jax.vjp(self.layer, p_layer, x)
        pullback, consts = jax.closure_convert(vjp, y)
        params = jax.tree.leaves(p_layer)
        is_param = [next((i for i, p in enumerate(params) if c is p), None) for c in consts]
        return y, pullback, consts, is_param

    def forward(self, p_layer, x):
        y, _, consts, is_param = self._vjp(p_layer, x)
        return y, [c for c, i in zip(consts, is_param) if i is None]

    def pullback(self, p_layer, saved, g_y):
        """(d p_layer, d x) for the output cotangent g_y."""
        _, pullback, consts, is_param = self._vjp(p_layer, jnp.zeros(g_y.shape, g_y.dtype))
        params, saved = jax.tree.leaves(p_layer), iter(saved)
        return pullback(g_y, *[params[i] if i is not None else next(saved) for i in is_param])


def make_pipeline_grads(model, precision: str, mesh, schedule: str, micro: int, virtual: int, data_manual: bool,
                        residuals: str = "save"):
    """(params, tokens [B, L+1]) -> (loss, grads): one step's forward and backward, pipelined."""
    stages = mesh.shape["pipeline"]
    tables = executor_tables(timetable(schedule, stages, micro, virtual, residuals))
    slots = {k: int(tables.pop(k)) for k in ("input_slots", "residual_slots", "cotangent_slots", "deferred_slots")}
    phases = tick_phases(tables)
    manual = {"pipeline", "data"} if data_manual else {"pipeline"}
    save, zero_bubble = residuals == "save", schedule == "zb"
    policy = remat_policy(model.cfg.remat)
    layer = model.block if policy is None else jax.checkpoint(model.block, policy=policy, prevent_cse=False)
    layers = LayerResiduals(layer)

    def per_stage(*args):
        with manual_axes_rules(manual):  # activations are constrained over the compiler-managed axes only
            return stage_program(*args)

    def stage_program(blocks, outer, tokens_MxbxL1):
        s = jax.lax.axis_index("pipeline")
        chunks = jax.tree.map(lambda p: p.reshape(virtual, -1, *p.shape[1:]), blocks)
        tab = {k: jnp.asarray(v) for k, v in tables.items()}
        take = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # slices, not gathers:
        put = lambda x, value, i: jax.lax.dynamic_update_index_in_dim(x, value, i, 0)  # XLA partitions them
        take_chunk = lambda v: jax.tree.map(lambda p: take(p, v), chunks)
        is_first = lambda v: (s == 0) & (v == 0)  # the model stage that embeds
        is_last = lambda v: (s == stages - 1) & (v == virtual - 1)  # the one that applies head and loss

        def read(buffer, m, v, n):
            return jax.tree.map(lambda b: take(take(b, m % n), v), buffer)

        def write(buffer, value, m, v, n):
            return jax.tree.map(lambda b, x: put(b, put(take(b, m % n), x.astype(b.dtype), v), m % n), buffer, value)

        def embed(p_outer, m):
            return model.embed(p_outer, take(tokens_MxbxL1, m)[:, :-1])

        def microbatch_loss(p_outer, y, m):
            return cross_entropy(model.head(p_outer, y), take(tokens_MxbxL1, m)[:, 1:])

        def forward_saving(p_chunk, x):
            return jax.lax.scan(lambda x, p: layers.forward(p, x), x, p_chunk)

        x_like = jax.eval_shape(embed, outer, 0)
        zeros_x = jnp.zeros(x_like.shape, x_like.dtype)
        zeros = lambda like, *lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), like)
        f32_zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)
        carry = {"inputs": zeros(x_like, slots["input_slots"], virtual),
                 "cotangents": zeros(x_like, slots["cotangent_slots"], virtual),
                 "g_chunks": f32_zeros(chunks), "g_outer": f32_zeros(outer), "loss": jnp.zeros((), jnp.float32)}
        if save:
            saved_like = jax.eval_shape(forward_saving, take_chunk(0), zeros_x)[1]
            carry["residuals"] = zeros(saved_like, slots["residual_slots"], virtual)
        if zero_bubble:
            per_chunk = jax.tree.leaves(chunks)[0].shape[1]
            carry["deferred"] = zeros(x_like, slots["deferred_slots"], virtual, per_chunk)

        def add_outer(c, g_outer):
            return {**c, "g_outer": jax.tree.map(lambda a, g: a + g.astype(jnp.float32), c["g_outer"], g_outer)}

        def add_chunk(c, g_chunk, v):
            return {**c, "g_chunks": jax.tree.map(lambda a, g: put(a, take(a, v) + g.astype(jnp.float32), v),
                                                  c["g_chunks"], g_chunk)}

        def chunk_input(c, m, v):
            """The first model stage embeds the microbatch; the others read what they received (with
            the embedding's sharding: both branches of a cond must agree)."""
            received = lambda: constrain(read(c["inputs"], m, v, slots["input_slots"]), ("batch", "seq", "embed"))
            return jax.lax.cond(is_first(v), lambda: embed(outer, m), received)

        def forward(c, m, v):
            x = chunk_input(c, m, v)
            if save:
                y, saved = forward_saving(take_chunk(v), x)
                c = {**c, "residuals": write(c["residuals"], saved, m, v, slots["residual_slots"])}
            else:
                y = model.run_blocks(take_chunk(v), x)

            def head_and_loss(c):
                """The loss, and at once its pullback to y: the cotangent this chunk's backward reads."""
                loss, (g_outer, g_y) = jax.value_and_grad(microbatch_loss, argnums=(0, 1))(outer, y, m)
                c = add_outer(c, jax.tree.map(lambda g: g / micro, g_outer))
                return {**c, "loss": c["loss"] + loss,
                        "cotangents": write(c["cotangents"], g_y / micro, m, v, slots["cotangent_slots"])}

            return jax.lax.cond(is_last(v), head_and_loss, lambda c: c, c), y

        def backward(c, m, v):
            g_y = read(c["cotangents"], m, v, slots["cotangent_slots"])
            if save:
                def layer_back(g, xs):
                    p_layer, saved = xs
                    g_p, g_x = layers.pullback(p_layer, saved, g)
                    return g_x, (g if zero_bubble else g_p)  # zb: keep each layer's output cotangent for W

                saved = read(c["residuals"], m, v, slots["residual_slots"])
                g_x, per_layer = jax.lax.scan(layer_back, g_y, (take_chunk(v), saved), reverse=True)
                if zero_bubble:
                    c = {**c, "deferred": write(c["deferred"], per_layer, m, v, slots["deferred_slots"])}
                else:
                    c = add_chunk(c, per_layer, v)
            else:
                x = chunk_input(c, m, v)
                g_chunk, g_x = jax.vjp(model.run_blocks, take_chunk(v), x)[1](g_y)
                c = add_chunk(c, g_chunk, v)

            def embedding_grad(c):
                return add_outer(c, jax.vjp(lambda o: embed(o, m), outer)[1](g_x)[0])

            return jax.lax.cond(is_first(v), embedding_grad, lambda c: c, c), g_x

        def weight_grad(c, m, v):
            """zb's deferred W: each layer's parameter gradient from its residuals and output cotangent."""
            def layer_w(_, xs):
                p_layer, saved, g = xs
                return None, layers.pullback(p_layer, saved, g)[0]

            xs = (take_chunk(v), read(c["residuals"], m, v, slots["residual_slots"]),
                  read(c["deferred"], m, v, slots["deferred_slots"]))
            return add_chunk(c, jax.lax.scan(layer_w, None, xs)[1], v)

        def make_tick(uses):
            def tick(c, t):
                at = lambda name: tab[name][t, s]
                send_f = send_b = zeros_x
                if "F" in uses:
                    c, send_f = jax.lax.cond(at("F") > 0, forward, lambda c, m, v: (c, zeros_x),
                                             c, at("F_micro"), at("F_chunk"))
                if "B" in uses:
                    c, send_b = jax.lax.cond(at("B") > 0, backward, lambda c, m, v: (c, zeros_x),
                                             c, at("B_micro"), at("B_chunk"))
                if "W" in uses:
                    c = jax.lax.cond(at("W") > 0, weight_grad, lambda c, m, v: c, c, at("W_micro"), at("W_chunk"))
                for name, buffer, shift, sent in (("recv_f", "inputs", 1, send_f), ("recv_b", "cotangents", -1, send_b)):
                    if name in uses:
                        got = jax.lax.ppermute(sent, "pipeline", [(i, (i + shift) % stages) for i in range(stages)])
                        n = slots["input_slots" if buffer == "inputs" else "cotangent_slots"]
                        c = {**c, buffer: jax.lax.cond(
                            at(name) > 0, lambda b: write(b, got, at(f"{name}_micro"), at(f"{name}_chunk"), n),
                            lambda b: b, c[buffer])}
                return c, None

            return tick

        for start, end, uses in phases:
            carry, _ = jax.lax.scan(make_tick(uses), carry, jnp.arange(start, end))
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
