"""The SPMD pipeline executor: one program, run by every stage inside `jax.shard_map` over the
`pipeline` axis, steps through a schedule's timetable (meshtrain/parallel/schedules.py) tick by tick.

In a tick a stage runs the actions of its slot, each behind a `lax.cond` on its own table entry
(so an idle stage computes nothing): the forward of one chunk of one microbatch, its backward,
and where the schedule splits it off (zb, dualpipev) a weight gradient. The stages exchange what
the timetable sends: activations to the next model stage, cotangents to the previous one
(`ppermute`, circular so that interleaved chunks wrap from the last device to the first; under
DualPipeV's V both ways, and nothing at the turn, where the next model stage is on the same
device). The ticks run as up to three scans (warm-up, steady, cool-down), each holding only the
actions and sends its ticks use: the warm-up sends no cotangents, the cool-down no activations.
What waits between ticks sits in ring buffers (received inputs and cotangents, residuals, W's
stash) sized from the timetable, which the actions read inside their conds and write after them
(meshtrain/engine/stage_state.py `store`: no buffer is a cond's output, which XLA would copy).

Residuals (`parallel.residuals`):
- `save` (default): the forward runs each layer under `jax.vjp` and keeps the residuals its
  backward needs (with `parallel.remat`, only what the remat policy saves; the parameters are read
  again, never copied); the backward applies them, so no forward is run twice.
- `recompute`: a stage keeps only each chunk's input and reruns the chunk's forward in its
  backward (less memory, a third more compute).
Where the schedule splits the weight gradient (`zb`, `dualpipev`) the backward computes only the
input gradient, layer by layer, and stashes what the weight gradient (W) reads besides the
residuals: each weight matmul's output cotangent (meshtrain/engine/split_backward.py).

The embedding and the head are not split into stages: the first stage embeds each microbatch as it
enters (and adds the embedding gradient in its backward), the stage holding the last model stage
(the last stage; under DualPipeV's V the first) applies the head and the loss in the forward and
pulls the loss back to the chunk's output at once (so its backward reads that cotangent like any
other stage). Layers that `embed` runs (deepseek_v3's dense first layers, outer parameters) run
there too, their forward again in the embedding gradient. The loss is the objective's `head`
(meshtrain/objectives/base.py) on the microbatch, whose rows the objective ordered so that a
microbatch is whole for it (`Objective.sequences`), and its outputs (the metrics) are kept per
microbatch. A forward-only pass (meshtrain/engine/pipeline_step.py `make_pipeline_scores`: an objective's forward scores,
meshtrain/objectives/base.py `scores_first`) runs a schedule's forwards alone (`forwards_of`) and
keeps the heads' outputs only: no residuals, no gradients. The layers' statistics are summed over
microbatches and stages, the per-layer ones (models/base.py PER_LAYER_STATS, the router-bias
update's expert loads) kept per layer and gathered over the stages in storage order. Gradients
accumulate locally over microbatches; they are summed over the pipeline axis (embedding, final norm,
head) and reduced over `data` (a manual axis too when data > 1, at every ZeRO stage:
meshtrain/parallel/data_parallel.py) once per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.engine import stage_state
from meshtrain.engine.stage_state import LayerResiduals, put, read, take, zeros
from meshtrain.models.base import PER_LAYER_STATS, layer_means, layer_sums, per_layer, scan_blocks
from meshtrain.models.lora import layer_keys
from meshtrain.objectives.base import Microbatch
from meshtrain.ops.trainable import freeze, merge, select
from meshtrain.parallel.schedules import Schedule, device_of, layer_order
from meshtrain.parallel.sharding import constrain
from meshtrain.parallel.tick_tables import CHANNELS, phase_scope, tick_cond


class StageProgram:
    """What one stage runs, traced inside the shard_map: a carry of buffers and gradient sums, one
    method per action, and the ticks that call them. `tables`, `slots` and `phases` come from the
    timetable (meshtrain/parallel/tick_tables.py). `micro`: the microbatches' rows [M, b, ...]
    ('inputs', 'targets', 'docs' or None, the objective's 'extras' or None, the rows' random 'noise' or
    None: meshtrain/parallel/batching.py `stage_rows`). `head`: (outer parameters, the last chunk's
    output, a `Microbatch`) -> (its loss, its outputs, a pytree kept per microbatch); `trains=False`:
    a forward-only pass (`forwards_of` a schedule's tables) that keeps no residuals and no gradients,
    only the heads' outputs."""

    def __init__(self, model, layer, schedule: Schedule, residuals: str, stages: int, micro: int,
                 virtual: int, tables: dict, slots: dict, blocks, outer, micro_rows: dict, head, scale=None,
                 kinds=None, aux_weight=None, trains: bool = True):
        self.model, self.stages, self.micro, self.virtual = model, stages, micro, virtual
        self.keep = model.cfg.trainable  # the gradient sums hold the trainable parameters' only
        self.scale = 1.0 if scale is None else scale  # fp16's loss scale: every cotangent's source is scaled
        self.head, self.extras, self.trains = head, micro_rows["extras"], trains
        self.save, self.splits_weight_grad = trains and residuals == "save", schedule.splits_weight_grad
        self.writes = {"F": ("residuals",) * self.save + ("cotangents",) * trains,  # the RINGS each action writes
                       "B": ("deferred",) * (self.save and self.splits_weight_grad), "W": ()}
        self.tables, self.slots = {k: jnp.asarray(v) for k, v in tables.items()}, slots
        self.s = jax.lax.axis_index("pipeline")
        # under LoRA the adapters and their gradient sums are whole inside the ticks (stage_state.whole: why)
        self.whole_adapters = stage_state.has_frozen(blocks, self.keep)
        if self.whole_adapters:
            blocks = merge(blocks, stage_state.whole(self.trained_blocks(blocks)))
        self.chunks = jax.tree.map(lambda p: p.reshape(virtual, -1, *p.shape[1:]), blocks)
        self.kinds = None if kinds is None else jnp.asarray(kinds)[self.s]  # [V, layers per chunk] (`stage_kinds`)
        # the microbatches' row keys (models/lora.py) and this stage's layers' indices in model order [V, per chunk]
        self.noise = micro_rows["noise"]
        self.layer_ids = jnp.asarray(layer_order(model.stacked_layers, stages, virtual, schedule.placement).reshape(
            stages, virtual, -1))[self.s]
        self.last_stage, self.last_chunk = device_of(schedule.placement, stages * virtual - 1, stages)
        self.outer, self.docs = outer, micro_rows["docs"]
        self.inputs, self.targets = micro_rows["inputs"], micro_rows["targets"]
        x_like = jax.eval_shape(self.embed, outer, 0)
        self.zeros_x = jnp.zeros(x_like.shape, x_like.dtype)
        # d objective / d (a layer's statistics) = the auxiliary losses' weights / (layers x micro),
        # times a loss mask's trained share (StepInputs)
        first = None if self.kinds is None else self.kinds[0, 0]
        stats_like = jax.eval_shape(lambda p, x, k, *docs: layer(p, x, *docs, **stage_state.kind_kwarg(k)),
                                    jax.tree.map(lambda p: p[0], self.chunk(0)), self.zeros_x, first,
                                    *self.documents(0))[1]
        g_stats = jax.grad(model.auxiliary_loss)(jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), stats_like))
        weight = self.scale if aux_weight is None else self.scale * aux_weight
        self.layers = LayerResiduals(layer, jax.tree.map(lambda g: g * weight / (model.stacked_layers * micro),
                                                         g_stats))

    # ---- pieces ----
    def chunk(self, v):
        return jax.tree.map(lambda p: take(p, v), self.chunks)

    def chunk_kinds(self, v):
        """The kinds of chunk v's layers, or None."""
        return None if self.kinds is None else take(self.kinds, v)

    def chunk_noise(self, v, m):
        """The random keys [layers per chunk, b, 2] of chunk v's layers for microbatch m, or None:
        its rows' keys folded with each layer's index in model order (models/lora.py `layer_keys`)."""
        return None if self.noise is None else layer_keys(take(self.noise, m), take(self.layer_ids, v))

    def layer_args(self, v, m) -> dict:
        """The per-layer keyword arguments of chunk v's layers for microbatch m (models/base.py `per_layer`)."""
        return per_layer(self.chunk_kinds(v), self.chunk_noise(v, m))

    def chunk_g_stats(self):
        """`g_stats` for a chunk's `scan_blocks` statistics: the PER_LAYER_STATS' for each of its layers."""
        per_chunk = jax.tree.leaves(self.chunks)[0].shape[1]
        return {k: jnp.broadcast_to(g, (per_chunk, *g.shape)) if k in PER_LAYER_STATS else g
                for k, g in self.layers.g_stats.items()}

    def is_first(self, v):  # the model stage that embeds
        return (self.s == 0) & (v == 0)

    def is_last(self, v):  # the one that applies the head and the loss
        return (self.s == self.last_stage) & (v == self.last_chunk)

    def documents(self, m) -> tuple:
        """(microbatch m's packing.Documents,), or () when the model packs none: the layers' extra
        arguments, travelling with the microbatch."""
        return () if self.docs is None else (jax.tree.map(lambda d: take(d, m), self.docs),)

    def embed(self, p_outer, m):
        return self.model.embed(freeze(p_outer, self.keep), take(self.inputs, m))

    def microbatch_head(self, p_outer, y, m):
        """(microbatch m's loss, its outputs): `head` on its rows."""
        at_m = lambda tree: jax.tree.map(lambda e: take(e, m), tree)
        micro = Microbatch(take(self.inputs, m), take(self.targets, m), at_m(self.docs), at_m(self.extras))
        return self.head(freeze(p_outer, self.keep), y, micro)

    def scaled_loss(self, p_outer, y, m):
        """(the loss x scale, to differentiate; the outputs)."""
        loss, outputs = self.microbatch_head(p_outer, y, m)
        return loss * self.scale, outputs

    def forward_saving(self, p_chunk, args, x, *docs):
        """(y, (each layer's residuals stacked, the chunk's statistics summed over its layers, the
        PER_LAYER_STATS per layer)); `args`: the layers' keyword arguments (`layer_args`)."""
        y, (saved, stats) = jax.lax.scan(lambda x, pa: self.layers.forward(pa[0], x, *docs, **pa[1]), x,
                                         (p_chunk, args))
        return y, (saved, layer_sums(stats))

    def initial_carry(self) -> dict:
        f32_zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)
        n, V = self.slots, self.virtual
        outputs_like = jax.eval_shape(self.microbatch_head, self.outer, self.zeros_x, 0)[1]
        carry = {"inputs": zeros(self.zeros_x, n["input_slots"] + 1, V),  # + 1: the spare slot (`store`)
                 "outputs": jax.tree.map(lambda o: jnp.zeros((self.micro, *o.shape), jnp.float32), outputs_like)}
        if self.trains:
            carry |= {"cotangents": zeros(self.zeros_x, n["cotangent_slots"] + 1, V),
                      "g_chunks": f32_zeros(self.trained_blocks(self.chunks)),
                      "g_outer": f32_zeros(select(self.outer, self.keep))}
        saved_like, stats_like = jax.eval_shape(self.forward_saving, self.chunk(0), self.layer_args(0, 0), self.zeros_x,
                                                *self.documents(0))[1]
        # the PER_LAYER_STATS summed per chunk and layer [V, layers per chunk, ...] (`add_stats`)
        carry["stats"] = {k: zeros(s, V) if k in PER_LAYER_STATS else zeros(s) for k, s in stats_like.items()}
        if self.save:
            carry["residuals"] = zeros(saved_like, n["residual_slots"] + 1, V)
        if self.splits_weight_grad:
            per_chunk = jax.tree.leaves(self.chunks)[0].shape[1]
            layer = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)  # [0]'s shape
            args = jax.tree.map(lambda a: a[0], self.layer_args(0, 0))
            stash_like = self.layers.stash_like(layer(self.chunk(0)), layer(saved_like), self.zeros_x,
                                                *self.documents(0), **args)
            carry["deferred"] = zeros(stash_like, n["deferred_slots"] + 1, V, per_chunk)
        return carry

    def trained_blocks(self, blocks):
        return select(blocks, self.keep, ("blocks",))

    def add_outer(self, c, g_outer):
        return {**c, "g_outer": jax.tree.map(lambda a, g: a + g.astype(jnp.float32), c["g_outer"],
                                             select(g_outer, self.keep))}

    def add_stats(self, c, stats, v):
        """Chunk v's statistics added to the sums over microbatches (the PER_LAYER_STATS at its rows)."""
        add = lambda a, s: a + s.astype(jnp.float32)
        per_layer = lambda a, s: put(a, add(take(a, v), s), v)
        return {**c, "stats": {k: jax.tree.map(per_layer if k in PER_LAYER_STATS else add, a, stats[k])
                               for k, a in c["stats"].items()}}

    def add_chunk(self, c, g_chunk, v):
        g_chunk = self.trained_blocks(g_chunk)
        pin = stage_state.whole if self.whole_adapters else lambda tree: tree
        return {**c, "g_chunks": pin(jax.tree.map(lambda a, g: put(a, take(a, v) + g.astype(jnp.float32), v),
                                                  pin(c["g_chunks"]), pin(g_chunk)))}

    def chunk_input(self, c, m, v):
        """The first model stage embeds the microbatch; the others read what they received. Both
        branches of a cond must agree on the sharding: the embedding's, pinned on the first branch
        too (after deepseek_v3's dense layers, XLA left it replicated: "Inconsistent conditional
        sharding" on fsdp=2,pipeline=2)."""
        pin = lambda x: constrain(x, ("batch", "seq", "embed"))
        received = lambda: pin(read(c["inputs"], m, v, self.slots["input_slots"]))
        return tick_cond("first", self.is_first(v), lambda: pin(self.embed(self.outer, m)), received)

    # ---- actions ----
    def forward(self, c, m, v):
        """(the carry, y to send, the writes to RINGS: the residuals, the head's cotangent)."""
        x, docs, writes = self.chunk_input(c, m, v), self.documents(m), {}
        if self.save:
            y, (saved, stats) = self.forward_saving(self.chunk(v), self.layer_args(v, m), x, *docs)
            writes["residuals"] = (saved, m, v, True)
        else:
            y, stats = scan_blocks(self.layers.layer, self.chunk(v), x, *docs, kinds=self.chunk_kinds(v),
                                   noise=self.chunk_noise(v, m))
        c = self.add_stats(c, stats, v)

        def keep(c, outputs):
            return {**c, "outputs": jax.tree.map(lambda a, o: put(a, o.astype(a.dtype), m), c["outputs"], outputs)}

        def head_and_loss(c):
            """The loss, and at once its pullback to y: the cotangent this chunk's backward reads."""
            (_, outputs), (g_outer, g_y) = jax.value_and_grad(self.scaled_loss, argnums=(0, 1), has_aux=True)(
                self.outer, y, m)
            return keep(self.add_outer(c, jax.tree.map(lambda g: g / self.micro, g_outer)), outputs), g_y / self.micro

        head = head_and_loss if self.trains else lambda c: (keep(c, self.microbatch_head(self.outer, y, m)[1]), y)
        c, g_y = stage_state.without_rings(c, lambda c: tick_cond("last", self.is_last(v), head, lambda c: (c, y), c))
        if self.trains:
            writes["cotangents"] = (g_y, m, v, self.is_last(v))
        return c, y, writes

    def backward(self, c, m, v):
        """The input gradient (sent back) and, unless the schedule splits it off (zb), the chunk's weight
        gradient; the writes: under zb, what W will read."""
        g_y = read(c["cotangents"], m, v, self.slots["cotangent_slots"])
        docs = self.documents(m)
        if self.save:
            def layer_back(g, xs):
                p_layer, saved, args = xs
                if self.splits_weight_grad:  # zb: d x alone, and what W will read (meshtrain/engine/split_backward.py)
                    return self.layers.input_grad(p_layer, saved, g, *docs, **args)
                g_p, g_x = self.layers.pullback(p_layer, saved, g, *docs, **args)
                return g_x, g_p

            saved = read(c["residuals"], m, v, self.slots["residual_slots"])
            g_x, layers = jax.lax.scan(layer_back, g_y, (self.chunk(v), saved, self.layer_args(v, m)), reverse=True)
            if self.splits_weight_grad:
                writes = {"deferred": (layers, m, v, True)}
            else:
                c = self.add_chunk(c, layers, v)
        else:
            x = self.chunk_input(c, m, v)
            chunk_forward = lambda p, x: scan_blocks(self.layers.layer, p, x, *docs, kinds=self.chunk_kinds(v),
                                                     noise=self.chunk_noise(v, m))
            g_chunk, g_x = jax.vjp(chunk_forward, self.chunk(v), x)[1]((g_y, self.chunk_g_stats()))
            c = self.add_chunk(c, g_chunk, v)

        def embedding_grad(c):
            return self.add_outer(c, jax.vjp(lambda o: self.embed(o, m), self.outer)[1](g_x)[0])

        c = stage_state.without_rings(c, lambda c: tick_cond("first", self.is_first(v), embedding_grad, lambda c: c, c))
        return c, g_x, writes if self.save and self.splits_weight_grad else {}

    def weight_grad(self, c, m, v):
        """A split-off W (zb, dualpipev): each layer's parameter gradient from its residuals and the stash
        its B kept (meshtrain/engine/split_backward.py)."""
        docs = self.documents(m)

        def layer_w(_, xs):
            p_layer, saved, stash, args = xs
            return None, self.layers.weight_grad(p_layer, saved, stash, self.zeros_x, *docs, **args)

        xs = (self.chunk(v), read(c["residuals"], m, v, self.slots["residual_slots"]),
              read(c["deferred"], m, v, self.slots["deferred_slots"]), self.layer_args(v, m))
        return self.add_chunk(c, jax.lax.scan(layer_w, None, xs)[1], v), None, {}

    # ---- ticks ----
    def act(self, kind, pred, m, v, c):
        """Action `kind` behind its conditional (F, B, W: (carry, m, v) -> (carry, what it sends, its
        writes to the RINGS)), then its writes (`store`, outside the conditional)."""
        rings = {k: c[k] for k in stage_state.RINGS if k in c}

        def run(rest, m, v):
            action = {"F": self.forward, "B": self.backward, "W": self.weight_grad}[kind]
            out, sent, writes = action({**rest, **rings}, m, v)
            return {k: out[k] for k in rest}, sent, writes

        def idle(rest, m, v):
            zero = lambda k: (jax.tree.map(lambda b: jnp.zeros(b.shape[2:], b.dtype), rings[k]), m, v, False)
            return rest, None if kind == "W" else self.zeros_x, {k: zero(k) for k in self.writes[kind]}

        rest, sent, writes = stage_state.without_rings(c, lambda rest: tick_cond(kind, pred, run, idle, rest, m, v))
        for name, (value, at_m, at_v, taken) in writes.items():
            rest[name] = stage_state.store(rest[name], value, at_m, at_v, self.slots[stage_state.SLOTS[name]], taken)
        return rest, sent

    def tick(self, uses: frozenset):
        """One tick of a phase: the actions and sends in `uses`, each action behind its own cond: F,
        B, the sends on the CHANNELS of the phase (a ppermute each, or none for a stage's own next
        chunk), then W."""
        buffers = {"F": "inputs", "B": "cotangents"}

        def tick(c, t):
            at = lambda name: self.tables[name][t, self.s]
            run = lambda c, kind: self.act(kind, at(kind) > 0, at(f"{kind}_micro"), at(f"{kind}_chunk"), c)
            sent = {}
            for kind in ("F", "B"):
                if kind in uses:
                    c, sent[kind] = run(c, kind)
            for name, kind, shift in CHANNELS:
                if name in uses:
                    got = sent.get(kind, self.zeros_x)  # shift 0: kept on this stage (a V's turn)
                    if shift:
                        got = jax.lax.ppermute(got, "pipeline", [(i, (i + shift) % self.stages)
                                                                 for i in range(self.stages)])
                    buffer = buffers[kind]
                    with jax.named_scope(f"tick_{name}"):
                        c = {**c, buffer: stage_state.store(c[buffer], got, at(f"{name}_micro"), at(f"{name}_chunk"),
                                                self.slots[stage_state.SLOTS[buffer]], at(name) > 0)}
            if "W" in uses:  # after the sends, which need only F's and B's outputs: a W beside them (dualpipev's
                # full backward, B then W) computes while they travel
                c, _ = run(c, "W")
            return c, None

        return tick

    def ticks(self, phases) -> dict:
        """The carry after all ticks, phase by phase."""
        carry = self.initial_carry()
        for i, (start, end, uses) in enumerate(phases):
            with jax.named_scope(phase_scope(self.trains, i)):  # the planner's walk finds the phase by it
                carry, _ = jax.lax.scan(self.tick(uses), carry, jnp.arange(start, end))
        return carry

    def outputs(self, carry):
        """The heads' outputs [M, ...], from the stage of the last model stage to every stage (the
        others hold zeros)."""
        return jax.lax.psum(carry["outputs"], "pipeline")

    def run(self, phases):
        """All ticks; then the step's metrics (the heads' outputs and the layers' statistics, means
        over microbatches) and gradient sums over the pipeline."""
        carry = self.ticks(phases)
        # the stages' sums; the PER_LAYER_STATS as each stage's rows, [N, ...] in storage order (`layer_order`)
        stats = {k: jax.lax.all_gather(s.reshape(-1, *s.shape[2:]), "pipeline", tiled=True) if k in PER_LAYER_STATS
                 else jax.lax.psum(s, "pipeline") for k, s in carry["stats"].items()}
        stats = layer_means(stats, self.model.stacked_layers)
        metrics = jax.tree.map(lambda s: s / self.micro, {**jax.tree.map(lambda o: o.sum(0), self.outputs(carry)),
                                                           **stats})
        g_outer = jax.lax.psum(carry["g_outer"], "pipeline")
        g_blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), carry["g_chunks"])
        return metrics, g_blocks, g_outer
