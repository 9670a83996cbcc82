"""Logical axis rules -> PartitionSpecs for parameters, optimizer state, gradients, activations.

One table maps each logical tensor dimension to mesh axes. A mesh axis shards at most one
dimension of a tensor: the first dimension that claims it wins (so activations (batch, seq, embed)
put `fsdp` on batch, while weights (embed, mlp) put it on embed).

ZeRO: `fsdp` always shards parameters, gradients and optimizer state (that is what FSDP means).
The `zero` stage decides what the pure data-parallel `data` axis shards as well:
  stage 0: nothing; 1: optimizer state; 2: + gradients; 3: + parameters.
With N = |data|, Psi parameters and fp32 Adam (4 B param, 4 B grad, 8 B moments), bytes/device
before dividing by |fsdp| x |tensor| are: 16Psi, 8Psi + 8Psi/N, 4Psi + 12Psi/N, 16Psi/N
(Rajbhandari et al., ZeRO, 2020, with fp32 in place of their fp16 copies).
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.core.errors import LayoutError, UserError
from meshtrain.parallel.mesh import AXES

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # Outside the experts, the expert axis is data parallel; it is the batch's major factor, as the
    # experts' all-to-all (models/experts.py) takes it, so tokens enter and leave it without a reshuffle.
    "batch": ("expert", "data", "fsdp"),
    "seq": ("context",),  # context parallelism splits the sequence
    "residual_seq": ("context",),  # the residual stream and norms; + tensor under sequence parallelism
    # Weights are sharded over `context` too (FSDP over fsdp x context, as torchtitan and Megatron-CP
    # do): context devices hold different tokens, so their gradients are reduce-scattered, not
    # all-reduced, and parameters, gradients and optimizer state shrink with C like activations.
    "embed": ("fsdp", "context"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),  # each pipeline stage holds its own layers
    # Stacks the pipeline does not split (deepseek_v3's dense first layers, run by `embed` on the
    # first stage, and its MTP modules): every stage holds them whole, as the embedding.
    "outer_layers": (),
    "experts": ("expert",),  # each expert-parallel device holds its own experts
    # A LoRA factor's rank (models/lora.py lora_axes) goes where `embed` does: a factor with an embed
    # axis keeps it there (an axis shards one dimension), the others (B of q/k/v/gate/up, A of o/down)
    # split their rank, so every adapter is split over fsdp x context as ZeRO's formula divides it.
    "lora_rank": ("fsdp", "context"),
    # Multi-head latent attention's latents (models/deepseek_v3.py) are FSDP-sharded as `embed` is:
    # wkv_b [kv_lora, heads, head_dim] and wq_b [q_lora, heads, head_dim] have no embed axis, and with
    # no rule they stayed whole on every fsdp device, their gradients all-reduced over all of fsdp x
    # expert (deepseek_v3_16b's pod: 1.24x the all-reduce formula). wq_a/wkv_a keep fsdp on embed.
    "q_lora": ("fsdp", "context"),
    "kv_lora": ("fsdp", "context"),
}

# The leading axes of stacked layers: `layers` (`blocks`, which pipeline stages split) and
# `outer_layers` (the other stacks, whole on every stage).
LAYER_AXES = ("layers", "outer_layers")

# Largest share of parameter bytes allowed to stay replicated where the rules say to shard.
MAX_REPLICATED_FRACTION = 0.02


def make_rules(overrides: dict | None = None, sequence_parallel: bool = False) -> dict[str, tuple[str, ...]]:
    """The default table with the plan's overrides (`parallel.rules: {mlp: [tensor, fsdp]}`). Sequence
    parallelism (Korthikanti et al. 2022) adds `tensor` to the residual stream's sequence, so XLA
    turns each block's output all-reduce into a reduce-scatter and an all-gather."""
    rules = dict(DEFAULT_RULES)
    if sequence_parallel:
        rules["residual_seq"] = rules["residual_seq"] + ("tensor",)
    for name, axes in (overrides or {}).items():
        if name not in DEFAULT_RULES:
            raise UserError(f"unknown logical axis '{name}' in parallel.rules; known: {', '.join(DEFAULT_RULES)}")
        axes = () if axes in (None, "", []) else (axes,) if isinstance(axes, str) else axes
        if not isinstance(axes, (list, tuple)):
            raise UserError(f"parallel.rules.{name}={axes!r} is not a list of mesh axes; e.g. [tensor, fsdp]")
        for a in axes:
            if a not in AXES:
                raise UserError(f"parallel.rules.{name}: unknown mesh axis {a!r}; axes are {', '.join(AXES)}")
        if len(set(axes)) < len(axes):
            raise UserError(f"parallel.rules.{name}={list(axes)} names a mesh axis twice; name each once")
        axes = tuple(axes)
        rules[name] = axes
    return rules


def spec_for(names, rules, mesh, shape=None, extra_axes=()) -> P:
    """PartitionSpec for a tensor whose dimensions carry logical `names`.

    With `shape`, an axis that does not divide its dimension is dropped (see `check_replication`).
    `extra_axes` (the ZeRO `data` axis) go on the dimension that already holds `fsdp` if they
    divide it, else on the largest dimension they divide. They split a dimension of `fsdp`'s as its
    major factor and any other as the minor one: each `tensor` (or pipeline stage's) block is then cut
    into data shards where it lies, so the manual data executor's gather over `data` (and its
    reduce-scatter) moves nothing over the other axes (meshtrain/parallel/data_parallel.py `unfold`).
    """
    used, dims = set(), []
    for i, name in enumerate(names):
        axes = []
        for a in rules.get(name, ()):
            if a in used or mesh.shape[a] == 1:
                continue
            if shape is not None and shape[i] % (math.prod(mesh.shape[x] for x in axes) * mesh.shape[a]):
                continue
            axes.append(a)
            used.add(a)
        dims.append(axes)
    for a in extra_axes:
        if a in used or mesh.shape[a] == 1:
            continue
        order = sorted(range(len(dims)), key=lambda i: ("fsdp" not in dims[i], -(shape[i] if shape else 0)))
        for i in order:
            if shape is None or shape[i] % (math.prod(mesh.shape[x] for x in dims[i]) * mesh.shape[a]) == 0:
                dims[i] = [a] + dims[i] if "fsdp" in dims[i] else dims[i] + [a]
                used.add(a)
                break
    return P(*[axes_entry(d) for d in dims])


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, 'fsdp' or ('data', 'fsdp'))."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def axes_entry(axes):
    """The PartitionSpec entry of these mesh axes (the inverse of `entry_axes`)."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


# The axes that split a weight only to store it (ZeRO's `data` at stage 3, FSDP's fsdp and context):
# the program gathers it over them before each use. The model-parallel axes (tensor, expert, pipeline)
# split the computation itself.
STORAGE_AXES = ("data", "fsdp", "context")


def gathered(tree, specs):
    """`tree` (laid out as `specs`) pinned whole over the storage axes, the model-parallel ones kept:
    one gather of every leaf (parallel.gather_once keeps the compute-dtype weights so for the step).
    Traced under `jax.set_mesh`; inside a `jax.shard_map` its manual axes are already local."""
    mesh = jax.sharding.get_abstract_mesh()
    kept = lambda spec: P(*[axes_entry(a for a in entry_axes(e) if a not in STORAGE_AXES and a not in
                                       mesh.manual_axes) for e in spec])
    return jax.tree.map(lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, kept(spec))),
                        specs, tree, is_leaf=lambda x: isinstance(x, P))


def shard_factor(spec: P, mesh) -> int:
    """Number of distinct shards a spec cuts a tensor into."""
    return math.prod(mesh.shape[a] for d in spec for a in entry_axes(d))


def tree_specs(abstract, logical_axes, rules, mesh, extra_axes=()):
    return jax.tree.map(lambda x, names: spec_for(names, rules, mesh, x.shape, extra_axes),
                        abstract, logical_axes, is_leaf=lambda n: isinstance(n, tuple))


def zero_axes(zero: int, what: str) -> tuple[str, ...]:
    """Which extra axes the ZeRO stage adds for `what` in {params, grads, opt_state}."""
    threshold = {"opt_state": 1, "grads": 2, "params": 3}[what]
    return ("data",) if zero >= threshold else ()


def check_replication(abstract_params, logical_axes, rules, mesh, zero: int) -> None:
    """Fail when more than 2% of parameter bytes stay replicated where the rules say to shard
    (a dimension the mesh axis does not divide), naming the worst parameter and the fix."""
    total, lost, worst = 0, 0, None
    for (path, x), names in zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                                jax.tree.leaves(logical_axes, is_leaf=lambda n: isinstance(n, tuple))):
        extra = zero_axes(zero, "params")
        wanted = shard_factor(spec_for(names, rules, mesh, None, extra), mesh)
        got = shard_factor(spec_for(names, rules, mesh, x.shape, extra), mesh)
        nbytes = x.size * x.dtype.itemsize
        total += nbytes
        if got < wanted:
            lost += nbytes
            if worst is None or nbytes > worst[1]:
                worst = (jax.tree_util.keystr(path), nbytes, x.shape, names)
    if total and lost / total > MAX_REPLICATED_FRACTION:
        name, _, shape, names = worst
        raise LayoutError(f"{lost / total:.0%} of parameter bytes stay replicated because the mesh does not divide "
                          f"them (largest: {name} {shape} with axes {names}); pick mesh sizes that divide "
                          f"the model's dimensions")


def param_shardings(model, mesh, rules=None, check: bool = False):
    """NamedShardings of the model's parameters on `mesh` under the (default) rules, with no ZeRO
    stage (replicated over `data`): for weights outside a training run (import, export,
    generation). `check`: fail as training would when the mesh leaves much of them replicated."""
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    rules = rules or make_rules()
    if check:
        check_replication(abstract, model.logical_axes(abstract), rules, mesh, zero=0)
    specs = tree_specs(abstract, model.logical_axes(abstract), rules, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def owned_specs(params, logical_axes, rules, mesh, zero: int):
    """The slice of each gradient every data shard reduces under gradient compression
    (meshtrain/parallel/compression.py): the ZeRO-2 gradient layout, which zero 2/3 keep after the step. At
    zero 0/1 the mean is gathered whole again, so `data` is made the minor factor of its dimension:
    each device's slice over the other axes is then cut into data rows where it lies, and nothing
    moves over those axes."""
    specs = tree_specs(params, logical_axes, rules, mesh, zero_axes(2, "grads"))
    if zero >= 2:
        return specs

    data_last = lambda entry: axes_entry(sorted(entry_axes(entry), key=lambda a: a == "data"))  # a stable sort
    return jax.tree.map(lambda spec: P(*map(data_last, spec)), specs, is_leaf=lambda x: isinstance(x, P))


def state_spec(state, param, spec: P, mesh) -> P:
    """The spec of an optimizer state of `param` (spec `spec`): a dimension of the parameter's size
    is split as the parameter's is. A dimension the state reduced to 1 (Adafactor's factored
    statistics, meshtrain/ops/optimizers.py) is whole, and its mesh axes move to the largest kept
    dimensions they divide, so ZeRO still shards the statistics."""
    if state.ndim != param.ndim:
        raise ValueError(f"an optimizer state of shape {state.shape} for a parameter of shape {param.shape}: "
                         f"states keep the parameter's dimensions (reduced ones as 1)")
    entries = tuple(spec) + (None,) * (param.ndim - len(spec))
    kept = [state.shape[i] == param.shape[i] for i in range(param.ndim)]
    dims = [list(entry_axes(e)) if keep else [] for e, keep in zip(entries, kept)]
    lost = [a for e, keep in zip(entries, kept) if not keep for a in entry_axes(e)]
    for a in lost:
        for i in sorted(range(len(dims)), key=lambda i: -state.shape[i]):
            if kept[i] and state.shape[i] % (math.prod(mesh.shape[x] for x in dims[i]) * mesh.shape[a]) == 0:
                dims[i].append(a)
                break
    return P(*[axes_entry(d) for d in dims])


def state_shardings(abstract_state, logical_axes, rules, mesh, zero: int, map_states, other_specs=None,
                    trained=lambda tree: tree):
    """NamedShardings for the train state (params, opt_state, the entries of `other_specs`, trees of
    PartitionSpecs such as gradient compression's residuals, and replicated scalar counters) and the
    PartitionSpecs for gradients. `map_states` walks the optimizer state's parameter-shaped parts
    (meshtrain/ops/optimizers.py `map_param_states`). `trained`: the part of a parameter tree that
    is trained (meshtrain/ops/trainable.py `select`), which the optimizer state and gradients cover."""
    params, trained_axes = abstract_state["params"], trained(logical_axes)
    param_specs = tree_specs(params, logical_axes, rules, mesh, zero_axes(zero, "params"))
    opt_param_specs = tree_specs(trained(params), trained_axes, rules, mesh, zero_axes(zero, "opt_state"))
    grad_specs = tree_specs(trained(params), trained_axes, rules, mesh, zero_axes(zero, "grads"))
    opt_specs = map_states(lambda state, param, spec: state_spec(state, param, spec, mesh),
                           abstract_state["opt_state"], trained(params), opt_param_specs, otherwise=lambda _: P())
    named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                       is_leaf=lambda x: isinstance(x, P))
    replicated = NamedSharding(mesh, P())
    shardings = {key: jax.tree.map(lambda _: replicated, value) for key, value in abstract_state.items()}  # scalars
    shardings.update(params=named(param_specs), opt_state=named(opt_specs))
    shardings.update({key: named(specs) for key, specs in (other_specs or {}).items()})
    return shardings, grad_specs


# ---- activations: the model calls `constrain`; the trainer says which mesh and rules apply ----
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("meshtrain_rules", default=None)


@contextlib.contextmanager
def activation_rules(rules, mesh):
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def manual_axes_rules(manual: set[str]):
    """Inside `jax.shard_map` over `manual` axes: activations are constrained over the other axes only."""
    active = _ACTIVE.get()
    if active is None:
        yield
        return
    rules, mesh = active
    rules = {k: tuple(a for a in v if a not in manual) for k, v in rules.items()}
    token = _ACTIVE.set((rules, jax.sharding.get_abstract_mesh()))  # the mesh that knows which axes are manual
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, names):
    """Pin an activation's layout by logical names; a no-op outside `activation_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, rules, mesh, x.shape)))


def mesh_axis(axis: str) -> tuple[int, bool]:
    """(size, already manual) of `axis` in the mesh being traced under ((1, False) without it):
    whether a kernel must open its own shard_map over the axis, or runs inside one."""
    mesh = jax.sharding.get_abstract_mesh()
    size = mesh.shape.get(axis, 1)  # an empty mesh (no jax.set_mesh) has no axes
    return size, size > 1 and axis in mesh.manual_axes


def rule_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the active rules (else the default ones) give logical dimension `name`."""
    active = _ACTIVE.get()
    return (active[0] if active else DEFAULT_RULES).get(name, ())


def shard_count(name: str) -> int:
    """How many ways the active rules split logical dimension `name` (1 outside `activation_rules`;
    inside a `shard_map`, the compiler-managed axes only: the manual ones are already local)."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    rules, mesh = active
    return math.prod(mesh.shape[a] for a in rules.get(name, ()))


def common_shard_count(name: str, other: str) -> int:
    """How many ways the axes the active rules give both `name` and `other` split a dimension (1
    outside `activation_rules`): e.g. fsdp, which shards the batch and the weights' `embed`."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    rules, mesh = active
    return math.prod(mesh.shape[a] for a in rules.get(name, ()) if a in rules.get(other, ()))



def summed_over_shards(x_GxSx, names):
    """A gradient held per batch and sequence shard, x [G, S, ...] (G the batch's shards, S the
    sequence's), summed once into a tensor whose other dimensions carry logical `names`: the shards
    along the axes `embed` splits it on (fsdp, the batch's minor factor; context, the sequence's)
    reduce-scatter onto its own shards, and the rest of the batch's (expert, data) all-reduce those.
    One sum over every shard is an all-reduce of the whole tensor over them all, then sliced:
    mixtral-8x7b's pod (fsdp x expert) all-reduced 2.6x the formula (issue 39, section 3)."""
    G = x_GxSx.shape[0]
    F = math.gcd(G, common_shard_count("batch", "embed"))
    x_RxFxSx = x_GxSx.reshape(G // F, F, *x_GxSx.shape[1:])
    x_Rx = constrain(x_RxFxSx.sum((1, 2)), ("batch", *names))
    return constrain(x_Rx.sum(0), names)

def stage_replicated(axes: tuple) -> bool:
    """Whether every pipeline stage holds this parameter whole: it has no `layers` axis (embedding,
    final norm, head, an `outer_layers` stack), so it sits outside the stacked layers the stages split."""
    return "layers" not in axes


def shard_bytes(tree, shardings) -> int:
    """The bytes per device of `tree`'s leaves (arrays or ShapeDtypeStructs) under `shardings`."""
    return int(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))))
