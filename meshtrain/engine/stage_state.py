"""What a pipeline stage (meshtrain/engine/pipeline.py) keeps between ticks: each layer's backward
as data (`LayerResiduals`: the residuals `jax.vjp` holds, kept apart from the parameters) and ring
buffers [slots + 1, chunks, ...] indexed by (microbatch, chunk), read and written by dynamic slices
(the last slot a spare one, `store`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.engine.split_backward import SplitPullback
from meshtrain.ops.trainable import select
from meshtrain.parallel.schedules import layer_order
from meshtrain.parallel.sharding import constrain


class LayerResiduals:
    """One layer's backward as data: the function `jax.vjp` returns for the layer (x -> (y, stats))
    is a pytree whose leaves are its residuals (integer ones too, e.g. MoE routing decisions:
    `jax.closure_convert` would bake those in from a retrace instead). `forward` keeps the leaves
    that are not parameters; `pullback` rebuilds the vjp from them and the parameters (retracing the
    layer for the vjp's structure only: that forward is dead code, removed by XLA). `g_stats`: the
    objective's constant derivative by the layer's statistics (the auxiliary losses' weights),
    pulled back with every output cotangent."""

    def __init__(self, layer, g_stats):
        self.layer, self.g_stats = layer, g_stats

    def _vjp(self, p_layer, x, *docs, **kind):
        out, vjp = jax.vjp(lambda p, x: self.layer(p, x, *docs, **kind), p_layer, x)
        leaves, structure = jax.tree.flatten(vjp)
        params = jax.tree.leaves(p_layer)
        is_param = [next((i for i, p in enumerate(params) if leaf is p), None) for leaf in leaves]
        return out, leaves, structure, is_param

    def forward(self, p_layer, x, *docs, **kind):
        """(y, (residuals, stats)); `docs`: the microbatch's packing.Documents, if any; `kind`: the
        layer's, when the model's layers differ (models/base.py `scan_blocks`)."""
        (y, stats), leaves, _, is_param = self._vjp(p_layer, x, *docs, **kind)
        return y, ([leaf for leaf, i in zip(leaves, is_param) if i is None], stats)

    def pullback(self, p_layer, saved, g_y, *docs, **kind):
        """(d p_layer, d x) for the output cotangent g_y (`docs` and `kind` as the forward's)."""
        return self._pullback(p_layer, saved, g_y, self.g_stats, docs, kind)

    def _pullback(self, p_layer, saved, g_y, g_stats, docs, kind):
        _, _, structure, is_param = self._vjp(p_layer, jnp.zeros(g_y.shape, g_y.dtype), *docs, **kind)
        params, saved = jax.tree.leaves(p_layer), iter(saved)
        vjp = jax.tree.unflatten(structure, [params[i] if i is not None else next(saved) for i in is_param])
        return vjp((g_y, g_stats))

    def _split(self, p_layer, saved, g_y, docs, kind):
        args = (p_layer, saved, g_y, self.g_stats, docs, kind)
        return SplitPullback(self._pullback, args, g_arg=2, kept_arg=1), args

    def input_grad(self, p_layer, saved, g_y, *docs, **kind):
        """A deferred weight gradient's B (meshtrain/engine/split_backward.py): (d x, the stash W
        reads: a list of arrays). Where the pullback does not split, the stash is [g_y] and W runs
        the whole pullback again."""
        cut, args = self._split(p_layer, saved, g_y, docs, kind)
        return cut.input_grad(args) if cut.cut else (self.pullback(p_layer, saved, g_y, *docs, **kind)[1], [g_y])

    def stash_like(self, p_layer, saved, g_like, *docs, **kind):
        """The shapes of `input_grad`'s stash (`p_layer` and `saved` may be shapes)."""
        return jax.eval_shape(lambda p, r: self.input_grad(p, r, g_like, *docs, **kind)[1], p_layer, saved)

    def weight_grad(self, p_layer, saved, stash, g_like, *docs, **kind):
        """Its W: d p_layer from the residuals and the stash `input_grad` kept; `g_like`: an array
        shaped as the output cotangent (read for its shape only)."""
        cut, args = self._split(p_layer, saved, g_like, docs, kind)
        if cut.cut:
            return cut.weight_grad(args, stash)
        assert len(stash) == 1 and stash[0].shape == g_like.shape, "B's and W's cuts differ"
        return self.pullback(p_layer, saved, stash[0], *docs, **kind)[0]


# Dynamic slices, not gathers: XLA partitions them inside the manual region.
def take(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def put(x, value, i):
    return jax.lax.dynamic_update_index_in_dim(x, value, i, 0)


def read(buffer, m, v, slots: int):
    """Microbatch m's entry for chunk v of a ring buffer [slots (+ 1), V, ...] (a pytree of them)."""
    return jax.tree.map(lambda b: take(take(b, m % slots), v), buffer)


def write(buffer, value, m, v, slots: int):
    return jax.tree.map(lambda b, x: put(b, put(take(b, m % slots), x.astype(b.dtype), v), m % slots),
                        buffer, value)


# The ring buffers [slots + 1, V, ...] of a stage's carry, and the table entry that sizes each:
# the actions read them inside their conditionals and write them after (`store`).
RINGS = ("inputs", "cotangents", "residuals", "deferred")
SLOTS = {"inputs": "input_slots", "cotangents": "cotangent_slots", "residuals": "residual_slots",
         "deferred": "deferred_slots"}


def store(buffer, value, m, v, slots: int, taken):
    """`write` microbatch m's entry for chunk v where `taken`, and otherwise into the spare slot (index
    `slots`, which no read reaches): a write outside the conditional of the action that made `value`.
    Inside it, XLA copies the whole buffer in the branch that does not write (XLA:GPU: copy insertion
    at a conditional's pass-through outputs)."""
    return write(buffer, value, jnp.where(taken, m % slots, slots), v, slots + 1)


def stage_kinds(model, stages: int, virtual: int, placement: str = "circular"):
    """The layers' kinds [stages, virtual, layers per chunk] as the stages store them (`layer_order`),
    or None when the model's layers are alike."""
    kinds = model.layer_kinds
    return None if kinds is None else kinds[layer_order(len(kinds), stages, virtual, placement)].reshape(
        stages, virtual, -1)


def rings(c) -> dict:
    """The carry's RINGS."""
    return {k: c[k] for k in RINGS if k in c}


def without_rings(c, update):
    """`update` (a conditional: carry -> carry, or (carry, ...)) of the carry less the RINGS, which
    it reads but does not return: XLA copies a buffer a conditional returns whole in the branch
    that leaves it as it is."""
    rings_of = rings(c)
    out = update({k: x for k, x in c.items() if k not in rings_of})
    return ({**out[0], **rings_of}, *out[1:]) if isinstance(out, tuple) else {**out, **rings_of}


def whole(tree):
    """`tree` whole over the compiler-managed axes (inside the shard_map: all but the manual ones).
    Under LoRA the adapters and their gradient sums are whole over fsdp x tensor inside the ticks:
    gathered once before them, each microbatch's gradient all-reduced within its stage, the sums cut
    back to the adapters' layout after them (the adapters are a small share). Left split, XLA
    reshards a factor with a free axis (A [embed: fsdp, rank] has no tensor), and its gradient,
    inside a stage's cond by a collective-permute swapping fsdp and tensor blocks, whose pairs name
    every pipeline stage's devices: the stages, entering their conds at different ticks, wait for
    each other for ever (XLA:CPU: "Expected 8 threads to join the rendezvous")."""
    return jax.tree.map(lambda a: constrain(a, (None,) * a.ndim), tree)


def has_frozen(blocks, keep) -> bool:
    """Whether some of `blocks` is frozen (LoRA's base)."""
    return len(jax.tree.leaves(select(blocks, keep, ("blocks",)))) < len(jax.tree.leaves(blocks))


def zeros(like, *lead):
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), like)


def kind_kwarg(k) -> dict:
    """A layer's `kind=` keyword (models/base.py `scan_blocks`), none when the layers are alike."""
    return {} if k is None else {"kind": k}
