"""A run's state on disk: the persistent checkpoints (meshtrain/run/checkpoint.py) and the local tier
(checkpoint.local_dir, meshtrain/run/local_tier.py), what a checkpoint holds of the state, and the
checks and conversions a resume makes. A LoRA run's checkpoint holds its adapters alone; the frozen
base is recorded by pointer and hash (meshtrain/run/run_dir.py `base_record`) and rebuilt on every
read. A checkpoint resumes on any mesh (elastic); an interleaved pipeline's storage order of the
stacked layers is converted to this run's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from meshtrain.config.loader import UserError
from meshtrain.core.folders import writable
from meshtrain.models import make_spec
from meshtrain.ops.optimizers import map_param_states
from meshtrain.ops.trainable import merge, select
from meshtrain.parallel.mesh import describe
from meshtrain.run import run_dir
from meshtrain.run.checkpoint import Checkpointer, abstract_like
from meshtrain.run.local_tier import LocalTier, run_folder, run_id


@dataclass
class Restored:
    """A state read back: its step, the state in this run's layout, the checkpoint's metadata, and
    where it came from (a folder; `tier` names the local tier)."""
    step: int
    state: dict
    meta: dict
    where: Path
    tier: str


class StateStore:
    def __init__(self, cfg, program, out: Path):
        """`program`: the run's TrainProgram; `out`: the run folder (its checkpoints/)."""
        self.cfg, self.program, self.out = cfg, program, out
        self.checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint.keep, owner=True)
        self.local_tier = None  # checkpoint.local_dir: made with the run's id (run_dir) by `local`
        if cfg.checkpoint.local_dir:  # before any compile: a folder no process can write is one error
            writable(run_folder(cfg.checkpoint.local_dir, out), "checkpoint.local_dir")
        self.base_record = None  # a LoRA run's: its frozen base's pointer and hash (run_dir.base_record)

    def local(self) -> LocalTier | None:
        """The local tier of this run, once run.json names the run (its first start); None without one."""
        c = self.cfg.checkpoint
        if c.local_dir and self.local_tier is None:
            owner = run_id(run_dir.read_record(self.out))
            if owner is not None:
                self.local_tier = LocalTier(run_folder(c.local_dir, self.out), c.local_keep, owner)
        return self.local_tier

    def frozen(self, path) -> bool:
        return not self.cfg.model.trainable(path)

    def stored(self, state):
        """What a checkpoint holds of `state` (or of a tree like it): a LoRA run's parameters are its
        adapters alone."""
        return {**state, "params": self.program.trained(state["params"])} if self.cfg.model.lora.rank else state

    def record_base(self, params) -> None:
        """A LoRA run's base record, from the frozen part of its parameters (unless a resume read it)."""
        if self.cfg.model.lora.rank and self.base_record is None:
            self.base_record = run_dir.base_record(self.cfg, select(params, self.frozen))

    def save(self, state, meta: dict, wait: bool = False) -> Path:
        self.checkpointer.save(self.stored(state), self.with_base(meta))
        if wait:
            self.checkpointer.wait()
        return self.checkpointer.path(int(state["step"]))

    def save_local(self, state, meta: dict) -> None:
        """Save to the local tier; returns once this process's shards are on the host."""
        self.local().save(self.stored(state), self.with_base(meta), describe(self.program.sizes))

    def with_base(self, meta: dict) -> dict:
        return {**meta, "base": self.base_record} if self.base_record else meta

    def read(self, root: Path | None, steps: list[int], params=None) -> Restored | None:
        """The newest intact checkpoint among `steps` (in `root`) read straight into this mesh's
        shardings, or the local tier's newest when it is newer (same mesh only); None when neither
        has one. `params`: the run's current parameters, whose frozen base a LoRA rollback keeps."""
        p = self.program
        abstract = self.stored(abstract_like(p.abstract_state, p.state_shardings))
        local = self.local()
        found = local.restore_newer(steps[0] if steps else -1, abstract, describe(p.sizes)) if local else None
        if found is not None:
            step, state, meta = found
            where, tier = local.path(step), "local tier, "
        elif not steps:
            return None
        else:
            reader = self.checkpointer if root == self.checkpointer.directory else Checkpointer(root, keep=1000)
            step, state, meta = reader.restore_latest_intact(steps, abstract, self.check_same_model, p.optional_state())
            where, tier = reader.path(step), ""
        saved_order = np.asarray(meta.get("layer_order", range(self.cfg.model.stacked_layers())))
        if not np.array_equal(saved_order, p.layer_order):
            state = self.reorder_layers(state, saved_order)
        if self.cfg.model.lora.rank:  # the checkpoint holds the adapters: the frozen base joins them
            state = {**state, "params": merge(self.base(meta, params), state["params"])}
        return Restored(step, state, meta, where, tier)

    def base(self, meta, params=None) -> dict:
        """The frozen base in storage order: that of `params` (a rollback), else rebuilt from the
        checkpoint's record and checked against its hash (elastic: on this mesh)."""
        p = self.program
        if params is not None:
            return select(params, self.frozen)
        base = run_dir.lora_base(meta, p.model, p.state_shardings["params"])
        self.base_record = meta["base"]
        return {**base, "blocks": p.reorder_blocks(base["blocks"], p.layer_order)}

    def check_same_model(self, meta, folder) -> None:
        """Resume needs the same weights' definition (architecture, resolved); everything about how the
        run executes or learns may change."""
        saved = make_spec(meta["config"]["model"])
        differ = self.cfg.model.architecture_difference(saved, "this run", f"checkpoint {folder}")
        own = Path(folder).parent == self.checkpointer.directory  # --resume never refuses those
        fresh = "use a new --out for a new run" if own else "pass --resume never to start fresh in --out"
        if differ:
            raise UserError(f"{differ}; {fresh}, or use the checkpoint's model config")
        optimizer = meta["config"].get("optim", {}).get("optimizer", "adamw")  # earlier versions: AdamW
        if optimizer != self.cfg.optim.optimizer:  # another state layout
            raise UserError(f"checkpoint {folder} holds the state of optim.optimizer={optimizer}, this run has "
                            f"{self.cfg.optim.optimizer}; resume with optim.optimizer={optimizer}, or {fresh} "
                            f"(checkpoint.init_from takes a run's weights with a fresh optimizer)")

    def reorder_layers(self, state, saved_order):
        """Move stacked layers from a checkpoint's storage order (interleaved pipelines store each
        device's chunks together) into this run's."""
        p = self.program
        rows = np.argsort(saved_order)[p.layer_order]
        move = lambda x, names: x[rows] if names and names[0] == "layers" else x
        is_names = lambda n: isinstance(n, tuple)

        def reorder(state):  # a checkpoint's state: with LoRA, of the adapters alone
            axes = p.trained(p.logical_axes)
            params = jax.tree.map(move, state["params"], axes, is_leaf=is_names)
            opt_state = map_param_states(lambda x, _, names: move(x, names), state["opt_state"], state["params"], axes)
            return {**state, "params": params, "opt_state": opt_state}

        state = jax.jit(reorder, out_shardings=self.stored(p.state_shardings))(state)
        if "grad_error" in state:  # compression residuals of the old order: they start fresh
            state["grad_error"] = p.optional_state()["grad_error"]()
        return state
