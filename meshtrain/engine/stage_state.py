"""What a pipeline stage (meshtrain/engine/pipeline.py) keeps between ticks: each layer's backward
as data (`LayerResiduals`: the residuals `jax.vjp` holds, kept apart from the parameters) and ring
buffers [slots, chunks, ...] indexed by (microbatch, chunk), read and written by dynamic slices."""
from __future__ import annotations

import jax
import jax.numpy as jnp


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
        _, _, structure, is_param = self._vjp(p_layer, jnp.zeros(g_y.shape, g_y.dtype), *docs, **kind)
        params, saved = jax.tree.leaves(p_layer), iter(saved)
        vjp = jax.tree.unflatten(structure, [params[i] if i is not None else next(saved) for i in is_param])
        return vjp((g_y, self.g_stats))


# Dynamic slices, not gathers: XLA partitions them inside the manual region.
def take(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def put(x, value, i):
    return jax.lax.dynamic_update_index_in_dim(x, value, i, 0)


def read(buffer, m, v, slots: int):
    """Microbatch m's entry for chunk v of a ring buffer [slots, V, ...] (a pytree of them)."""
    return jax.tree.map(lambda b: take(take(b, m % slots), v), buffer)


def write(buffer, value, m, v, slots: int):
    return jax.tree.map(lambda b, x: put(b, put(take(b, m % slots), x.astype(b.dtype), v), m % slots),
                        buffer, value)


def zeros(like, *lead):
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), like)


def kind_kwarg(k) -> dict:
    """A layer's `kind=` keyword (models/base.py `scan_blocks`), none when the layers are alike."""
    return {} if k is None else {"kind": k}
