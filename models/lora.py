"""LoRA (Hu et al. 2021; models/spec.py `LoraSpec`): the adapters' shapes, logical axes and
initialization on any weight, merging them into their base, and LoRA dropout's keys and masks.

An adapter on a weight W factors it as its stacking axes (layers, experts: one adapter each), the
axes its matmul contracts (A's input) and the rest (B's output): y = x W + (alpha / rank) (x A) B.
The blocks that own the weights run the adapters (models/base.py `Block.adapted`, models/experts.py
`projection`); this module owns their math.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.models.axes import STACKED_AXES, contracted_axes
from meshtrain.models.spec import LORA_TARGETS

# LoRA (models/spec.py LoraSpec): each target's base weight and the einsums of x A and (x A) B.
LORA = {"q": ("wq", "bld,dr->blr", "blr,rhk->blhk"), "k": ("wk", "bld,dr->blr", "blr,rgk->blgk"),
        "v": ("wv", "bld,dr->blr", "blr,rgk->blgk"), "o": ("wo", "blhk,hkr->blr", "blr,rd->bld"),
        "gate": ("w_gate", "bld,dr->blr", "blr,rf->blf"), "up": ("w_up", "bld,dr->blr", "blr,rf->blf"),
        "down": ("w_down", "blf,fr->blr", "blr,rd->bld")}


def lora_parts(base: tuple) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The indices of a weight's axes (logical `base`) as an adapter factors it: the stacking ones
    before those it contracts (experts: one adapter each), the contracted ones (x A) and the rest
    ((x A) B gives them)."""
    into = contracted_axes(base)
    stacked = tuple(i for i in range(into[0]) if base[i] in STACKED_AXES)
    return stacked, into, tuple(i for i in range(len(base)) if i not in stacked + into)


def lora_axes(base: tuple) -> tuple[tuple, tuple]:
    """The logical axes of an adapter's A and B on a weight of axes `base`: both keep its stacking
    axes (a routed expert's adapter is that expert's), A takes its input (contracted) axes, B its
    output axes; the rank ("lora_rank") is sharded as `embed` is where the factor has no `embed` axis
    (meshtrain/parallel/sharding.py DEFAULT_RULES)."""
    stacked, into, out = (tuple(base[i] for i in part) for part in lora_parts(base))
    return (*stacked, *into, "lora_rank"), (*stacked, "lora_rank", *out)


def adapter_axes(adapted: dict[str, tuple]) -> dict[str, tuple]:
    """The logical axes of the adapters `lora_<name>_a` and `_b` of each `name: its base weight's axes`."""
    return {f"lora_{name}_{part}": axes for name, base in adapted.items() for part, axes in zip("ab", lora_axes(base))}


def init_adapter(key, shape: tuple, base: tuple, rank: int, weight: str):
    """An adapter's (A, B) in fp32 on the weight `weight` of `shape` and logical axes `base`: A as
    PEFT's default (kaiming_uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))), B zero, so
    the adapted model starts as its base. A rank above the weight's own is refused: A B has rank at
    most min(in, out), so the rest would train nothing, at more cost than the weight itself."""
    stacked, into, out = ([shape[i] for i in part] for part in lora_parts(base))
    fan_in, fan_out = math.prod(into), math.prod(out)
    if rank > min(fan_in, fan_out):
        raise UserError(f"model.lora.rank={rank} is above the rank of the {weight} weight it adapts ({fan_in} x "
                        f"{fan_out}, rank at most {min(fan_in, fan_out)}): the extra rank trains nothing and costs "
                        f"more than training {weight} itself; set model.lora.rank to at most "
                        f"{min(fan_in, fan_out)}, or leave that projection out of model.lora.targets")
    bound = 1.0 / np.sqrt(np.prod(into))
    a = jax.random.uniform(key, (*stacked, *into, rank), jnp.float32, -bound, bound)
    return a, jnp.zeros((*stacked, rank, *out), jnp.float32)


def adapters_off(params):
    """The same parameters with every LoRA B at zero: the model's output is then exactly the base's
    (x A 0 adds 0), on every layout and executor; DPO's reference model with LoRA."""
    zero_b = lambda path, x: jnp.zeros_like(x) if (path[-1].key.startswith("lora_") and
                                                    path[-1].key.endswith("_b")) else x
    return jax.tree_util.tree_map_with_path(zero_b, params)


def adapted_weight(adapter: str) -> str:
    """The base weight of the adapter `lora_<name>` (its `_a` and `_b`): a LORA target's, or a routed
    expert projection's, `lora_expert_gate` on `expert_gate` (models/experts.py)."""
    name = adapter.removeprefix("lora_")
    return name if name.startswith("expert_") else LORA[name][0]


def merge_adapters(params, lora) -> dict:
    """The base parameters with each adapter folded in, W + (alpha / rank) A B (the merged weights
    PEFT's merge_and_unload gives), and no adapters: the same function as the adapted model. A
    [stack, in, r] and B [stack, r, out] on W [stack, in, out] (stack: layers, and experts for a
    routed expert's), each group of axes flattened: s stacking axes make A.ndim + B.ndim = W.ndim + s + 2."""
    blocks = {k: v for k, v in params["blocks"].items() if not k.startswith("lora_")}
    for adapter in sorted({k[:-2] for k in params["blocks"] if k.startswith("lora_")}) if lora.rank else ():
        name, a, b = adapted_weight(adapter), params["blocks"][f"{adapter}_a"], params["blocks"][f"{adapter}_b"]
        w = blocks[name]
        s = a.ndim + b.ndim - w.ndim - 2
        S, R = math.prod(w.shape[:s]), a.shape[-1]
        a_SxIxR, b_SxRxO = a.reshape(S, -1, R), b.reshape(S, R, -1)
        delta = jnp.einsum("sir,sro->sio", a_SxIxR.astype(jnp.float32), b_SxRxO.astype(jnp.float32))
        blocks[name] = (w.astype(jnp.float32) + lora.scale * delta.reshape(w.shape)).astype(w.dtype)
    return {**params, "blocks": blocks}


# LoRA dropout (LoraSpec.dropout), PEFT's: y = x W + scale dropout(x) A B, inverted (the kept
# values / (1 - p)), in training only. A mask is a function of the step, the row of the step's batch,
# the layer of the stack, the target and the token's true position alone: `row_keys` draws each row's
# key from (seed, step), `layer_keys` folds in each layer's index in model order, `lora_dropout` the
# target and the position. So every layout, microbatch split and pipeline schedule, and a resumed
# run, draws the same mask for the same token (tests/test_lora.py).
DROPOUT_STREAM = 0x4C6F5241  # folded into the seed first: apart from the initialization's keys


def row_keys(seed: int, step, rows: int):
    """[rows, 2] uint32: the raw keys of the step's batch rows, fold_in(fold_in(seed's, step), row)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DROPOUT_STREAM), step)
    return jax.vmap(fold_key, (None, 0))(jax.random.key_data(key), jnp.arange(rows))


def dropout_rows(spec, seed: int, step, rows: int) -> dict:
    """{'noise': `row_keys`} under LoRA dropout (`spec`: the ModelSpec), else {}: the keys travel
    with the batch's rows as a model input (meshtrain/objectives/base.py `noise_rows`)."""
    return {"noise": row_keys(seed, step, rows)} if spec.lora.rank and spec.lora.dropout else {}


def fold_key(raw_key, data):
    """A raw key [2] (uint32, as it travels with its row) folded with `data`, raw."""
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(raw_key), data))


def layer_keys(rows_Bx2, layers_N):
    """[N, B, 2]: each row's key (`row_keys`) folded with each layer's index in model order."""
    return jax.vmap(jax.vmap(fold_key, (0, None)), (None, 0))(rows_Bx2, jnp.asarray(layers_N, jnp.int32))


def lora_dropout(x_BxLx_, keys_Bx2, target: str, rate: float, positions_L=None):
    """x with each element zeroed with probability `rate` and the kept ones divided by 1 - rate; the
    mask of row b and position l drawn from keys[b] (the layer's, `layer_keys`) folded with the
    target and positions[l], the token's true position (default 0..L-1; context parallelism stores
    the sequence permuted)."""
    positions_L = jnp.arange(x_BxLx_.shape[1]) if positions_L is None else jnp.asarray(positions_L)
    shape = x_BxLx_.shape[2:]

    def row(key_2):
        target_key = fold_key(key_2, LORA_TARGETS.index(target))
        keep = lambda p: jax.random.bernoulli(jax.random.wrap_key_data(fold_key(target_key, p)), 1.0 - rate, shape)
        return jax.vmap(keep)(positions_L)

    keep_BxLx_ = jax.vmap(row)(keys_Bx2)
    return jnp.where(keep_BxLx_, x_BxLx_ / (1.0 - rate), 0).astype(x_BxLx_.dtype)
