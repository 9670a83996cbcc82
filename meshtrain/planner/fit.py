"""Search the plan's knobs for a layout that fits, the fastest one found: `python -m meshtrain.plan
--fit`, and the "would fit" list a plan that does not fit prints.

Every candidate is compiled (`evaluate`: the train step's memory as meshtrain/planner/aot.py reads it,
its roofline step time), never guessed. The compile is the caller's `measure` (aot.py's `train_step_plan`,
passed in by aot.py's `run`), so this module imports nothing of the planner's: aot.py uses it, not the
other way round. The knobs, one move at a time (`moves`):
- memory moves: twice the microbatches; remat none -> save_matmuls -> full; a higher ZeRO stage
  (with a data axis); blockwise attention in place of xla (no [L, L] scores); a factor of 2 (or the
  axis's smallest prime) moved from `data` to fsdp, tensor, pipeline or context, or from fsdp to
  tensor, pipeline or context (tensor within a node and dividing the heads, pipeline dividing the
  layers; a context axis opened twice, with the ring and with Ulysses around the layout's local
  kernel, one that grows keeps its strategy); MoE: to `expert`;
- speed moves: the same in reverse, with every lower ZeRO stage at once (one stage lower may gain
  nothing where two do), and a move that opens the `data` axis also with ZeRO 0 on it: hybrid
  sharding (HSDP: fsdp's gathers within the nodes, one gradient all-reduce across them); MoE: to
  `expert` as well as from it (expert parallelism gathers no expert weights but dispatches the tokens:
  either may be faster);
- parallel.gather_once true -> false (a memory move; the other way a speed move), with microbatches,
  no pipeline and fsdp or context > 1: one gather of the compute-dtype weights for all the microbatches;
- parallel.offload none -> optimizer -> optimizer+params (a memory move; back as a speed move): the
  state in host memory, slower by its copies (meshtrain/ops/offload.py), so the search takes it
  where no faster move fits, and a candidate fits only if its host memory fits too.
Activation offload (remat=offload) needs a GPU's host memory space and is not compiled here.

`search` is a local search: from the config's layout it follows the memory moves, compiled, to the
fitting neighbour with the shortest step (or, while none fits, to the neighbour with the smallest
peak), then the speed moves while one is faster and still fits; at most `budget` compiles. Where the
config's own layout is invalid on the device count (a mesh for other devices, a batch the data axis
does not divide), it starts from the valid layout nearest to it (`valid_layouts`).
"""
from __future__ import annotations

import dataclasses
import math

from jax.errors import JaxRuntimeError

from meshtrain.config.spec import ParallelPlan
from meshtrain.config.validate import check_layout, resolve_attention
from meshtrain.core.errors import UserError, first_line
from meshtrain.parallel.mesh import AXES, axis_sizes, describe
from meshtrain.parallel.sharding import make_rules

MESH_MOVES = [("data", "fsdp"), ("data", "tensor"), ("fsdp", "tensor"), ("data", "pipeline"), ("fsdp", "pipeline"),
              ("data", "context"), ("fsdp", "context"), ("data", "expert"), ("fsdp", "expert")]
REMAT_ORDER = ("none", "save_matmuls", "full")
OFFLOAD_ORDER = ("none", "optimizer", "optimizer+params")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The searched settings: mesh sizes and ParallelPlan values."""
    sizes: tuple  # (axis, size) pairs in mesh.AXES order
    zero: int
    remat: str
    microbatches: int
    attention: str
    context_strategy: str = "ring"
    ulysses_degree: int = 0
    offload: str = "none"
    gather_once: bool = False

    @classmethod
    def of(cls, cfg, sizes: dict) -> Layout:
        par = cfg.parallel
        return cls(tuple((a, sizes[a]) for a in AXES), par.zero, par.remat, par.num_microbatches(sizes["pipeline"]),
                   par.attention, par.context_strategy, par.ulysses_degree, par.offload,
                   par.gather_once).effective()

    def gathers_once_here(self) -> bool:
        """Whether gather_once would apply on this layout (ParallelPlan.gathers_once)."""
        return ParallelPlan(microbatches=self.microbatches, gather_once=True).gathers_once(self.mesh)

    def effective(self) -> Layout:
        """This layout with gather_once off where it would do nothing: one program, one layout."""
        return self if not self.gather_once or self.gathers_once_here() else \
            dataclasses.replace(self, gather_once=False)

    @property
    def mesh(self) -> dict:
        return dict(self.sizes)

    def settings(self) -> dict:
        """The config keys this layout sets."""
        return {"parallel.mesh": ",".join(f"{a}={s}" for a, s in self.sizes if s > 1) or "data=1",
                "parallel.zero": self.zero, "parallel.remat": self.remat,
                "parallel.microbatches": self.microbatches, "parallel.attention": self.attention,
                "parallel.context_strategy": self.context_strategy, "parallel.ulysses_degree": self.ulysses_degree,
                "parallel.offload": self.offload, "parallel.gather_once": self.gather_once}

    def apply(self, cfg):
        par = dataclasses.replace(cfg.parallel, mesh=self.settings()["parallel.mesh"], zero=self.zero,
                                  remat=self.remat, microbatches=self.microbatches, attention=self.attention,
                                  context_strategy=self.context_strategy, ulysses_degree=self.ulysses_degree,
                                  offload=self.offload, gather_once=self.gather_once)
        return dataclasses.replace(cfg, parallel=par)

    def change(self, **values) -> Layout:
        return dataclasses.replace(self, **values).effective()


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)


def local_kernel(layout: Layout) -> str:
    """The layout's attention kernel on whole sequences: blockwise where it runs the ring."""
    return "blockwise" if layout.attention == "ring" else layout.attention


def resized(layout: Layout, new: dict) -> list[tuple[str, Layout]]:
    """The layouts on mesh sizes `new` (from `layout`'s): a context axis opened runs the ring or
    Ulysses around the local kernel (the two are priced apart: the ring passes K/V blocks round
    the axis, Ulysses all-to-alls q, k, v and the output once per layer); a context axis that stays
    keeps its strategy (a hybrid degree that no longer divides is the program's check to refuse);
    one closed leaves the local kernel."""
    sized = layout.change(sizes=tuple(new.items()))
    if new["context"] == 1:
        return [("", sized.change(attention=local_kernel(layout), context_strategy="ring", ulysses_degree=0))]
    if layout.mesh["context"] > 1:
        return [("", sized)]
    return [("", sized.change(attention="ring", context_strategy="ring")),
            (" (ulysses)", sized.change(attention=local_kernel(layout), context_strategy="ulysses"))]


def moves(layout: Layout, model, seq_len: int, devices_per_node: int, memory: bool = True):
    """(what changes, the new Layout) for each move that saves memory (`memory`) or time; whether
    a move is valid for the model and batch is left to the program's own checks."""
    out = []
    mesh = layout.mesh
    step = (lambda a, b: (a, b)) if memory else (lambda a, b: (b, a))
    pairs = [step(a, b) for a, b in MESH_MOVES]
    if not memory:  # MoE: to `expert` both ways, it trades the expert weights' gathers for the dispatch
        pairs += [(a, b) for a, b in MESH_MOVES if b == "expert"]
    for donor, taker in pairs:
        if mesh[donor] == 1 or (taker == "expert" and not model.routed_experts()):
            continue
        f = _smallest_factor(mesh[donor])
        if taker == "tensor" and mesh["tensor"] * f > devices_per_node:
            continue
        new = {**mesh, donor: mesh[donor] // f, taker: mesh[taker] * f}
        out += [(f"{donor} -> {taker} x{f}{how}", moved) for how, moved in resized(layout, new)]
        if not memory and taker == "data" and mesh["data"] == 1 and layout.zero:  # hybrid sharding (HSDP)
            out += [(f"{donor} -> {taker} x{f}{how}, parallel.zero=0", moved.change(zero=0))
                    for how, moved in resized(layout, new)]
    micro = layout.microbatches * 2 if memory else layout.microbatches // 2
    if micro >= 1 and micro >= mesh["pipeline"] and micro != layout.microbatches:
        out.append((f"parallel.microbatches={micro}", layout.change(microbatches=micro)))
    r = REMAT_ORDER.index(layout.remat) if layout.remat in REMAT_ORDER else None
    if r is not None and 0 <= r + (1 if memory else -1) < len(REMAT_ORDER):
        remat = REMAT_ORDER[r + (1 if memory else -1)]
        out.append((f"parallel.remat={remat}", layout.change(remat=remat)))
    if mesh["data"] > 1:  # a stage higher; or any lower one (a stage alone may gain nothing)
        for zero in [layout.zero + 1] if memory else range(layout.zero):
            if zero <= 3:
                out.append((f"parallel.zero={zero}", layout.change(zero=zero)))
    if layout.gather_once == memory and layout.gathers_once_here():  # one gather for all the microbatches, or each
        out.append((f"parallel.gather_once={str(not memory).lower()}", layout.change(gather_once=not memory)))
    o = OFFLOAD_ORDER.index(layout.offload) + (1 if memory else -1)
    if 0 <= o < len(OFFLOAD_ORDER):
        out.append((f"parallel.offload={OFFLOAD_ORDER[o]}", layout.change(offload=OFFLOAD_ORDER[o])))
    swap = {"xla": "blockwise"} if memory else {"blockwise": "xla"}
    if layout.attention in swap and (mesh["context"] == 1 or layout.context_strategy == "ulysses"):
        out.append((f"parallel.attention={swap[layout.attention]}", layout.change(attention=swap[layout.attention])))
    return out


def _factorizations(n: int, axes: tuple) -> list[dict]:
    """Every way to write n as a product of one size per axis in `axes`."""
    if len(axes) == 1:
        return [{axes[0]: n}]
    return [{axes[0]: f, **rest} for f in range(1, n + 1) if n % f == 0
            for rest in _factorizations(n // f, axes[1:])]


def valid_layouts(cfg, devices: int, devices_per_node: int, backend: str) -> list[Layout]:
    """The layouts valid for the model, batch and device count (meshtrain/config/validate.py
    `check_layout`; tensor within a node), nearest the config's first: the config's own when it is
    valid. Near is sum |log2(size / wanted size)| over the mesh axes and the microbatches, the
    wanted sizes the config's (its -1 axis the rest of `devices`, fractional when they do not
    divide); of two as near, the one with fewer axes the config leaves at 1. The zero stage and
    remat policy are the config's; context > 1 takes the config's context strategy (its local kernel
    under Ulysses), the ring where the config has none (a context axis of 1)."""
    par, t = cfg.parallel, cfg.train
    wanted = axis_sizes(par.mesh)
    named = math.prod(s for s in wanted.values() if s != -1)
    wanted = {a: devices / named if s == -1 else s for a, s in wanted.items()}
    wanted_micro = par.num_microbatches(max(1, round(wanted["pipeline"])))
    rules = make_rules(par.rules, par.sequence_parallel)
    axes = AXES if cfg.model.routed_experts() else tuple(a for a in AXES if a != "expert")
    found = []
    for mesh in _factorizations(devices, axes):
        sizes = {a: mesh.get(a, 1) for a in AXES}
        if sizes["tensor"] > devices_per_node:
            continue
        strategy, attention = par.context_strategy, par.attention
        if sizes["context"] > 1:
            strategy = strategy if wanted["context"] > 1 else "ring"  # the config has no context axis
            attention = attention if strategy == "ulysses" else "ring"
        degree = par.ulysses_degree if strategy == "hybrid" else 0
        rows = t.batch_size // math.prod(sizes[a] for a in rules["batch"])
        for micro in (m for m in range(1, rows + 1) if rows % m == 0):
            layout = Layout(tuple(sizes.items()), par.zero, par.remat, micro, attention, strategy, degree,
                            par.offload, par.gather_once).effective()
            try:
                par_here = resolve_attention(cfg.model, layout.apply(cfg).parallel, t.seq_len, sizes, backend,
                                             cfg.data.document_mask)[0]
                check_layout(cfg.model, par_here, t, sizes, rules, backend)
            except UserError:
                continue
            far = sum(abs(math.log2(sizes[a] / wanted[a])) for a in AXES) + abs(math.log2(micro / wanted_micro))
            new_axes = sum(sizes[a] > 1 and wanted[a] <= 1 for a in AXES)
            found.append(((far, new_axes, layout.sizes, micro), layout))
    return [layout for _, layout in sorted(found, key=lambda f: f[0])]


def evaluate(cfg, layout: Layout, profile: dict, memory_budget: dict, devices_per_node=None,
             devices=None, *, measure) -> dict | None:
    """The layout's train step compiled by `measure` ((cfg, profile, devices_per_node, devices) ->
    the step's plan: aot.py's `train_step_plan`): its peak per device, whether it fits the budget,
    and its roofline step time; None (with the reason) when the program refuses the layout."""
    try:
        r = measure(layout.apply(cfg), profile, devices_per_node, devices)
    except UserError as e:
        return {"layout": layout, "invalid": str(e)}
    except JaxRuntimeError as e:  # a layout XLA's compiler refuses: the search goes on without it
        return {"layout": layout, "invalid": first_line(e)[:300]}
    peak, host = r["memory"]["total"], r["memory"].get("host_total", 0)
    host_fits = not host or host <= memory_budget.get("host", {}).get("budget", 0)
    return {"layout": layout, "peak": peak, "fits": peak <= memory_budget["budget"] and host_fits,
            "step_s": r["roofline"]["step_s"],
            "mfu_ceiling": r["roofline"]["mfu_ceiling"], "priced_by": r["roofline"]["priced_by"]}


def search(cfg, starts: list[Layout], profile: dict, memory_budget: dict, budget: int = 12, devices_per_node=None,
           known: dict | None = None, devices=None, *, measure) -> dict:
    """Local search (module doc) from the first of `starts` (`valid_layouts`) that compiles, at most
    `budget` compiles by `measure` (`evaluate`; `known`: layouts already evaluated; `devices`: the
    compiler's, meshtrain/planner/compilers.py, the plan's own). Returns the best fitting candidate
    found (None if none), the next fastest that fits (None if none), every candidate compiled, and the
    moves taken."""
    per_node = devices_per_node or profile["devices_per_node"]
    seen: dict[Layout, dict] = dict(known or {})
    limit = budget + len(seen)

    def score(layout):
        if layout not in seen and len(seen) < limit:
            seen[layout] = evaluate(cfg, layout, profile, memory_budget, devices_per_node, devices, measure=measure)
        return seen.get(layout)

    current, path = None, []
    for layout in starts:  # a start the program refuses (a layout check_layout cannot see) gives way
        current = score(layout)
        if current is None or "invalid" not in current:
            break
    for memory in (True, False):  # first to a fitting layout, then faster while it still fits
        while current and "invalid" not in current and current["fits"] != memory and len(seen) < limit:
            options = [(what, score(layout)) for what, layout in
                       moves(current["layout"], cfg.model, cfg.train.seq_len, per_node, memory)]
            options = [(what, r) for what, r in options if r is not None and "invalid" not in r]
            fits = [(what, r) for what, r in options if r["fits"]]
            if fits:
                what, best = min(fits, key=lambda o: o[1]["step_s"])
                if not memory and best["step_s"] >= current["step_s"]:
                    break
            elif memory and options:
                what, best = min(options, key=lambda o: o[1]["peak"])
                if best["peak"] >= current["peak"]:
                    break
            else:
                break
            path.append(what)
            current = best
    fitting = sorted((r for r in seen.values() if r.get("fits")), key=lambda r: r["step_s"])
    return {"best": fitting[0] if fitting else None, "runner_up": fitting[1] if len(fitting) > 1 else None,
            "compiled": [r for layout, r in seen.items() if layout not in (known or {})], "path": path}


def command(config_path: str, overrides: list[str], cfg, layout: Layout) -> str:
    """`python -m meshtrain.train` for the layout: the config, the user's --set items, then the
    settings where the layout differs from the config's (`cfg`: the config as the plan read it) or
    replaces a --set item."""
    theirs, own = layout.settings(), Layout.of(cfg, layout.mesh).settings()  # own: the config's, on this mesh
    typed = {o.split("=", 1)[0].strip() for o in overrides}
    sets = [o for o in overrides if o.split("=", 1)[0].strip() not in theirs]
    yaml = lambda v: str(v).lower() if isinstance(v, bool) else v
    sets += [f"{k}={yaml(v)}" for k, v in theirs.items() if k != "parallel.mesh" and (own[k] != v or k in typed)]
    return " ".join([f"python -m meshtrain.train --config {config_path} --mesh {theirs['parallel.mesh']}"]
                    + [f"--set {s}" for s in sets])


def describe_layout(layout: Layout) -> str:
    strategy = "" if layout.mesh["context"] == 1 else f", context_strategy={layout.context_strategy}" + (
        f", ulysses_degree={layout.ulysses_degree}" if layout.context_strategy == "hybrid" else "")
    offloaded = f", offload={layout.offload}" if layout.offload != "none" else ""
    once = ", gather_once" if layout.gather_once else ""
    return (f"{describe(layout.mesh)}, zero={layout.zero}, remat={layout.remat}, "
            f"{layout.microbatches} microbatch(es){once}, attention={layout.attention}{strategy}{offloaded}")
