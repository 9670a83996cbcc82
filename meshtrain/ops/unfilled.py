"""A buffer XLA allocates and does not fill, for an op that writes every part of it that is read
unmasked: the ragged all-to-all's worst-case receive blocks (meshtrain/ops/block_exchange.py).

On GPUs it is XLA's `AllocateBuffer` custom call, which launches no kernel (`jax.lax.empty`'s too).
`jax.lax.empty` takes no operand, so JAX's partial evaluation (remat's, the layers' scan's) computes
it once, outside the loop that uses it, and passes it in; a ragged all-to-all, which writes its
receive buffer in place, then copies it first on every iteration (Qwen3-30B-A3B's receive blocks on
expert=8: bf16[1048576, 2048], 4.3 GB a copy). `unfilled` takes the array its use follows from
(`after`: the rows to exchange), which keeps it in the loop: one allocation per use. (Marked
side-effecting it would be safe from XLA's loop-invariant motion too, but XLA's SPMD partitioner
refuses a side-effecting op it must replicate, as in a pipeline stage's program.) Elsewhere (XLA:CPU
has no such call): zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching, mlir

unfilled_p = Primitive("unfilled")


def unfilled(shape, dtype, after):
    """An array of `shape` and `dtype` whose values are unspecified on NVIDIA GPUs (zeros elsewhere),
    made where `after` is (its values are not read; no gradient flows to it)."""
    return unfilled_p.bind(jax.lax.stop_gradient(after), shape=tuple(shape), dtype=jnp.dtype(dtype))


def _allocate(ctx, after, *, shape, dtype):
    del ctx, after
    kind = mlir.ir.RankedTensorType.get(list(shape), mlir.dtype_to_ir_type(dtype))
    call = stablehlo.CustomCallOp([kind], [], call_target_name=mlir.ir.StringAttr.get("AllocateBuffer"),
                                  has_side_effect=mlir.ir.BoolAttr.get(False))
    return call.results


def _zeros(after, *, shape, dtype):
    del after
    return jnp.zeros(shape, dtype)


def _batched(args, dims, *, shape, dtype):
    del dims  # one buffer serves every batch element: its values are unspecified either way
    return unfilled_p.bind(*args, shape=shape, dtype=dtype), None  # None: not mapped


unfilled_p.def_impl(_zeros)
unfilled_p.def_abstract_eval(lambda after, *, shape, dtype: jax.core.ShapedArray(shape, dtype))
mlir.register_lowering(unfilled_p, _allocate, platform="cuda")
mlir.register_lowering(unfilled_p, mlir.lower_fun(_zeros, multiple_results=False))
batching.primitive_batchers[unfilled_p] = _batched
