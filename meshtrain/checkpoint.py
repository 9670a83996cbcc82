"""Thin wrapper over Orbax: async saves, retention, integrity, restore onto any mesh.

A checkpoint holds the train state ({'step', 'params', 'opt_state', 'skipped_steps'}) and
metadata: the resolved config, the mesh it was saved on, the batches the nonfinite guard skipped,
and a checksum per state leaf. The data position needs no saving beyond that: the batch of step k
depends only on (seed, k, skipped batches).

Integrity: Orbax writes each step into a temporary folder and renames it when complete, so an
interrupted save is never listed. Once a save is durable, a manifest records the size of each of
its files. Damaged files are caught on restore: by the manifest (missing or truncated files), by
Orbax failing to decode them, or by the checksums disagreeing; the damaged step is renamed `<step>.damaged` (kept for
inspection, never loaded again) and the previous one is tried, with a warning naming the bad one.

Restoring reads each array straight into the shardings of the current mesh (resharding on load),
so a run saved on fsdp=8 continues on data=2,tensor=2 with 4 devices.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from meshtrain.config import UserError

MANIFEST = "meshtrain_manifest.json"


@jax.jit
def checksums(state) -> list:
    """Per leaf: the sum of its raw bits as uint32, wrapping. Integer addition is exact and order-free,
    so the value does not depend on the mesh the state is sharded over; any flipped bit changes it."""
    def leaf_sum(x):
        bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize])
        return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)

    return [leaf_sum(x) for x in jax.tree.leaves(state)]


def state_checksums(state) -> list[int]:
    return [int(c) for c in jax.device_get(checksums(state))]


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifests))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def _write_manifests(self) -> None:
        """After a save is durable: record every file's size, so truncated or missing files are
        caught before Orbax reads them."""
        if jax.process_index() != 0:
            return
        for step in complete_steps(self.directory):
            folder = self.path(step)
            if not (folder / MANIFEST).exists():
                sizes = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
                tmp = folder / f"{MANIFEST}.tmp"
                tmp.write_text(json.dumps(sizes))
                os.replace(tmp, folder / MANIFEST)

    def save(self, state, metadata: dict) -> None:
        """Start an async save of `state` at its step; returns once the arrays are copied off-device."""
        step = int(state["step"])
        if step in self.manager.all_steps():
            return
        metadata = {**metadata, "checksums": state_checksums(state)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        metadata=ocp.args.JsonSave(metadata)), force=True)

    def wait(self) -> None:
        """Block until every started save is durable on disk."""
        self.manager.wait_until_finished()
        self._write_manifests()

    def restore(self, step: int, abstract_state, check_metadata=lambda meta: None):
        """Restore `step` into the shardings carried by `abstract_state` (jax.ShapeDtypeStructs).
        `check_metadata` may raise UserError (e.g. a different model); damage raises anything else."""
        check_manifest(self.path(step))
        meta = self.manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
        check_metadata(meta)
        state = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))["state"]
        if state_checksums(state) != meta["checksums"]:
            raise ValueError("checksums of the restored arrays differ from those recorded at save time")
        return state, meta

    def restore_latest_intact(self, steps: list[int], abstract_state, check_metadata=lambda meta: None):
        """Try `steps` newest first; a damaged one is set aside with a warning. Returns (step, state, meta)."""
        damaged = []
        for step in steps:
            try:
                with _quiet_async_failures():
                    return (step, *self.restore(step, abstract_state, check_metadata))
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is not usable
                reason = _first_line(e)
                moved_to = self._set_aside(step)
                damaged.append(step)
                if jax.process_index() == 0:
                    print(f"warning: checkpoint {self.path(step)} is damaged ({reason}); moved to "
                          f"{moved_to}, falling back to the previous one", file=sys.stderr, flush=True)
        raise UserError(f"no intact checkpoint in {self.directory} (damaged: {', '.join(map(str, damaged)) or 'none'}); "
                        f"pass --resume never to start fresh")

    def _set_aside(self, step: int) -> Path:
        """Rename a damaged step to `<step>.damaged[-n]`: never loaded again, kept for inspection."""
        target = self.path(step).with_name(f"{step}.damaged")
        n = 1
        while target.exists():
            n += 1
            target = self.path(step).with_name(f"{step}.damaged-{n}")
        if jax.process_index() == 0:
            self.path(step).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"meshtrain-set-aside-{step}")
        self.manager.reload()
        return target

    def steps(self) -> list[int]:
        return complete_steps(self.directory)

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def close(self) -> None:
        self.manager.close()


def check_manifest(folder: Path) -> None:
    """Raise if a file recorded in the folder's manifest is missing or has another size."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return  # written after the save became durable; older checkpoints rely on the read checks
    for name, size in json.loads(manifest.read_text()).items():
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"file {name} is missing")
        if path.stat().st_size != size:
            raise ValueError(f"file {name} has {path.stat().st_size} bytes, {size} were written")


def _first_line(error: BaseException) -> str:
    while error.__cause__ is not None:  # the root cause names the file (e.g. a truncated one)
        error = error.__cause__
    text = str(error).strip()
    return text.splitlines()[0].split(" See full TensorStore details")[0][:200] if text else type(error).__name__


@contextlib.contextmanager
def _quiet_async_failures():
    """A damaged checkpoint fails in many of Orbax's concurrent reads at once; the first failure is
    raised and reported in one line, the echoes from the other reads (asyncio log lines, unraisable
    coroutines, worker threads) are dropped so the user sees one warning per checkpoint."""
    hooks = sys.unraisablehook, threading.excepthook
    asyncio_log = logging.getLogger("asyncio")
    level = asyncio_log.level
    sys.unraisablehook, threading.excepthook = (lambda *_: None), (lambda *_: None)
    asyncio_log.setLevel(logging.CRITICAL)
    try:
        yield
    except UserError:
        raise
    except Exception:
        time.sleep(1.0)  # let the other reads of the damaged checkpoint fail while muted
        hooks = _drop_read_echoes(hooks[0]), hooks[1]  # their coroutines may be finalised at exit
        raise
    finally:
        sys.unraisablehook, threading.excepthook = hooks
        asyncio_log.setLevel(level)


def _drop_read_echoes(hook):
    if getattr(hook, "drops_read_echoes", False):
        return hook

    def filtered(unraisable):
        if "_read_array_index" not in repr(unraisable.object):
            hook(unraisable)

    filtered.drops_read_echoes = True
    return filtered


def abstract_like(state_shapes, shardings):
    """ShapeDtypeStructs carrying the target shardings, for restore."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_shapes, shardings)


def resolve_resume(resume: str, out_dir: Path) -> tuple[Path | None, list[int]]:
    """(checkpoint root, candidate steps newest first) to resume from, or (None, []) to start fresh.
    `auto` and a root folder offer every complete step (falling back past damaged ones); a step folder
    offers only itself."""
    if resume == "never":
        return None, []
    if resume == "auto":
        root = out_dir / "checkpoints"
        return (root, complete_steps(root)) if complete_steps(root) else (None, [])
    path = Path(resume)
    if path.is_dir() and path.name.isdigit():
        return path.parent, [int(path.name)]
    if complete_steps(path):
        return path, complete_steps(path)
    raise UserError(f"checkpoint.resume={resume!r} is not a checkpoint folder; pass <out>/checkpoints or "
                    f"<out>/checkpoints/<step>, or auto / never")


def complete_steps(root: Path) -> list[int]:
    """Step folders under `root`, newest first; Orbax's in-progress saves carry a non-numeric tmp
    suffix and damaged ones a `.damaged` suffix."""
    if not root.is_dir():
        return []
    return sorted((int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
