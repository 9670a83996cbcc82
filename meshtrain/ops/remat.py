"""Activation rematerialisation, applied to a model's block from outside (`parallel.remat`).

A model names the activations worth keeping with `checkpoint_name` and lists them (`saveable`);
the policy decides what the backward finds saved and what it recomputes:
- `none`: keep every residual (fastest, most memory);
- `full`: keep only the block's input and rerun its forward in the backward (Chen et al. 2016);
- `save_matmuls`: keep the model's named matmul outputs, recompute the cheap elementwise rest;
- `offload`: the same names, moved to host memory (GPU/TPU).
"""
from __future__ import annotations

import functools

import jax

from meshtrain.ops.recipes import in_bf16

POLICIES = ("none", "full", "save_matmuls", "offload")


def policy(name: str, saveable: tuple[str, ...]):
    """The jax.checkpoint policy for `name` (None: no remat)."""
    cp = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "save_matmuls":
        return cp.save_only_these_names(*saveable)
    return cp.save_and_offload_only_these_names(names_which_can_be_saved=[],
                                                names_which_can_be_offloaded=list(saveable),
                                                offload_src="device", offload_dst="pinned_host")


def apply(block, name: str, saveable: tuple[str, ...]):
    """`block` wrapped in jax.checkpoint under the policy, or `block` itself for `none`. One checkpoint for
    the layers a recipe runs and one for those it leaves in bf16 (parallel.bf16_layers, traced inside
    `recipes.bf16_projections`): jax.checkpoint reuses a trace by function and shapes, which would give a
    kept layer the recipe's einsums."""
    chosen = policy(name, saveable)
    if chosen is None:
        return block
    each = {kept: jax.checkpoint(functools.partial(block), policy=chosen, prevent_cse=False) for kept in (False, True)}
    return lambda *args, **kwargs: each[in_bf16()](*args, **kwargs)
