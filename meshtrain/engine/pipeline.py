"""The SPMD pipeline executor: one program, run by every stage inside `jax.shard_map` over the
`pipeline` axis, steps through a schedule's timetable (meshtrain/parallel/schedules.py) tick by tick.

In a tick a stage runs the actions of its slot behind conditionals on its table entries (so an idle
stage computes nothing): the forward of one chunk of one microbatch (F), the backward of one (B),
and where the schedule splits it off (zb, dualpipev) a weight gradient (W). Under DualPipeV with an
`expert` axis (meshtrain/parallel/tick_tables.py `pairs_forward_backward`) one conditional holds a
tick's F and B (`act_pair`), and a steady tick's pair, of different microbatches, runs as one scan
over the layers (`paired`), so XLA's scheduler can run one's expert all-to-alls under the other's
compute (DualPipeV's overlap). The stages exchange what the timetable sends: activations to the
next model stage, cotangents to the previous one (`ppermute`, circular so that interleaved chunks
wrap from the last device to the first; under DualPipeV's V both ways, and nothing at the turn,
where the next model stage is on the same device). The ticks run as up to three scans (warm-up,
steady, cool-down), each holding only the actions and sends its ticks use: the warm-up sends no
cotangents, the cool-down no activations.
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
microbatch. A forward-only pass (meshtrain/engine/pipeline_step.py `make_pipeline_scores`: an
objective's forward scores, meshtrain/objectives/base.py `scores_first`) runs a schedule's forwards
alone (`forwards_of`) and keeps the heads' outputs only: no residuals, no gradients. The layers'
statistics are summed over microbatches and stages, the per-layer ones (models/base.py
PER_LAYER_STATS, the router-bias update's expert loads) kept per layer and gathered over the stages
in storage order. Gradients accumulate locally over microbatches; they are summed over the
pipeline axis (embedding, final norm, head) and reduced over `data` (a manual axis too when data >
1, at every ZeRO stage: meshtrain/parallel/data_parallel.py) once per step.
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
from meshtrain.parallel.tick_tables import (
    B_ONLY,
    CHANNELS,
    F_ONLY,
    IDLE,
    PAIRED,
    phase_scope,
    tick_cond,
    tick_switch,
)


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
                 kinds=None, aux_weight=None, trains: bool = True, pairs: bool = False):
        self.model, self.stages, self.micro, self.virtual = model, stages, micro, virtual
        self.keep = model.cfg.trainable  # the gradient sums hold the trainable parameters' only
        self.scale = 1.0 if scale is None else scale  # fp16's loss scale: every cotangent's source is scaled
        self.head, self.extras, self.trains = head, micro_rows["extras"], trains
        self.save, self.splits_weight_grad = trains and residuals == "save", schedule.splits_weight_grad
        self.pairs = trains and pairs  # F and B behind one conditional (`act_pair`; tick_tables.pairs_forward_backward)
        assert not self.pairs or (self.save and self.splits_weight_grad), "`paired` reads saved residuals, stashes"
        self.writes = {"F": ("residuals",) * self.save + ("cotangents",) * trains,  # the RINGS each action writes
                       "B": ("deferred",) * (self.save and self.splits_weight_grad), "W": ()}
        self.tables, self.slots = {k: jnp.asarray(v) for k, v in tables.items()}, slots
        self.s = jax.lax.axis_index("pipeline")
        # under LoRA the adapters and their gradient sums are whole inside the ticks (stage_state.whole: why)
        self.whole_adapters = stage_state.has_frozen(blocks, self.keep)
        if self.whole_adapters:
            blocks = merge(blocks, stage_state.whole(self.trained_blocks(blocks)))
        self.chunks = jax.tree.map(lambda p: p.reshape(virtual, -1, *p.shape[1:]), blocks)
        self.per_chunk = jax.tree.leaves(self.chunks)[0].shape[1]  # layers a chunk
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
        return {k: jnp.broadcast_to(g, (self.per_chunk, *g.shape)) if k in PER_LAYER_STATS else g
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
            layer = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)  # [0]'s shape
            args = jax.tree.map(lambda a: a[0], self.layer_args(0, 0))
            stash_like = self.layers.stash_like(layer(self.chunk(0)), layer(saved_like), self.zeros_x,
                                                *self.documents(0), **args)
            carry["deferred"] = zeros(stash_like, n["deferred_slots"] + 1, V, self.per_chunk)
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
    def forward(self, c, m, v, heads=True):
        """(the carry, y to send, the writes to RINGS: the residuals, the head's cotangent)."""
        x = self.chunk_input(c, m, v)
        if self.save:
            y, (saved, stats) = self.forward_saving(self.chunk(v), self.layer_args(v, m), x, *self.documents(m))
        else:
            saved, (y, stats) = None, scan_blocks(self.layers.layer, self.chunk(v), x, *self.documents(m),
                                                  kinds=self.chunk_kinds(v), noise=self.chunk_noise(v, m))
        return self.forward_end(c, y, saved, stats, m, v, heads)

    def forward_end(self, c, y, saved, stats, m, v, heads=True):
        """F after its layers: its statistics added and, unless `heads=False` (left to the caller,
        `act_pair`), the head (`head_of`); (the carry, y, the writes)."""
        writes = {} if saved is None else {"residuals": (saved, m, v, True)}
        c = self.add_stats(c, stats, v)
        if heads:
            c, head_writes = self.head_of(c, y, m, v, True)
            writes |= head_writes
        return c, y, writes

    def head_of(self, c, y, m, v, taken):
        """Where `taken` and chunk v is the last model stage, the head and the loss on its output y;
        (the carry, the writes: the loss's cotangent)."""
        pred = taken & self.is_last(v)
        c, g_y = stage_state.without_rings(c, lambda c: tick_cond("last", pred, lambda c: self.head_and_loss(c, y, m),
                                                                  lambda c: (c, y), c))
        return c, ({"cotangents": (g_y, m, v, pred)} if self.trains else {})

    def head_and_loss(self, c, y, m):
        """The loss on microbatch m's last output y, and at once its pullback to y: the cotangent this
        chunk's backward reads (a forward-only pass: the head's outputs, and y)."""
        def keep(c, outputs):
            return {**c, "outputs": jax.tree.map(lambda a, o: put(a, o.astype(a.dtype), m), c["outputs"], outputs)}

        if not self.trains:
            return keep(c, self.microbatch_head(self.outer, y, m)[1]), y
        (_, outputs), (g_outer, g_y) = jax.value_and_grad(self.scaled_loss, argnums=(0, 1), has_aux=True)(
            self.outer, y, m)
        return keep(self.add_outer(c, jax.tree.map(lambda g: g / self.micro, g_outer)), outputs), g_y / self.micro

    def back_step(self, v, m, saved):
        """(g, i) -> the backward of chunk v's layer n - 1 - i for microbatch m (`layer_back`): B's scan
        over its chunk, the last layer first; `saved`: the chunk's residuals."""
        p, args, docs, n = self.chunk(v), self.layer_args(v, m), self.documents(m), self.per_chunk
        return lambda g, i: self.layer_back(*_layer((p, saved), n - 1 - i), g, docs, _layer(args, n - 1 - i))

    def layer_back(self, p_layer, saved, g, docs, args):
        """One layer's backward from its residuals: (d x, d p_layer), or where the schedule splits the
        weight gradient off (zb), (d x, the stash W will read: meshtrain/engine/split_backward.py)."""
        if self.splits_weight_grad:
            return self.layers.input_grad(p_layer, saved, g, *docs, **args)
        g_p, g_x = self.layers.pullback(p_layer, saved, g, *docs, **args)
        return g_x, g_p

    def backward(self, c, m, v, embeds=True):
        """The input gradient (sent back) and, unless the schedule splits it off (zb), the chunk's weight
        gradient; the writes: under zb, what W will read. `embeds=False`: the embedding's gradient is left
        to the caller (`act_pair`)."""
        ring = lambda name: read(c[name], m, v, self.slots[stage_state.SLOTS[name]])
        g_y, docs, steps = ring("cotangents"), self.documents(m), jnp.arange(self.per_chunk)
        if self.save:  # the last layer first: under zb the stash in that order (as `paired`), else in layer order
            back = self.back_step(v, m, ring("residuals"))
            g_x, layers = (jax.lax.scan(back, g_y, steps) if self.splits_weight_grad else
                           jax.lax.scan(back, g_y, steps[::-1], reverse=True))
            return self.backward_end(c, g_x, layers, m, v, embeds)
        x = self.chunk_input(c, m, v)
        chunk_forward = lambda p, x: scan_blocks(self.layers.layer, p, x, *docs, kinds=self.chunk_kinds(v),
                                                 noise=self.chunk_noise(v, m))
        g_chunk, g_x = jax.vjp(chunk_forward, self.chunk(v), x)[1]((g_y, self.chunk_g_stats()))
        c = self.add_chunk(c, g_chunk, v)
        return (self.embedding_grad(c, g_x, m, v, True) if embeds else c), g_x, {}

    def backward_end(self, c, g_x, layers, m, v, embeds=True):
        """B after its layers (`layers`: each layer's `layer_back` output, in layer order; under zb, the
        stash, in B's order): the weight gradient added, or under zb the stash written; the embedding's
        gradient where chunk v is the first model stage."""
        writes = {"deferred": (layers, m, v, True)} if self.splits_weight_grad else {}
        if not self.splits_weight_grad:
            c = self.add_chunk(c, layers, v)
        return (self.embedding_grad(c, g_x, m, v, True) if embeds else c), g_x, writes

    def embedding_grad(self, c, g_x, m, v, taken):
        """Where `taken` and chunk v is the first model stage, the embedding's gradient from d x, added."""
        pred = taken & self.is_first(v)
        add = lambda c: self.embedding_grad_of(c, g_x, m)
        return stage_state.without_rings(c, lambda c: tick_cond("first", pred, add, lambda c: c, c))

    def embedding_grad_of(self, c, g_x, m):
        return self.add_outer(c, jax.vjp(lambda o: self.embed(o, m), self.outer)[1](g_x)[0])

    def paired(self, c, f, b):
        """F of `f` and B of `b` ((microbatch, chunk) each, different) in one scan over the layers: layer
        i's forward beside layer n - 1 - i's backward, which do not depend on each other, so XLA's
        scheduler can run one's all-to-alls under the other's compute. Residuals saved, the weight
        gradient split off (dualpipev): B's stash in B's order, as `backward` keeps it. (carry, sent,
        writes)."""
        (mf, vf), (mb, vb) = f, b
        with jax.named_scope("tick_F"):
            x = self.chunk_input(c, mf, vf)
        docs_f, p_f, args_f = self.documents(mf), self.chunk(vf), self.layer_args(vf, mf)
        g = read(c["cotangents"], mb, vb, self.slots["cotangent_slots"])
        back = self.back_step(vb, mb, read(c["residuals"], mb, vb, self.slots["residual_slots"]))

        def layer_pair(carry, i):
            x, g = carry
            y, (saved, stats) = self.layers.forward(_layer(p_f, i), x, *docs_f, **_layer(args_f, i))
            g_x, stash = back(g, i)
            return (y, g_x), (saved, stats, stash)

        (y, g_x), (saved, stats, stash) = jax.lax.scan(layer_pair, (x, g), jnp.arange(self.per_chunk))
        with jax.named_scope("tick_F"):
            c, y, writes_f = self.forward_end(c, y, saved, layer_sums(stats), mf, vf, heads=False)
        with jax.named_scope("tick_B"):
            c, g_x, writes_b = self.backward_end(c, g_x, stash, mb, vb, embeds=False)
        return c, {"F": y, "B": g_x}, {"F": writes_f, "B": writes_b}

    def weight_grad(self, c, m, v):
        """A split-off W (zb, dualpipev): each layer's parameter gradient from its residuals and the stash
        its B kept (meshtrain/engine/split_backward.py)."""
        docs, n = self.documents(m), self.per_chunk
        stash = read(c["deferred"], m, v, self.slots["deferred_slots"])  # in B's order (`backward`)

        def layer_w(_, xs):
            p_layer, saved, args, i = xs
            return None, self.layers.weight_grad(p_layer, saved, _layer(stash, n - 1 - i), self.zeros_x, *docs, **args)

        xs = (self.chunk(v), read(c["residuals"], m, v, self.slots["residual_slots"]), self.layer_args(v, m),
              jnp.arange(n))
        return self.add_chunk(c, jax.lax.scan(layer_w, None, xs)[1], v), None, {}

    # ---- ticks ----
    def act(self, kind, pred, m, v, c):
        """Action `kind` behind its conditional, then its writes (`store`, outside the conditional)."""
        rings = stage_state.rings(c)

        def run(rest, m, v):
            return self.run_action(kind, rest, rings, m, v)

        def idle(rest, m, v):
            return rest, *self.idle_action(kind, rings, m, v)

        rest, sent, writes = stage_state.without_rings(c, lambda rest: tick_cond(kind, pred, run, idle, rest, m, v))
        return self.stored(rest, writes), sent

    def act_pair(self, branch, f, b, c):
        """A tick's F and B behind one conditional (`Schedule.pairs_forward_backward`), the branch its `FB`
        table entry names (meshtrain/parallel/tick_tables.py): idle, F, B, or both in one scan over the
        layers (`paired`); then their writes, and the head and the embedding's gradient, each behind its
        own conditional, so that the switch carries neither gradient sum (a conditional copies what it
        returns in each branch that leaves it unchanged: carried by the switch, the head's sum was
        copied in its B-only and idle branches too).
        `f`, `b`: (microbatch, chunk) of each."""
        rings = stage_state.rings(c)
        written = {"F": self.writes["F"][:self.save], "B": self.writes["B"]}  # the head writes the cotangent

        def branch_fn(which):
            def run(rest, f, b):
                if which == PAIRED:
                    out, sent, writes = self.paired({**rest, **rings}, f, b)
                    return {k: out[k] for k in rest}, sent, writes
                sent, writes = {}, {}
                for kind, (m, v) in (("F", f), ("B", b)):
                    if which != (F_ONLY if kind == "F" else B_ONLY):
                        sent[kind], writes[kind] = self.idle_action(kind, rings, m, v, written[kind])
                        continue
                    with jax.named_scope(f"tick_{kind}"):  # the planner's tags inside: FB/F/first ...
                        rest, sent[kind], writes[kind] = self.run_action(
                            kind, rest, rings, m, v, **({"heads": False} if kind == "F" else {"embeds": False}))
                return rest, sent, writes
            return run

        rest, sent, writes = stage_state.without_rings(
            c, lambda rest: tick_switch("FB", branch, [branch_fn(i) for i in (IDLE, F_ONLY, B_ONLY, PAIRED)],
                                        rest, f, b))
        c = self.stored(self.stored(rest, writes["F"]), writes["B"])
        with jax.named_scope("tick_F"):
            c, head_writes = self.head_of(c, sent["F"], *f, (branch == F_ONLY) | (branch == PAIRED))
        with jax.named_scope("tick_B"):
            c = self.embedding_grad(self.stored(c, head_writes), sent["B"], *b, branch >= B_ONLY)
        return c, sent

    def run_action(self, kind, rest, rings, m, v, **kw):
        """Action `kind` (F, B, W: (carry, m, v) -> (carry, what it sends, its writes to the RINGS)) on the
        carry less its RINGS, which it reads."""
        action = {"F": self.forward, "B": self.backward, "W": self.weight_grad}[kind]
        out, sent, writes = action({**rest, **rings}, m, v, **kw)
        return {k: out[k] for k in rest}, sent, writes

    def idle_action(self, kind, rings, m, v, written=None):
        """What an action not taken sends (zeros) and writes (zeros, into the spare slots: `store`) to the
        RINGS it writes (`written`, or all of them)."""
        zero = lambda k: (jax.tree.map(lambda b: jnp.zeros(b.shape[2:], b.dtype), rings[k]), m, v, False)
        written = self.writes[kind] if written is None else written
        return None if kind == "W" else self.zeros_x, {k: zero(k) for k in written}

    def stored(self, rest, writes):
        for name, (value, at_m, at_v, taken) in writes.items():
            rest[name] = stage_state.store(rest[name], value, at_m, at_v, self.slots[stage_state.SLOTS[name]], taken)
        return rest

    def tick(self, uses: frozenset):
        """One tick of a phase: the actions and sends in `uses`: F and B (behind one conditional where the
        executor pairs them and the phase runs both, `act_pair`), the sends on the CHANNELS of the phase (a
        ppermute each, or none for a stage's own next chunk), then W."""
        buffers = {"F": "inputs", "B": "cotangents"}

        def tick(c, t):
            at = lambda name: self.tables[name][t, self.s]
            run = lambda c, kind: self.act(kind, at(kind) > 0, at(f"{kind}_micro"), at(f"{kind}_chunk"), c)
            sent = {}
            if self.pairs and {"F", "B"} <= uses:
                entry = lambda kind: (at(f"{kind}_micro"), at(f"{kind}_chunk"))
                c, sent = self.act_pair(at("FB"), entry("F"), entry("B"), c)
            for kind in ("F", "B"):
                if kind in uses and kind not in sent:
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


def _layer(tree, i):
    """Layer i (traced) of a chunk's stacked tree."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
