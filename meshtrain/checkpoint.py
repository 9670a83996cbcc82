"""Thin wrapper over Orbax: async saves, retention, restore onto any mesh.

A checkpoint holds the train state ({'step', 'params', 'opt_state'}) and metadata (the resolved
config and the mesh it was saved on). The data position needs no saving: the batch of step k
depends only on (seed, k), and `step` is k. Orbax writes each step into a temporary folder and
renames it when complete, so an interrupted save is never listed as a checkpoint.
Restoring reads each array straight into the shardings of the current mesh (resharding on load),
so a run saved on fsdp=8 continues on data=2,tensor=2 with 4 devices.
"""
from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from meshtrain.config import UserError


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state, metadata: dict) -> None:
        """Start an async save of `state` at its step; returns once the arrays are copied off-device."""
        step = int(state["step"])
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        metadata=ocp.args.JsonSave(metadata)), force=True)

    def wait(self) -> None:
        """Block until every started save is durable on disk."""
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state):
        """Restore `step` into the shardings carried by `abstract_state` (jax.ShapeDtypeStructs)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), metadata=ocp.args.JsonRestore()))
        return restored["state"], restored["metadata"]

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def close(self) -> None:
        self.manager.close()


def abstract_like(state_shapes, shardings):
    """ShapeDtypeStructs carrying the target shardings, for restore."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_shapes, shardings)


def resolve_resume(resume: str, out_dir: Path) -> tuple[Path | None, int | None]:
    """(checkpoint root, step) to resume from, or (None, None) to start fresh."""
    if resume == "never":
        return None, None
    if resume == "auto":
        root = out_dir / "checkpoints"
        step = _latest_complete_step(root)
        return (root, step) if step is not None else (None, None)
    path = Path(resume)
    if path.is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    step = _latest_complete_step(path)
    if step is not None:
        return path, step
    raise UserError(f"checkpoint.resume={resume!r} is not a checkpoint folder; pass <out>/checkpoints or "
                    f"<out>/checkpoints/<step>, or auto / never")


def _latest_complete_step(root: Path) -> int | None:
    """Newest step folder under `root`; Orbax's in-progress saves carry a non-numeric tmp suffix."""
    if not root.is_dir():
        return None
    steps = [int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(steps, default=None)
