"""A layer's backward in two parts, for the pipeline schedules that defer the weight gradient (zb,
dualpipev; Qi et al., "Zero Bubble Pipeline Parallelism", 2023): B computes the input gradient and
keeps what the weight gradient needs beyond the layer's residuals (the stash); W computes the weight
gradient from the stash, and reruns no matmul B ran. For a matmul y = x w the stash holds dy, and W
forms dw = x^T dy from it and the residual x; a chain of matmuls (attention's, the MLP's) keeps
each one's output cotangent, so W never pulls back through the chain again, nor gathers weights
it does not read.

The split is read off the pullback's own program: its jaxpr, jitted calls and remat regions inlined,
is one data-flow graph; B is every equation the input gradient depends on, W every other one the
parameter gradient depends on, and the stash the values W reads that B computed (or the output
cotangent itself). A shard_map whose body makes both is cut in two the same way; any other equation
not inlined (a scan, a cond) stays whole in B when the input gradient needs any of its outputs.
Where B would then compute a weight gradient itself (its bytes stashed per microbatch), or the
stash would outweigh what the layer keeps already, `SplitPullback.cut` is None and the caller keeps
the whole pullback for W (`LayerResiduals`, meshtrain/engine/stage_state.py): the same math, one
more pass.
"""
from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, Var, jaxpr_as_fun, jaxprs_in_params
from jax.sharding import PartitionSpec as P

# calls whose body is one more run of equations, inlined so that B and W can each take its part
# (a jitted einsum's transpose computes dx and dw in one call)
INLINED = ("pjit", "jit", "closed_call", "core_call", "eval_jaxpr", "checkpoint", "remat", "remat2")
MATMULS = ("dot_general", "ragged_dot_general", "conv_general_dilated")
COLLECTIVES = ("psum", "psum_invariant", "all_gather", "all_to_all", "ragged_all_to_all", "ppermute",
               "reduce_scatter", "psum_scatter", "pmax", "pmin")


def _body(eqn) -> Jaxpr | None:
    """The equations' body of a call to inline, or None (kept whole)."""
    if eqn.primitive.name not in INLINED:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(body, ClosedJaxpr):
        body = None if body.consts else body.jaxpr
    return body if isinstance(body, Jaxpr) and not body.constvars else None


def _inlined(jaxpr: Jaxpr) -> tuple[list, dict]:
    """(the equations with every call in INLINED replaced by its body, renamed with fresh variables;
    the substitutions of the calls' outputs, var -> atom)."""
    eqns, subst = [], {}

    def walk(body: Jaxpr, rename: dict):
        atom = lambda a: a if isinstance(a, Literal) else rename.get(a, a)
        for eqn in body.eqns:
            inner = _body(eqn)
            if inner is None:
                outs = [rename.setdefault(v, Var(v.aval)) if rename is not subst else v for v in eqn.outvars]
                eqns.append(eqn.replace(invars=[atom(a) for a in eqn.invars], outvars=outs))
                continue
            scope = dict(zip(inner.invars, [atom(a) for a in eqn.invars]))
            walk(inner, scope)
            for out, res in zip(eqn.outvars, inner.outvars):
                rename[out] = res if isinstance(res, Literal) else scope.get(res, res)

    walk(jaxpr, subst)
    return eqns, subst


def _needs(eqns: list, outs) -> set[int]:
    """The indices of the equations `outs` depend on."""
    wanted = {a for a in outs if isinstance(a, Var)}
    needed = set()
    for i in reversed(range(len(eqns))):
        if any(v in wanted for v in eqns[i].outvars):
            needed.add(i)
            wanted.update(a for a in eqns[i].invars if isinstance(a, Var))
    return needed


def _vars(atoms) -> set:
    return {a for a in atoms if isinstance(a, Var)}


def _bytes(v) -> int:
    """An array's bytes, or a jaxpr variable's."""
    a = v.aval if isinstance(v, Var) else v
    return int(a.size) * a.dtype.itemsize


def _core(eqns: list, candidates: set[int]) -> set[int]:
    """Of the equations only the weight gradient needs, the matmuls (and kernels: a pallas_call, a
    scan) and what follows them: W. The rest (casts, a norm scale's gradient: elementwise work and
    reductions) B runs, so that W's stash is the matmuls' operands (an output cotangent in the compute
    dtype, not its fp32 source) or a small result."""
    core, made = set(), set()
    for i in sorted(candidates):
        heavy = eqns[i].primitive.name in MATMULS or list(jaxprs_in_params(eqns[i].params))
        if heavy or any(a in made for a in eqns[i].invars if isinstance(a, Var)):
            core.add(i)
            made.update(eqns[i].outvars)
    return core


def _stash(eqns: list, in_b: set[int], in_w: set[int], w_outs, g_vars: set) -> list:
    """The values W reads that B made (or the output cotangent), in order."""
    made = {v for i in in_b - in_w for v in eqns[i].outvars} | g_vars
    read = [a for i in sorted(in_w) for a in eqns[i].invars] + list(w_outs)
    return list(dict.fromkeys(a for a in read if isinstance(a, Var) and a in made))


def _recomputed(eqns: list, in_b: set[int], stash: list, g_vars: set) -> set[int]:
    """The B equations W runs again rather than stash their results: those of a stashed value that
    does not depend on the output cotangent and comes from the residuals by elementwise work and
    reductions (a norm's x_hat, the MLP's silu(gate) x up), whose bytes a stash would write and read
    per microbatch. A matmul, a collective or an equation kept whole (a scan, a shard_map) is stashed."""
    made_by = {v: i for i in in_b for v in eqns[i].outvars}
    moved: set[int] = set()
    for value in stash:
        chain, todo, cheap = set(), [value], value not in g_vars
        while todo and cheap:
            v = todo.pop()
            if not isinstance(v, Var) or v not in made_by or made_by[v] in chain:
                cheap = cheap and not (isinstance(v, Var) and v in g_vars)
                continue
            eqn = eqns[made_by[v]]
            cheap = eqn.primitive.name not in MATMULS + COLLECTIVES and not list(jaxprs_in_params(eqn.params))
            chain.add(made_by[v])
            todo.extend(eqn.invars)
        if cheap:
            moved |= chain
    return moved


def _run(name: str, constvars: list, consts, invars: list, outvars: list, eqns: list, *args) -> list:
    """Evaluate `eqns` (a run of a jaxpr's equations) from `invars` to `outvars`."""
    info = DebugInfo(name, None, tuple(f"in{i}" for i in range(len(invars))),
                     tuple(f"out{i}" for i in range(len(outvars))))
    program = Jaxpr(constvars, invars, outvars, eqns, debug_info=info)
    return jaxpr_as_fun(ClosedJaxpr(program, consts))(*args)


def _partition(eqns: list, b_outs, w_outs, g_vars: set) -> tuple[list, list, list]:
    """(B's equations, W's, the stash) of `eqns` (inlined) for the input gradient `b_outs` and the
    weight gradient `w_outs`: B what the input gradient needs; W the weight matmuls and what follows
    them (`_core`), and what it remakes rather than stash (`_recomputed`); a shard_map in B with an
    output only W needs cut in two (`_cut_shard_map`)."""
    eqns, tried = list(eqns), set()
    while True:
        in_b = _needs(eqns, b_outs)
        read_by_b = _vars(a for i in in_b for a in eqns[i].invars) | _vars(b_outs)
        maps = [i for i in sorted(in_b) if eqns[i].primitive.name == "shard_map" and id(eqns[i]) not in tried
                and any(o not in read_by_b for o in eqns[i].outvars)]
        if not maps:
            break
        tried.add(id(eqns[maps[0]]))
        if (pair := _cut_shard_map(eqns[maps[0]], read_by_b)) is not None:
            tried.add(id(pair[0]))
            eqns[maps[0]:maps[0] + 1] = pair
    in_w = _core(eqns, _needs(eqns, w_outs) - in_b)
    in_b = (in_b | _needs(eqns, w_outs)) - in_w
    in_w |= _recomputed(eqns, in_b, _stash(eqns, in_b, in_w, w_outs, g_vars), g_vars)
    stash = _stash(eqns, in_b, in_w, w_outs, g_vars)
    in_b = _needs(eqns, [*b_outs, *stash])
    return [e for i, e in enumerate(eqns) if i in in_b], [e for i, e in enumerate(eqns) if i in in_w], stash


def _cut_shard_map(eqn, read_by_b: set):
    """A shard_map B needs whose program also makes what only W reads (a MoE layer's experts: dx and
    the experts' dw in one body) as two: its B part, which returns its body's stash too (each
    device's, stacked on a new leading axis split over the manual axes), and its W part, which takes
    it. None (kept whole) where the equation's parameters are not the ones this JAX version was read
    with, or it checks its values' varying axes (every shard_map here is check_vma=False: a stash
    value's spec would have to name the axes it varies over), or the re-traced parts are not one
    equation each."""
    params = eqn.params
    mesh, body, manual = params.get("mesh"), params.get("jaxpr"), params.get("newly_manual_axes")
    in_specs, out_specs = params.get("in_specs"), params.get("out_specs")
    if None in (mesh, manual, in_specs, out_specs) or params.get("check_vma") is not False \
            or not isinstance(body, Jaxpr) or body.constvars:
        return None
    body_eqns, subst = _inlined(body)
    body_outs = [a if isinstance(a, Literal) else subst.get(a, a) for a in body.outvars]
    b_idx = [k for k, o in enumerate(eqn.outvars) if o in read_by_b]
    w_idx = [k for k, o in enumerate(eqn.outvars) if o not in read_by_b]
    b_eqns, w_eqns, stash = _partition(body_eqns, [body_outs[k] for k in b_idx], [body_outs[k] for k in w_idx],
                                       set())
    if _vars(body_outs[k] for k in w_idx) & {v for e in b_eqns for v in e.outvars}:
        return None  # B's part would make W's (the experts' grouped-matmul loop: dx and dw in one scan)
    reads = lambda eqns, idx: [v for v in body.invars if v in _vars(a for e in eqns for a in e.invars)
                               | _vars(body_outs[k] for k in idx)]  # each part's inputs, in order
    b_reads, w_reads = reads(b_eqns, b_idx), reads(w_eqns, w_idx)
    b_reads_at, w_reads_at = ([body.invars.index(v) for v in vs] for vs in (b_reads, w_reads))
    lead = P(tuple(a for a in mesh.axis_names if a in manual))  # the stash, one entry per device

    def b_part(*xs):
        out = _run("b_part", [], [], b_reads, [*(body_outs[k] for k in b_idx), *stash], b_eqns, *xs)
        return [*out[:len(b_idx)], *(s[None] for s in out[len(b_idx):])]

    def w_part(*xs):
        reads, kept = xs[:len(w_reads)], [s[0] for s in xs[len(w_reads):]]
        return _run("w_part", [], [], [*w_reads, *stash], [body_outs[k] for k in w_idx], w_eqns, *reads, *kept)

    shape = lambda vs: [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in vs]
    b_map = jax.shard_map(b_part, mesh=mesh, in_specs=tuple(in_specs[k] for k in b_reads_at), axis_names=manual,
                          check_vma=False, out_specs=[*(out_specs[k] for k in b_idx), *(lead,) * len(stash)])
    b_traced = jax.make_jaxpr(b_map)(*shape([eqn.invars[k] for k in b_reads_at])).jaxpr
    if len(b_traced.eqns) != 1 or b_traced.constvars or b_traced.eqns[0].invars != b_traced.invars:
        return None
    stash_out = [Var(v.aval) for v in b_traced.eqns[0].outvars[len(b_idx):]]
    w_map = jax.shard_map(w_part, mesh=mesh, in_specs=(*(in_specs[k] for k in w_reads_at), *(lead,) * len(stash)),
                          out_specs=[out_specs[k] for k in w_idx], axis_names=manual, check_vma=False)
    w_traced = jax.make_jaxpr(w_map)(*shape([eqn.invars[k] for k in w_reads_at]), *shape(stash_out)).jaxpr
    if len(w_traced.eqns) != 1 or w_traced.constvars or w_traced.eqns[0].invars != w_traced.invars:
        return None
    return (b_traced.eqns[0].replace(invars=[eqn.invars[k] for k in b_reads_at],
                                     outvars=[*(eqn.outvars[k] for k in b_idx), *stash_out]),
            w_traced.eqns[0].replace(invars=[*(eqn.invars[k] for k in w_reads_at), *stash_out],
                                     outvars=[eqn.outvars[k] for k in w_idx]))


class Split:
    """A pullback's program cut in two. `closed`: the jaxpr of the flat inputs -> (d params leaves...,
    d input leaves...); `n_param_grads`: how many outputs are the parameters' gradients (first);
    `g_inputs`: the positions of the inputs W does not get (the output cotangent), stashed where W
    reads them."""

    def __init__(self, closed: ClosedJaxpr, n_param_grads: int, g_inputs: range):
        jaxpr = closed.jaxpr
        eqns, subst = _inlined(jaxpr)
        outs = [a if isinstance(a, Literal) else subst.get(a, a) for a in jaxpr.outvars]
        w_outs, b_outs = outs[:n_param_grads], outs[n_param_grads:]
        g_vars = {jaxpr.invars[i] for i in g_inputs}
        self.b_eqns, self.w_eqns, self.stash = _partition(eqns, b_outs, w_outs, g_vars)
        effects = any(e.effects for e in eqns)  # a callback that feeds no output would be dropped
        made_in_b = {v for e in self.b_eqns for v in e.outvars}
        # B computes the small parameters' gradients (a norm's scale: a reduction of dy x x_hat) and
        # stashes them; one that outweighs the output cotangent (a weight's, inside an equation kept
        # whole) would cost more memory per microbatch than running the pullback again in W
        stashed_grads = sum(_bytes(a) for a in dict.fromkeys(w_outs) if a in made_in_b)
        self.usable = stashed_grads <= sum(_bytes(v) for v in g_vars) and not effects
        # W's inputs: the pullback's, the output cotangent's unread (fresh variables), then the stash
        self.w_invars = [Var(v.aval) if v in g_vars else v for v in jaxpr.invars] + self.stash
        self.jaxpr, self.consts, self.b_outs, self.w_outs = jaxpr, closed.consts, b_outs, w_outs

    def run(self, name: str, invars: list, outvars: list, eqns: list, *args) -> list:
        return _run(name, self.jaxpr.constvars, self.consts, invars, outvars, eqns, *args)

    def input_grad(self, flat) -> tuple[list, list]:
        """(the input gradient's leaves, the stash) from the pullback's flat inputs."""
        out = self.run("input_grad", self.jaxpr.invars, [*self.b_outs, *self.stash], self.b_eqns, *flat)
        return out[:len(self.b_outs)], out[len(self.b_outs):]

    def weight_grad(self, flat, stash) -> list:
        """The parameters' gradients' leaves from the pullback's flat inputs (the output cotangent's
        unread: any array of its shape) and the stash, which B's trace made as this one's."""
        made = [(tuple(a.shape), a.dtype) for a in stash]
        assert made == [(tuple(v.aval.shape), v.aval.dtype) for v in self.stash], "B's and W's cuts differ"
        return self.run("weight_grad", self.w_invars, self.w_outs, self.w_eqns, *flat, *stash)


class SplitPullback:
    """`pullback(*args)` -> (d params, d input) as B and W (`Split`), from `args` whose `g_arg`-th
    is the output cotangent (a pytree W does not get) and `kept_arg`-th the residuals. `cut` is None
    where B would compute a weight gradient itself, or where the stash would outweigh what the layer
    keeps for its backward already (its residuals and output cotangent: under remat=full, which keeps
    the layer's input alone, the stash would be every matmul's operands, the memory the policy
    gave up): the caller runs the whole pullback in W instead."""

    def __init__(self, pullback, args: tuple, g_arg: int, kept_arg: int):
        structure = jax.tree.structure(args)
        outs = []

        def flat_fn(*flat):
            g_params, g_input = pullback(*jax.tree.unflatten(structure, flat))
            outs[:] = [jax.tree.structure(g_params), jax.tree.structure(g_input)]
            return [*jax.tree.leaves(g_params), *jax.tree.leaves(g_input)]

        closed = jax.make_jaxpr(flat_fn)(*jax.tree.leaves(args))
        self.params_tree, self.input_tree = outs
        start = sum(len(jax.tree.leaves(a)) for a in args[:g_arg])
        cut = Split(closed, self.params_tree.num_leaves, range(start, start + len(jax.tree.leaves(args[g_arg]))))
        kept = sum(_bytes(a) for i in (g_arg, kept_arg) for a in jax.tree.leaves(args[i]))
        self.cut = cut if cut.usable and sum(_bytes(v) for v in cut.stash) <= kept else None

    def input_grad(self, args):
        """(d input, the stash: a list of arrays)."""
        g_input, stash = self.cut.input_grad(jax.tree.leaves(args))
        return jax.tree.unflatten(self.input_tree, g_input), stash

    def weight_grad(self, args, stash):
        """d params; `args`' output cotangent is not read (any array of its shape)."""
        return jax.tree.unflatten(self.params_tree, self.cut.weight_grad(jax.tree.leaves(args), stash))
