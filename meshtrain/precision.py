"""Dtype policies. Master parameters and optimizer state are always fp32.

fp32: compute in fp32.  bf16: parameters are cast to bf16 at the start of the step, matmuls and
activations run in bf16, while RMSNorm, softmax, logits and the loss stay in fp32 (the model does
those upcasts). bf16 has fp32's exponent range, so no loss scaling is needed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def cast_for_compute(params, precision: str):
    dtype = COMPUTE_DTYPES[precision]
    if dtype == jnp.float32:
        return params
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
