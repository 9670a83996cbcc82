"""Dtype policies and dynamic loss scaling. Master parameters and optimizer state are always fp32.

fp32: compute in fp32.  bf16 / fp16 / the low-precision recipes: parameters are cast to the compute dtype at
the start of the step, matmuls and activations run in it, while RMSNorm, softmax, logits and the loss stay
in fp32 (the model does those upcasts). bf16 has fp32's exponent range and needs no loss scaling. The
recipes (meshtrain/ops/recipes.py: fp8 per tensor, fp8_rowwise per row, mxfp8 and nvfp4 per block) are
bf16 whose transformer projections and MLP run as low-precision matmuls: no loss scaling either, each
scale maps its own amax onto its format's range.

fp16 (largest finite 65504, smallest normal 6.1e-5) needs it: small gradients underflow to zero
in the backward unless the loss is multiplied by a scale S first. The step differentiates S x
objective, divides the fp32 gradients by S before clipping, and adjusts S dynamically (Micikevicius
et al. 2018; Megatron-LM, DeepSpeed):
    an overflow (a finite loss, a NaN/Inf gradient, S above loss_scale_min): the update is skipped,
        S <- max(S / 2, loss_scale_min), the run of good steps restarts;
    loss_scale_window good steps in a row: S <- 2 S.
An overflow is the scale's business, not a bad step for the NaN/Inf guard; a NaN/Inf loss, or a
NaN/Inf gradient at loss_scale_min, is one. The state {scale, good_steps, overflows} is part of the
train state under every precision (S stays at loss_scale_initial outside fp16), so a checkpoint
resumes with its scale bitwise and may change precision on resume.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.ops.offload import on_host
from meshtrain.ops.recipes import RECIPES, is_low_precision

# a recipe computes as bf16 but for the transformer's projection and MLP matmuls (meshtrain/ops/recipes.py).
COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16,
                  **{recipe: jnp.bfloat16 for recipe in RECIPES}}


def compute_bytes(precision: str) -> int:
    """Bytes per activation (and compute-dtype parameter copy): 2 under bf16, fp16 and the recipes (whose
    matmul inputs may be saved at 1: `saved_matmul_bytes`), 4 under fp32."""
    return jnp.dtype(COMPUTE_DTYPES[precision]).itemsize


def saved_matmul_bytes(precision: str) -> int:
    """Bytes per element of what only a matmul's backward reads (its saved input): its fp8 recipe's
    (meshtrain/ops/recipes.py: 1 for fp8's fp8 copy, 2 for the others' bf16), else `compute_bytes`."""
    return RECIPES[precision].saved_bytes if is_low_precision(precision) else compute_bytes(precision)


def cast_for_compute(params, precision: str):
    """The floating parameters in the compute dtype; one in host memory (parallel.offload=optimizer+params'
    stacked layers) is left there, cast where its block fetches it (meshtrain/ops/offload.py)."""
    dtype = COMPUTE_DTYPES[precision]
    if dtype == jnp.float32:
        return params
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) and not on_host(p) else p,
                        params)


def scales_loss(plan) -> bool:
    return plan.precision == "fp16"


def initial_loss_scale(plan) -> dict:
    return {"scale": jnp.asarray(plan.loss_scale_initial, jnp.float32), "good_steps": jnp.zeros((), jnp.int32),
            "overflows": jnp.zeros((), jnp.int32)}


def update_loss_scale(plan, state: dict, loss_finite, grads_finite):
    """(new loss-scale state, overflow, bad): `overflow` skips the update and halves the scale; `bad`
    is a NaN/Inf step for the guard. Outside fp16 nothing changes and only nonfinite steps are bad."""
    if not scales_loss(plan):
        return state, jnp.zeros((), bool), ~(loss_finite & grads_finite)
    scale, good = state["scale"], state["good_steps"]
    overflow = loss_finite & ~grads_finite & (scale > plan.loss_scale_min)
    applied = loss_finite & grads_finite
    good = jnp.where(applied, good + 1, 0)
    grow = good >= plan.loss_scale_window
    new_scale = jnp.where(overflow, jnp.maximum(scale / 2, plan.loss_scale_min), jnp.where(grow, scale * 2, scale))
    new_state = {"scale": new_scale.astype(jnp.float32), "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
                 "overflows": state["overflows"] + overflow.astype(jnp.int32)}
    return new_state, overflow, ~(applied | overflow)
