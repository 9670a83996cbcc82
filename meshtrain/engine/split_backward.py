"""A layer's backward in two parts, for the pipeline schedules that defer the weight gradient (zb,
dualpipev; Qi et al., "Zero Bubble Pipeline Parallelism", 2023): B computes the input gradient and
keeps what the weight gradient needs beyond the layer's residuals (the stash); W computes the weight
gradient from the stash, and reruns nothing B ran. For a matmul y = x w the stash holds dy, and W
forms dw = x^T dy from it and the residual x; a chain of matmuls (attention's, the MLP's) keeps
each one's output cotangent, so W never pulls back through the chain again, nor gathers weights
it does not read.

The split is read off the pullback's own program: its jaxpr, jitted calls and remat regions inlined,
is one data-flow graph; B is every equation the input gradient depends on, W every other one the
parameter gradient depends on, and the stash the values W reads that B computed (or the output
cotangent itself). An equation that is not inlined (a scan, a cond, a shard_map) stays whole in B
when the input gradient needs any of its outputs. Where B would then compute a weight gradient
itself (its bytes stashed per microbatch), `split` answers None and the caller keeps the whole
pullback for W (`LayerResiduals`, meshtrain/engine/stage_state.py): the same math, one more pass.
"""
from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, Var, jaxpr_as_fun, jaxprs_in_params

# calls whose body is one more run of equations, inlined so that B and W can each take its part
# (a jitted einsum's transpose computes dx and dw in one call)
INLINED = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2")
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


def _bytes(v: Var) -> int:
    return int(v.aval.size) * v.aval.dtype.itemsize


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
        in_b = _needs(eqns, b_outs)
        in_w = _core(eqns, _needs(eqns, w_outs) - in_b)
        in_b = (in_b | _needs(eqns, w_outs)) - in_w
        g_vars = {jaxpr.invars[i] for i in g_inputs}
        in_w |= _recomputed(eqns, in_b, _stash(eqns, in_b, in_w, w_outs, g_vars), g_vars)
        self.stash = _stash(eqns, in_b, in_w, w_outs, g_vars)
        in_b = _needs(eqns, [*b_outs, *self.stash])
        self.b_eqns = [e for i, e in enumerate(eqns) if i in in_b]
        self.w_eqns = [e for i, e in enumerate(eqns) if i in in_w]
        made_in_b = {v for e in self.b_eqns for v in e.outvars}
        # B computes the small parameters' gradients (a norm's scale: a reduction of dy x x_hat) and
        # stashes them; one that outweighs the output cotangent (a weight's, inside an equation kept
        # whole) would cost more memory per microbatch than running the pullback again in W
        stashed_grads = sum(_bytes(a) for a in dict.fromkeys(w_outs) if a in made_in_b)
        self.usable = stashed_grads <= sum(_bytes(v) for v in g_vars) and not any(e.effects for e in eqns)
        # W's inputs: the pullback's, the output cotangent's unread (fresh variables), then the stash
        self.w_invars = [Var(v.aval) if v in g_vars else v for v in jaxpr.invars] + self.stash
        self.jaxpr, self.consts, self.b_outs, self.w_outs = jaxpr, closed.consts, b_outs, w_outs

    def run(self, name: str, invars: list, outvars: list, eqns: list, *args) -> list:
        info = DebugInfo(name, None, tuple(f"in{i}" for i in range(len(invars))),
                         tuple(f"out{i}" for i in range(len(outvars))))
        program = Jaxpr(self.jaxpr.constvars, invars, outvars, eqns, debug_info=info)
        return jaxpr_as_fun(ClosedJaxpr(program, self.consts))(*args)

    def input_grad(self, flat) -> tuple[list, list]:
        """(the input gradient's leaves, the stash) from the pullback's flat inputs."""
        out = self.run("input_grad", self.jaxpr.invars, [*self.b_outs, *self.stash], self.b_eqns, *flat)
        return out[:len(self.b_outs)], out[len(self.b_outs):]

    def weight_grad(self, flat, stash) -> list:
        """The parameters' gradients' leaves from the pullback's flat inputs (the output cotangent's
        unread: any array of its shape) and the stash."""
        return self.run("weight_grad", self.w_invars, self.w_outs, self.w_eqns, *flat, *stash)


class SplitPullback:
    """`pullback(*args)` -> (d params, d input) as B and W (`Split`), from `args` whose `g_arg`-th
    is the output cotangent (a pytree W does not get). `cut` is None where B would compute a weight
    gradient itself: the caller runs the whole pullback in W instead."""

    def __init__(self, pullback, args: tuple, g_arg: int):
        self.structure = jax.tree.structure(args)
        outs = []

        def flat_fn(*flat):
            g_params, g_input = pullback(*jax.tree.unflatten(self.structure, flat))
            outs[:] = [jax.tree.structure(g_params), jax.tree.structure(g_input)]
            return [*jax.tree.leaves(g_params), *jax.tree.leaves(g_input)]

        closed = jax.make_jaxpr(flat_fn)(*jax.tree.leaves(args))
        self.params_tree, self.input_tree = outs
        start = sum(len(jax.tree.leaves(a)) for a in args[:g_arg])
        cut = Split(closed, self.params_tree.num_leaves, range(start, start + len(jax.tree.leaves(args[g_arg]))))
        self.cut = cut if cut.usable else None

    def input_grad(self, args):
        """(d input, the stash: a list of arrays)."""
        g_input, stash = self.cut.input_grad(jax.tree.leaves(args))
        return jax.tree.unflatten(self.input_tree, g_input), stash

    def weight_grad(self, args, stash):
        """d params; `args`' output cotangent is not read (any array of its shape)."""
        return jax.tree.unflatten(self.params_tree, self.cut.weight_grad(jax.tree.leaves(args), stash))
