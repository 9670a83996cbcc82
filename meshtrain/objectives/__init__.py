"""Training objectives, chosen by train.objective: each one module declaring an `Objective`
(objectives/base.py: its rows, its per-microbatch loss and metrics, its pipeline head, its
evaluation), registered in `OBJECTIVES`. The executors (meshtrain/engine/step.py, the data-parallel
shard_map, the pipeline) call the protocol and name no objective (docs/layout.md "Adding an objective").
- next_token.py: `sft`, next-token cross-entropy (chat data's loss mask, multi-token prediction).
- dpo.py: `dpo`, direct preference optimisation against a frozen reference.
- grpo.py: `grpo`, reinforcement learning from rewards (rewards.py) on the trainer's own rollouts.
"""
from __future__ import annotations

from meshtrain.core.errors import UserError
from meshtrain.data.tokens import DATA_KINDS
from meshtrain.objectives.base import Microbatch, Objective
from meshtrain.objectives.dpo import DPO
from meshtrain.objectives.grpo import GRPO
from meshtrain.objectives.next_token import NextToken

OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (NextToken, DPO, GRPO)}


def objective(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise UserError(f"train.objective={name!r} is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def check_data(name: str, mix) -> None:
    """Every source of the data mixture `mix` holds what objective `name` trains on (its `reads`): SFT
    on preference pairs would train both responses as answers, DPO on chat data has no pairs."""
    reads = OBJECTIVES[name].reads
    for i, (source, kind) in enumerate(zip(mix.sources, mix.kinds)):
        if kind in reads:
            continue
        where = f"data.path {source.path}" if len(mix.sources) == 1 else f"data.sources[{i}] ({source.path})"
        others = [o for o, cls in OBJECTIVES.items() if kind in cls.reads]
        fix = f"set train.objective={others[0]}, or " if others else ""
        raise UserError(f"{where} holds {DATA_KINDS[kind]}; train.objective={name} trains on "
                        f"{' or '.join(DATA_KINDS[k] for k in reads)}: {fix}prepare the data for it "
                        f"(python -m meshtrain.data prepare)")


__all__ = ["OBJECTIVES", "Microbatch", "Objective", "check_data", "objective"]
