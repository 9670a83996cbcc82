"""Which parameters a step trains, as trees: `ModelSpec.trainable(path)` decides (models/spec.py;
with LoRA only the adapters), and these split the parameter trees by it. The step differentiates
the trainable part only, the optimizer's state and the gradients' layouts and reductions cover it
only, and `freeze` cuts the frozen part out of a function that is differentiated whole (the
pipeline's per-layer vjps), so no frozen weight gradient is ever computed. With every parameter
trainable, `select` returns the tree as it is."""
from __future__ import annotations

import jax


def select(tree: dict, keep, path: tuple = ()) -> dict:
    """The nested dicts of `tree` (at `path` in the parameters) holding only the leaves whose key
    path `keep` accepts (a leaf is
    anything but a dict: an array, a PartitionSpec, a logical-axes tuple); emptied dicts dropped."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub = select(value, keep, (*path, key))
            if sub:
                out[key] = sub
        elif keep((*path, key)):
            out[key] = value
    return out


def merge(tree: dict, part: dict) -> dict:
    """`tree` with the leaves of `part` (a `select` of it, or the part it lacks) put in their places."""
    out = dict(tree)
    for key, value in part.items():
        out[key] = merge(tree[key], value) if isinstance(value, dict) and key in tree else value
    return out


def freeze(tree: dict, keep, path: tuple = ()) -> dict:
    """`tree` (at `path` in the parameters) with a stop_gradient on every leaf `keep` rejects: its
    cotangent is a symbolic zero, so no matmul computes it."""
    return merge(jax.tree.map(jax.lax.stop_gradient, tree), select(tree, keep, path))
