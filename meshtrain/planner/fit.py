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
  layers, context with ring attention); MoE: to `expert`;
- speed moves: the same in reverse.
Offload (remat=offload) needs a GPU's host memory space and is not compiled here.

`search` is a local search: from the config's layout it follows the memory moves, compiled, to the
fitting neighbour with the shortest step (or, while none fits, to the neighbour with the smallest
peak), then the speed moves while one is faster and still fits; at most `budget` compiles.
"""
from __future__ import annotations

import dataclasses

from meshtrain.core.errors import UserError
from meshtrain.parallel.mesh import AXES, describe

MESH_MOVES = [("data", "fsdp"), ("data", "tensor"), ("fsdp", "tensor"), ("data", "pipeline"), ("fsdp", "pipeline"),
              ("data", "context"), ("fsdp", "context"), ("data", "expert"), ("fsdp", "expert")]
REMAT_ORDER = ("none", "save_matmuls", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The searched settings: mesh sizes and ParallelPlan values."""
    sizes: tuple  # (axis, size) pairs in mesh.AXES order
    zero: int
    remat: str
    microbatches: int
    attention: str

    @classmethod
    def of(cls, cfg, sizes: dict) -> Layout:
        par = cfg.parallel
        return cls(tuple((a, sizes[a]) for a in AXES), par.zero, par.remat, par.num_microbatches(sizes["pipeline"]),
                   par.attention)

    @property
    def mesh(self) -> dict:
        return dict(self.sizes)

    def settings(self) -> dict:
        """The config keys this layout sets."""
        return {"parallel.mesh": ",".join(f"{a}={s}" for a, s in self.sizes if s > 1) or "data=1",
                "parallel.zero": self.zero, "parallel.remat": self.remat,
                "parallel.microbatches": self.microbatches, "parallel.attention": self.attention}

    def apply(self, cfg):
        par = dataclasses.replace(cfg.parallel, mesh=self.settings()["parallel.mesh"], zero=self.zero,
                                  remat=self.remat, microbatches=self.microbatches, attention=self.attention)
        return dataclasses.replace(cfg, parallel=par)

    def change(self, **values) -> Layout:
        return dataclasses.replace(self, **values)


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)


def moves(layout: Layout, model, seq_len: int, devices_per_node: int, memory: bool = True):
    """(what changes, the new Layout) for each move that saves memory (`memory`) or time; whether
    a move is valid for the model and batch is left to the program's own checks."""
    out = []
    mesh = layout.mesh
    step = (lambda a, b: (a, b)) if memory else (lambda a, b: (b, a))
    for donor, taker in (step(a, b) for a, b in MESH_MOVES):
        if mesh[donor] == 1 or (taker == "expert" and not getattr(model, "num_experts", 0)):
            continue
        f = _smallest_factor(mesh[donor])
        if taker == "tensor" and mesh["tensor"] * f > devices_per_node:
            continue
        new = {**mesh, donor: mesh[donor] // f, taker: mesh[taker] * f}
        attention = "ring" if new["context"] > 1 else ("blockwise" if layout.attention == "ring" else layout.attention)
        out.append((f"{donor} -> {taker} x{f}", layout.change(sizes=tuple(new.items()), attention=attention)))
    micro = layout.microbatches * 2 if memory else layout.microbatches // 2
    if micro >= 1 and micro >= mesh["pipeline"] and micro != layout.microbatches:
        out.append((f"parallel.microbatches={micro}", layout.change(microbatches=micro)))
    r = REMAT_ORDER.index(layout.remat) if layout.remat in REMAT_ORDER else None
    if r is not None and 0 <= r + (1 if memory else -1) < len(REMAT_ORDER):
        remat = REMAT_ORDER[r + (1 if memory else -1)]
        out.append((f"parallel.remat={remat}", layout.change(remat=remat)))
    zero = layout.zero + (1 if memory else -1)
    if mesh["data"] > 1 and 0 <= zero <= 3:
        out.append((f"parallel.zero={zero}", layout.change(zero=zero)))
    swap = {"xla": "blockwise"} if memory else {"blockwise": "xla"}
    if layout.attention in swap and mesh["context"] == 1:
        out.append((f"parallel.attention={swap[layout.attention]}", layout.change(attention=swap[layout.attention])))
    return out


def evaluate(cfg, layout: Layout, profile: dict, memory_budget: dict, devices_per_node=None,
             devices=None, *, measure) -> dict | None:
    """The layout's train step compiled by `measure` ((cfg, profile, devices_per_node, devices) ->
    the step's plan: aot.py's `train_step_plan`): its peak per device, whether it fits the budget,
    and its roofline step time; None (with the reason) when the program refuses the layout."""
    try:
        r = measure(layout.apply(cfg), profile, devices_per_node, devices)
    except UserError as e:
        return {"layout": layout, "invalid": str(e)}
    peak = r["memory"]["total"]
    return {"layout": layout, "peak": peak, "fits": peak <= memory_budget["budget"], "step_s": r["roofline"]["step_s"],
            "mfu_ceiling": r["roofline"]["mfu_ceiling"]}


def search(cfg, sizes: dict, profile: dict, memory_budget: dict, budget: int = 12, devices_per_node=None,
           known: dict | None = None, devices=None, *, measure) -> dict:
    """Local search (module doc) from the config's layout, at most `budget` compiles by `measure`
    (`evaluate`; `known`: layouts already evaluated; `devices`: the compiler's,
    meshtrain/planner/compilers.py). Returns the best fitting candidate found (None if none), every
    candidate compiled, and the moves taken."""
    per_node = devices_per_node or profile["devices_per_node"]
    seen: dict[Layout, dict] = dict(known or {})
    limit = budget + len(seen)

    def score(layout):
        if layout not in seen and len(seen) < limit:
            seen[layout] = evaluate(cfg, layout, profile, memory_budget, devices_per_node, devices, measure=measure)
        return seen.get(layout)

    current, path = score(Layout.of(cfg, sizes)), []
    for memory in (True, False):  # first to a fitting layout, then faster while it still fits
        while "invalid" not in current and current["fits"] != memory and len(seen) < limit:
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
    fitting = [r for r in seen.values() if r.get("fits")]
    return {"best": min(fitting, key=lambda r: r["step_s"]) if fitting else None,
            "compiled": [r for layout, r in seen.items() if layout not in (known or {})], "path": path}


def command(config_path: str, overrides: list[str], base: Layout, layout: Layout) -> str:
    """`python -m meshtrain.train` for the layout: the config, the user's --set items, then the
    settings where the layout differs from `base` (the config's own)."""
    theirs = layout.settings()
    sets = [o for o in overrides if o.split("=", 1)[0] not in theirs]
    sets += [f"{k}={v}" for k, v in theirs.items() if k != "parallel.mesh" and base.settings()[k] != v]
    return " ".join([f"python -m meshtrain.train --config {config_path} --mesh {theirs['parallel.mesh']}"]
                    + [f"--set {s}" for s in sets])


def describe_layout(layout: Layout) -> str:
    return (f"{describe(layout.mesh)}, zero={layout.zero}, remat={layout.remat}, "
            f"{layout.microbatches} microbatch(es), attention={layout.attention}")
