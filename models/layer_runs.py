"""Layers kept in bf16 under a low-precision recipe (`parallel.bf16_layers`, meshtrain/ops/recipes.py): which
of the stacked blocks they are, and the layer scan cut into runs of consecutive layers alike, one scan each,
those kept in bf16 traced inside `recipes.bf16_projections` (their projections and MLP run jnp.einsum). Each
run compiles its own block, without a conditional: the layers of a run take no branch.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.ops.recipes import bf16_projections

# Block statistics kept per layer ([layers, ...], storage order) rather than summed over layers: each
# expert's share of a routed layer's assignments, which the router bias update reads (models/routed.py).
PER_LAYER_STATS = ("expert_load",)


def bf16_blocks(spec, layers) -> np.ndarray | None:
    """Per stacked block (storage order, outside a pipeline the model's), whether it is one of `layers`
    (model-order indices, negative from the last; `ModelSpec` `spec`); None where none is. The blocks
    follow a family's first layers run apart (deepseek_v3's dense ones), which `layers` must not name."""
    if not layers:
        return None
    first = spec.num_layers - spec.stacked_layers()  # the layers `embed` runs before the blocks
    kept = np.zeros(spec.stacked_layers(), bool)
    for i in layers:
        kept[i % spec.num_layers - first] = True
    return kept


def check(spec, layers) -> str | None:
    """Why `layers` (parallel.bf16_layers) names no stacked layer of `spec` each, or None."""
    n, first = spec.num_layers, spec.num_layers - spec.stacked_layers()
    if not isinstance(layers, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        return f"parallel.bf16_layers={layers!r} is not a list of layer indices; write e.g. [-2, -1] (the last two)"
    outside = [i for i in layers if not -n <= i < n]
    if outside:
        return (f"parallel.bf16_layers={list(layers)}: {outside} outside the model's {n} layers; use indices from "
                f"{-n} to {n - 1} (-1 the last)")
    apart = [i for i in layers if i % n < first]
    if apart:
        return (f"parallel.bf16_layers={list(layers)}: layer(s) {apart} are among the first {first} this family runs "
                f"apart from its stacked blocks (always bf16 here is not built); name layers from {first} on")
    return None


def recipe_share(kept: np.ndarray | None) -> float:
    """The share of the stacked blocks a recipe runs (1 where none is kept in bf16): the planner scales the
    blocks' recipe matmuls (FLOPs at its peak, quantized FSDP gathers) by it."""
    return 1.0 if kept is None else 1.0 - float(kept.mean())


def runs(kept: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, stop, in bf16) of each run of consecutive blocks alike."""
    cuts = [0, *(np.flatnonzero(kept[1:] != kept[:-1]) + 1).tolist(), len(kept)]
    return [(a, b, bool(kept[a])) for a, b in zip(cuts[:-1], cuts[1:])]


def scan_runs(scan, layer, blocks, x_BxLxD, *docs, kinds=None, noise=None, kept=None):
    """`scan` (models/base.py `scan_blocks`, whose arguments these are) over each run of `kept` (per block:
    in bf16), in order: the output and the statistics as one scan gives them (summed over the layers,
    PER_LAYER_STATS stacked)."""
    parts = []
    for a, b, in_bf16 in runs(kept):
        cut = lambda tree, a=a, b=b: jax.tree.map(lambda v: v[a:b], tree)
        with bf16_projections() if in_bf16 else contextlib.nullcontext():
            x_BxLxD, stats = scan(layer, cut(blocks), x_BxLxD, *docs, kinds=None if kinds is None else kinds[a:b],
                                  noise=None if noise is None else cut(noise))
        parts.append(stats)
    join = lambda k, *vs: jnp.concatenate(vs) if k in PER_LAYER_STATS else sum(vs[1:], vs[0])
    return x_BxLxD, {k: jax.tree.map(lambda *vs, k=k: join(k, *vs), *[p[k] for p in parts]) for k in parts[0]}
