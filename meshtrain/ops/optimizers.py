"""Optimizers by name (`optim.optimizer`) and learning-rate schedules by name (`optim.schedule`).

Each optimizer is an optax transformation built from the config, the schedule and the parameters'
logical axes (models name every dimension): the axes say which parameters are matrices and which
of their dimensions are the matrix's rows and columns. The stacked blocks carry a leading `layers`
or `outer_layers` axis (and MoE experts an `experts` axis): those are batch axes, so every layer's (and expert's)
matrix is treated on its own, never the stack as one matrix.

The registry also states each optimizer's state bytes for a parameter of a given shape and axes,
which the planner's ZeRO formula sums (formulas.zero_bytes), and `map_param_states` walks any
optimizer state's parameter-shaped parts, which the ZeRO shardings (sharding.py) and the layer
reordering of a resume (trainer.py) use.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from meshtrain.parallel.sharding import LAYER_AXES

BATCH_AXES = (*LAYER_AXES, "experts")  # a stack of matrices, each treated on its own
FP32 = 4


# ---- which parameters are matrices, by their logical axes ----
def matrix_dims(names: tuple) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(row dims, column dims) of the matrix a parameter holds per layer and expert, or None for a
    vector (a norm's scale). The `embed` dimension is one side and the other dimensions are the
    other, in the order they appear: wq (layers, embed, heads, head_dim) is an embed x (heads
    head_dim) matrix, wo (layers, heads, head_dim, embed) a (heads head_dim) x embed one."""
    dims = [i for i, n in enumerate(names) if n not in BATCH_AXES]
    if len(dims) < 2:
        return None
    embed = tuple(i for i in dims if names[i] == "embed")
    other = tuple(i for i in dims if names[i] != "embed")
    if not embed or not other:
        return tuple(dims[:1]), tuple(dims[1:])
    return (embed, other) if embed[0] < other[0] else (other, embed)


def decays(names: tuple) -> bool:
    """Decoupled weight decay applies to matrices (two or more axes besides a layers axis), not to norms."""
    return len([n for n in names if n not in LAYER_AXES]) >= 2


def is_hidden_matrix(names: tuple) -> bool:
    """A matrix of the stacked blocks between named hidden dimensions: what Muon orthogonalises.
    Not the embedding or output head (no layers axis), nor the MoE router, whose expert-logit
    dimension has no logical name (nothing shards it): AdamW updates those (Jordan et al. 2024)."""
    rows_cols = matrix_dims(names)
    return (any(n in LAYER_AXES for n in names) and rows_cols is not None
            and all(names[i] is not None for side in rows_cols for i in side))


def _tree_of(fn, logical_axes):
    return jax.tree.map(fn, logical_axes, is_leaf=lambda n: isinstance(n, tuple))


def _size(shape, dims) -> int:
    return math.prod(shape[i] for i in dims)


# ---- Adafactor with factored second moments per matrix (Shazeer & Stern 2018) ----
class FactoredState(NamedTuple):
    """Second-moment statistics shaped like each parameter with the reduced dimensions kept as 1,
    so they shard like it: `v_row` (columns reduced) and `v_col` (rows reduced) for a matrix, `v`
    for a vector; a MaskedNode in the slots a parameter does not use."""
    count: jax.Array
    v_row: optax.Params
    v_col: optax.Params
    v: optax.Params


def scale_by_factored_rms(logical_axes, decay_rate: float = 0.8, eps: float = 1e-30,
                          clipping_threshold: float = 1.0) -> optax.GradientTransformation:
    """Adafactor's preconditioner (Shazeer & Stern 2018, Alg. 4 without parameter scaling):
    beta2_t = 1 - t^-0.8; a matrix keeps the row and column means of g^2 + eps (R, C) and
    V = R C / mean(R); a vector keeps V whole; the update g / sqrt(V) is clipped to RMS <= d = 1.
    Means and RMS are over each layer's (and expert's) matrix alone. Like optax.adafactor with
    multiply_by_parameter_scale=False (the learning rate is absolute, as AdamW's is), except that
    the factored dimensions come from the logical axes: optax's factor the two largest dimensions
    of the stacked tensor (which may be `layers`) and clip by the RMS of the whole stack."""
    masked = optax.MaskedNode()
    is_names = lambda n: isinstance(n, tuple)
    names, treedef = jax.tree.flatten(logical_axes, is_leaf=is_names)
    layout = [matrix_dims(n) for n in names]  # (rows, cols), or None for a vector
    own = [tuple(i for i, a in enumerate(n) if a not in BATCH_AXES) for n in names]  # each matrix's/vector's dims

    def reduced(x, dims):
        return jnp.zeros([1 if i in dims else n for i, n in enumerate(x.shape)], jnp.float32)

    def init_fn(params):
        leaves = treedef.flatten_up_to(params)
        per = lambda fn: treedef.unflatten([fn(rc, p) for rc, p in zip(layout, leaves)])
        return FactoredState(
            count=jnp.zeros([], jnp.int32),
            v_row=per(lambda rc, p: masked if rc is None else reduced(p, rc[1])),
            v_col=per(lambda rc, p: masked if rc is None else reduced(p, rc[0])),
            v=per(lambda rc, p: jnp.zeros(p.shape, jnp.float32) if rc is None else masked))

    def one(rc, dims, g, v_row, v_col, v, beta2):
        ema = lambda old, new: beta2 * old + (1.0 - beta2) * new
        g2 = g * g + eps
        if rc is None:
            v = ema(v, g2)
            y = g * jax.lax.rsqrt(v)
        else:
            rows, cols = rc
            v_row = ema(v_row, jnp.mean(g2, axis=cols, keepdims=True))
            v_col = ema(v_col, jnp.mean(g2, axis=rows, keepdims=True))
            y = g * jax.lax.rsqrt(v_row / jnp.mean(v_row, axis=rows, keepdims=True)) * jax.lax.rsqrt(v_col)
        rms = jnp.sqrt(jnp.mean(y * y, axis=dims, keepdims=True))
        return y / jnp.maximum(1.0, rms / clipping_threshold), v_row, v_col, v

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        beta2 = 1.0 - count.astype(jnp.float32) ** -decay_rate
        flat = [treedef.flatten_up_to(t) for t in (updates, state.v_row, state.v_col, state.v)]
        out = [one(rc, dims, *leaves, beta2) for rc, dims, *leaves in zip(layout, own, *flat)]
        new = [treedef.unflatten(list(column)) for column in zip(*out)]
        return new[0], FactoredState(count, *new[1:])

    return optax.GradientTransformation(init_fn, update_fn)


# ---- the optimizers: (ocfg, schedule, logical_axes) -> the transformation after clipping ----
def adamw(ocfg, schedule, logical_axes):
    """AdamW (Loshchilov & Hutter 2019), decoupled weight decay only on matrices (not norms)."""
    return optax.adamw(schedule, b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps, weight_decay=ocfg.weight_decay,
                       mask=_tree_of(decays, logical_axes))


def lion(ocfg, schedule, logical_axes):
    """Lion (Chen et al. 2023): the sign of b1 m + (1 - b1) g, momentum m = b2 m + (1 - b2) g;
    decoupled weight decay on matrices."""
    return optax.lion(schedule, b1=ocfg.b1, b2=ocfg.b2, weight_decay=ocfg.weight_decay,
                      mask=_tree_of(decays, logical_axes))


def adafactor(ocfg, schedule, logical_axes):
    """Adafactor (Shazeer & Stern 2018): `scale_by_factored_rms`, then the learning rate and
    decoupled weight decay on matrices, as optax.adafactor chains them."""
    return optax.chain(scale_by_factored_rms(logical_axes),
                       optax.add_decayed_weights(ocfg.weight_decay, _tree_of(decays, logical_axes)),
                       optax.scale_by_learning_rate(schedule))


def muon(ocfg, schedule, logical_axes):
    """Muon (Jordan et al. 2024) on the blocks' hidden matrices (`is_hidden_matrix`): Nesterov
    momentum, orthogonalised by `muon_ns_steps` Newton-Schulz iterations per layer and expert (the
    `layers` and `experts` axes are batch axes of optax's MuonDimensionNumbers), scaled to RMS
    0.2 sqrt(max(rows, cols)) so that AdamW's learning rate and weight decay apply unchanged
    (Liu et al. 2025, "Muon is scalable"); AdamW (`adamw`) on every other parameter."""
    hidden = _tree_of(is_hidden_matrix, logical_axes)
    labels = jax.tree.map(lambda h: "muon" if h else "adamw", hidden)
    dims = _tree_of(lambda n: (MuonDimensionNumbers(*matrix_dims(n)) if is_hidden_matrix(n)
                               else optax.MaskedNode()), logical_axes)
    matrices = optax.chain(
        scale_by_muon(ns_steps=ocfg.muon_ns_steps, beta=ocfg.muon_momentum, weight_dimension_numbers=dims),
        optax.stateless(lambda updates, _: jax.tree.map(_match_adamw_rms, updates, dims)),
        optax.add_decayed_weights(ocfg.weight_decay),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": matrices, "adamw": adamw(ocfg, schedule, logical_axes)}, labels)


def _match_adamw_rms(update, dims: MuonDimensionNumbers):
    """An orthogonalised update times 0.2 sqrt(max(rows, cols)): the RMS of AdamW's updates (Liu
    et al. 2025, eq. 4; optax's scale_by_shape with consistent_rms=0.2, which optax.contrib does not
    export)."""
    side = lambda axes: math.prod(update.shape[i] for i in axes)
    return update * (0.2 * math.sqrt(max(side(dims.reduction_axis), side(dims.output_axis))))


@dataclass(frozen=True)
class Optimizer:
    build: Callable  # (ocfg, schedule, logical_axes) -> optax.GradientTransformation
    state_bytes: Callable[[tuple, tuple], int]  # (shape, logical axes) -> its state's bytes (fp32)
    help: str


def _factored_bytes(shape, names) -> int:
    rc = matrix_dims(names)
    if rc is None:
        return FP32 * math.prod(shape)
    batch = math.prod(shape) // (_size(shape, rc[0]) * _size(shape, rc[1]))
    return FP32 * batch * (_size(shape, rc[0]) + _size(shape, rc[1]))


OPTIMIZERS = {
    "adamw": Optimizer(adamw, lambda shape, names: 2 * FP32 * math.prod(shape),
                       "Adam with decoupled weight decay (b1, b2, eps, weight_decay)"),
    "adafactor": Optimizer(adafactor, _factored_bytes,
                           "factored second moments per matrix, no momentum, updates clipped to RMS 1 "
                           "(weight_decay)"),
    "lion": Optimizer(lion, lambda shape, names: FP32 * math.prod(shape),
                      "the sign of interpolated momentum (b1, b2, weight_decay; the paper takes b2=0.99 "
                      "and a 3-10x smaller lr)"),
    "muon": Optimizer(muon, lambda shape, names: (1 if is_hidden_matrix(names) else 2) * FP32 * math.prod(shape),
                      "Newton-Schulz orthogonalised momentum on the blocks' matrices (muon_momentum, "
                      "muon_ns_steps), adamw on the rest"),
}


def describe(registry) -> str:
    """'name (help), ...' for a setting's help text."""
    return "; ".join(f"{name}: {entry.help}" for name, entry in registry.items())


def map_param_states(fn, opt_state, params, *rest, otherwise=lambda x: x):
    """fn(state leaf, parameter, *rest leaves) over each parameter-shaped part of an optimizer
    state (a subtree of the parameters' structure: moments, factored statistics; MaskedNode where a
    partition or mask leaves a parameter out, kept as it is); otherwise(leaf) for the other leaves
    (counts, Newton-Schulz coefficients). Unlike optax.tree_map_params it needs no `init` on a
    placeholder, which optimizers built from the parameters' axes cannot run."""
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    target = jax.tree.structure(params)

    def walk(node):
        if jax.tree.structure(node, is_leaf=is_masked) == target:
            return jax.tree.map(lambda s, *args: s if is_masked(s) else fn(s, *args), node, params, *rest,
                                is_leaf=is_masked)
        children, treedef = jax.tree.flatten(node, is_leaf=lambda x: x is not node)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
            return otherwise(node)
        return treedef.unflatten([walk(c) for c in children])

    return walk(opt_state)


# ---- learning-rate schedules: (ocfg, horizon) -> optax schedule ----
def _warmup(ocfg, total_steps: int) -> int:
    return min(ocfg.warmup_steps, max(total_steps - 1, 0))


def _then(ocfg, total_steps: int, *phases):
    """Linear warmup from 0 to `lr`, then `phases`: (steps, schedule) each; the last runs on."""
    warmup = _warmup(ocfg, total_steps)
    schedules, boundaries, at = [optax.linear_schedule(0.0, ocfg.lr, warmup)], [], warmup
    for steps, schedule in phases:
        schedules.append(schedule)
        boundaries.append(at)
        at += steps
    return optax.join_schedules(schedules, boundaries)


def cosine(ocfg, total_steps: int):
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    warmup = _warmup(ocfg, total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, ocfg.lr, warmup, max(total_steps, warmup + 1),
                                              end_value=ocfg.lr * ocfg.min_lr_ratio)


def linear(ocfg, total_steps: int):
    """Linear warmup to `lr`, then linear decay to `lr * min_lr_ratio` at the last step."""
    decay = max(total_steps - _warmup(ocfg, total_steps), 1)
    return _then(ocfg, total_steps, (decay, optax.linear_schedule(ocfg.lr, ocfg.lr * ocfg.min_lr_ratio, decay)))


def wsd(ocfg, total_steps: int):
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hagele et al. 2024): linear warmup, `lr`
    constant, then a linear decay to `lr * min_lr_ratio` over the last `decay_fraction` of the
    horizon (at least one step)."""
    warmup = _warmup(ocfg, total_steps)
    decay = min(max(round(ocfg.decay_fraction * total_steps), 1), max(total_steps - warmup, 1))
    stable = max(total_steps - warmup - decay, 0)
    return _then(ocfg, total_steps, (stable, optax.constant_schedule(ocfg.lr)),
                 (decay, optax.linear_schedule(ocfg.lr, ocfg.lr * ocfg.min_lr_ratio, decay)))


def constant(ocfg, total_steps: int):
    """Linear warmup to `lr`, then `lr`."""
    return _then(ocfg, total_steps, (1, optax.constant_schedule(ocfg.lr)))


LR_SCHEDULES = {"cosine": cosine, "linear": linear, "wsd": wsd, "constant": constant}
