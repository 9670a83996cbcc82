"""Training objectives, chosen by train.objective: each one module declaring an `Objective`
(objectives/base.py: its rows, its per-microbatch loss and metrics, its pipeline head, its
evaluation), registered in `OBJECTIVES`. The executors (meshtrain/engine/step.py, the data-parallel
shard_map, the pipeline) call the protocol and name no objective (docs/layout.md "Adding an objective").
- next_token.py: `sft`, next-token cross-entropy (chat data's loss mask, multi-token prediction).
- dpo.py: `dpo`, direct preference optimisation against a frozen reference.
"""
from __future__ import annotations

from meshtrain.core.errors import UserError
from meshtrain.objectives.base import Microbatch, Objective
from meshtrain.objectives.dpo import DPO
from meshtrain.objectives.next_token import NextToken

OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (NextToken, DPO)}


def objective(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise UserError(f"train.objective={name!r} is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


__all__ = ["OBJECTIVES", "Microbatch", "Objective", "objective"]
