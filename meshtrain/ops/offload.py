"""Optimizer state in host memory (`parallel.offload=optimizer`: ZeRO-Offload's `offload_optimizer`,
MaxText's `optimizer_memory_host_offload`).

The optimizer state's parameter-shaped parts (Adam's moments: 8 of the 16 bytes a trained parameter
costs under fp32 AdamW) live in pinned host memory between steps (`memory_kind="pinned_host"` in
their shardings); their scalars (counts) stay on the device. The update streams them through the
device one stacked layer at a time (`streamed_update`): layer k's moments are copied in, updated
with its gradients and parameters, and copied back, so the device holds one layer's state, not the
model's; the unstacked parameters (embedding, final norm, head) are updated in one more call. The
GPU program shows it: the state's arguments and results in host memory space (S(5) in the entry
layout), the loop's copies as copy-start/copy-done. The math is the optimizer's own, leaf by leaf:
every optimizer here (meshtrain/ops/optimizers.py) updates each parameter from its own gradient,
state and the shared counts, so a layer's slice updates exactly as the whole stack would.

`parallel.offload=optimizer+params` keeps the stacked layers' fp32 parameters there too (FSDP's CPU
offload, "a 13B model on one GPU"): each layer's parameters are fetched to the device inside its
rematerialised block (`fetching`), cast there, and fetched again when the backward reruns it; their
gradients land in host memory (the transpose of a host-to-device copy is the copy back), a layer at a
time, and the update streams parameters, gradients and moments through the device as above. The
global gradient norm streams the host gradients too (`global_norm`). The unstacked parameters
(embedding, final norm, head) and their gradients stay on the device.

On CPU devices host and device memory are the same RAM: the tests there prove the program (the
same losses and parameters as without offload), not the bytes; the planner's GPU compile proves
the placement (meshtrain/planner/aot.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshtrain.core.errors import UserError
from meshtrain.ops.optimizers import map_param_states
from meshtrain.parallel.sharding import shard_bytes

MODES = ("none", "optimizer", "optimizer+params")
HOST_KIND = "pinned_host"


def to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


def fetched(x):
    """`x` on the device: copied there from host memory, as it is elsewhere."""
    return to_device(x) if on_host(x) else x


def on_host(x) -> bool:
    """Whether an array (or a traced value) lives in host memory."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def check_layout(offload: str, sizes: dict[str, int], refusals: dict[str, bool] | None = None) -> None:
    """A layout `streamed_update` cannot serve, in one line: on a pipeline the stacked layers are
    split over stages, and a loop over all of them would move every layer through every stage.
    `refusals`: {what the run has: whether it has it} of what optimizer+params does not serve (its
    gradients are in host memory, which only the streamed norm and update read)."""
    if offload != "none" and sizes.get("pipeline", 1) > 1:
        raise UserError(f"parallel.offload={offload} streams the optimizer state a layer at a time and does not "
                        f"run on a pipeline (pipeline={sizes['pipeline']}); use fsdp, tensor or data axes, or "
                        f"set parallel.offload=none")
    if offload == "optimizer+params":
        for what, present in (refusals or {}).items():
            if present:
                raise UserError(f"parallel.offload=optimizer+params keeps the layers' parameters and gradients in host "
                                f"memory and does not run with {what}; change that, or set parallel.offload=optimizer")


def host_param_leaves(logical_axes, offload: str):
    """Per parameter: whether it lives in host memory (optimizer+params: the `layers` stacks)."""
    stacked = _stacked(logical_axes)
    return stacked if offload == "optimizer+params" else jax.tree.map(lambda _: False, stacked)


def to_host_where(tree, flags):
    """`tree` with the leaves `flags` marks typed as host arrays (`to_host`): what the compile-only GPU
    devices' shardings cannot say (`mark_host_arguments`); a no-op on arrays already there."""
    return jax.tree.map(lambda x, host: to_host(x) if host else x, tree, flags)


def fetching(block, cast):
    """`block` taking a layer's parameters from host memory: each leaf there is copied to the device
    and cast (`cast`: parameters -> the compute dtype's, meshtrain/ops/precision.py `cast_for_compute`)
    inside the block, so a rematerialised block fetches it again in the backward rather than keeping
    it (optimizer+params)."""
    def block_fetching(params_i, *args, **kwargs):
        return block(cast(jax.tree.map(fetched, params_i)), *args, **kwargs)

    return block_fetching


def global_norm(grads, unscale):
    """The global L2 norm of the gradients (optax.tree.norm), the host-memory ones read a layer at a time
    on the device and divided by `unscale` there (the step leaves them as the backward wrote them)."""
    device = [g for g in jax.tree.leaves(grads) if not on_host(g)]
    hosted = [g for g in jax.tree.leaves(grads) if on_host(g)]
    if not hosted:
        return optax.tree.norm(grads)
    square = lambda x: jnp.sum(jnp.square(x))
    total = sum(square(g) for g in device)
    for g in hosted:
        row = lambda k, acc, g=g: acc + square(unscale(to_device(jax.lax.dynamic_slice_in_dim(g, k, 1, 0))))
        total = total + jax.lax.fori_loop(0, g.shape[0], row, jnp.zeros((), g.dtype))
    return jnp.sqrt(total)


def host_leaves(opt_state, trained_params):
    """A tree of booleans over the optimizer state: True for its parameter-shaped parts (what lives on
    the host), False for its scalars."""
    return map_param_states(lambda state, param: True, opt_state, trained_params, otherwise=lambda _: False)


def in_host_memory(shardings, flags):
    """`shardings` with those `flags` marks (a tree of booleans as `host_leaves` or `host_param_leaves`
    give) in pinned host memory."""
    return jax.tree.map(lambda s, host: s.with_memory_kind(HOST_KIND) if host else s, shardings, flags)


def host_bytes(tree, shardings, flags) -> int:
    """The bytes per device of the leaves of `tree` that `flags` marks, under `shardings`."""
    marked = [(x, s) for x, s, host in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings),
                                           jax.tree.leaves(flags)) if host]
    return shard_bytes([x for x, _ in marked], [s for _, s in marked])


def _stacked(logical_axes):
    """Per trained parameter: whether the update streams it a layer at a time (its leading axis is
    the `layers` stack)."""
    return jax.tree.map(lambda names: bool(names) and names[0] == "layers", logical_axes,
                        is_leaf=lambda n: isinstance(n, tuple))


def streamed_update(inner, grads, opt_state, params, logical_axes, applied, finish=lambda g, hosted: g):
    """(new params, new state) of `inner` (the optimizer after clipping, whose state `opt_state`
    holds its parameter-shaped parts in host memory) from `grads`, a stacked layer at a time: a
    fori_loop over the `layers` rows brings each row's state (and under optimizer+params its
    parameters and gradients) to the device, updates it and writes it back to its host buffer; then
    one call updates the unstacked parameters. A parameter a call does not cover is given as a
    placeholder of ones of shape (1, ..., 1) (every optimizer here updates a parameter from its own
    leaves only) and its output dropped. `finish(gradient part, came from host memory)`: the
    gradient as the optimizer takes it (clipped; unscaled where the step left it in host memory).
    `applied`: the step's nonfinite guard; a skipped step keeps every row of the parameters and the
    state."""
    stacked = _stacked(logical_axes)
    # per state leaf: "layer" (a stacked parameter's, streamed by rows), "whole" (another
    # parameter's), "count" (not parameter-shaped: stays on the device)
    kinds, state_def = jax.tree.flatten(map_param_states(
        lambda x, p, s: "layer" if s else "whole", opt_state, params, stacked, otherwise=lambda _: "count"))
    flat = state_def.flatten_up_to(opt_state)
    layers = {x.shape[0] for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(stacked)) if s}
    layers |= {x.shape[0] for x, kind in zip(flat, kinds) if kind == "layer"}
    if len(layers) > 1:
        raise ValueError(f"stacked parameters or states of different depths {sorted(layers)}")
    # the compile-only GPU devices drop a sharding's memory kind: placing the arguments here types
    # them as host arrays, as the trainer's shardings already say (a no-op there)
    flat = [x if kind == "count" else to_host(x) for x, kind in zip(flat, kinds)]
    placeholder = lambda x: jnp.ones((1,) * x.ndim, x.dtype)
    keep = lambda new, old: jnp.where(applied, new, old)

    def call(pick, params, flat):
        """`inner` on what `pick` ((leaf, "layer"/"whole"/"count") -> its part) takes of `params`, their
        gradients and the state's leaves `flat`, on the device."""
        of_param = lambda x, s: pick(x, "layer" if s else "whole")
        p = jax.tree.map(lambda x, s: fetched(of_param(x, s)), params, stacked)
        g = jax.tree.map(lambda x, s: finish(fetched(of_param(x, s)), on_host(x)), grads, stacked)
        st = [x if kind == "count" else fetched(pick(x, kind)) for x, kind in zip(flat, kinds)]
        updates, new_state = inner.update(g, state_def.unflatten(st), p)
        return p, optax.apply_updates(p, updates), st, state_def.flatten_up_to(new_state)

    new_params, buffers = params, flat
    if layers:
        depth = layers.pop()
        row = lambda k: lambda x, kind: (x if kind == "count" else jax.lax.dynamic_slice_in_dim(x, k, 1, 0)
                                         if kind == "layer" else placeholder(x))

        def layer(k, carry):
            ps, bufs = carry
            old_p, new_p, old_s, new_s = call(row(k), ps, bufs)  # the carried buffers: updated in place
            put = lambda buf, new, old: jax.lax.dynamic_update_slice_in_dim(
                buf, to_host(keep(new, old)) if on_host(buf) else keep(new, old), k, 0)
            ps = jax.tree.map(lambda buf, new, old, s: put(buf, new, old) if s else buf, ps, new_p, old_p, stacked)
            bufs = [put(buf, new, old) if kind == "layer" else buf
                    for buf, new, old, kind in zip(bufs, new_s, old_s, kinds)]
            return ps, bufs

        new_params, buffers = jax.lax.fori_loop(0, depth, layer, (params, flat))
    rest = lambda x, kind: placeholder(x) if kind == "layer" else x
    old_p, new_p, old_s, new_s = call(rest, new_params, buffers)
    new_params = jax.tree.map(lambda buf, new, old, s: buf if s else keep(new, old), new_params, new_p, old_p,
                              stacked)
    # the counts advance once, as in one call; the unstacked parameters' state goes back to the host
    out = [buf if kind == "layer" else keep(new, old) if kind == "count" else to_host(keep(new, old))
           for buf, new, old, kind in zip(buffers, new_s, old_s, kinds)]
    return new_params, state_def.unflatten(out)


def offloaded_update(clip_norm: float, inner, logical_axes):
    """The step's optimizer update ((grads, opt_state, trained, applied, unscale, grad_norm) -> (new
    trained parameters, new opt_state), as `meshtrain.engine.step.in_place_update`) with the state in
    host memory: `streamed_update`, each gradient part clipped to the global norm `clip_norm` on the
    device as optax.clip_by_global_norm clips (its state is empty: `opt_state` is the chain's (clip
    state, optimizer state)), a host-memory one first divided as the step divides the others (`unscale`)."""
    def update(grads, opt_state, trained, applied, unscale, grad_norm):
        clip_state, inner_state = opt_state
        clip = ((lambda t: jax.lax.select(grad_norm < clip_norm, t, (t / grad_norm.astype(t.dtype)) * clip_norm))
                if clip_norm > 0 else (lambda t: t))
        grads = jax.tree.map(lambda g: g if on_host(g) else clip(g), grads)  # the device's at once, as optax does
        finish = lambda g, hosted: clip(unscale(g)) if hosted else g
        new_trained, inner_state = streamed_update(inner, grads, inner_state, trained, logical_axes, applied, finish)
        return new_trained, (clip_state, inner_state)

    return update


def mark_host_arguments(lowered, host_flags: list[bool]) -> None:
    """Write `mhlo.memory_kind = "pinned_host"` on the lowered module's entry arguments flagged in
    `host_flags` (one per flattened argument), in place, before it is compiled. jit writes it from a
    sharding's memory kind, but the compile-only GPU devices (the planner's, meshtrain/planner/compilers.py)
    answer `default_memory()` with "not supported" and their shardings drop the kind: without this
    the GPU program would count the host state as device arguments. The attribute is what jit writes
    for a device that has memories (MLIR of JAX 0.10 and 0.11 alike)."""
    from jax._src.lib.mlir import ir

    module = lowered._lowering.stablehlo()
    with module.context:
        main = next(op for op in module.body.operations
                    if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main")
        attrs = list(main.arg_attrs)
        if len(attrs) != len(host_flags):
            raise ValueError(f"the lowered step takes {len(attrs)} arguments, not the {len(host_flags)} flattened")
        for i, host in enumerate(host_flags):
            if host:
                entries = {named.name: named.attr for named in ir.DictAttr(attrs[i])}
                entries["mhlo.memory_kind"] = ir.StringAttr.get(HOST_KIND)
                attrs[i] = ir.DictAttr.get(entries)
        main.arg_attrs = ir.ArrayAttr.get(attrs)
