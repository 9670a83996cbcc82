"""Thin wrapper over Orbax: async saves, retention, integrity, restore onto any mesh.

A checkpoint holds the train state ({'step', 'params', 'opt_state', 'skipped_steps', 'loss_scale'}) and
metadata: the resolved config, the mesh it was saved on, the batches the nonfinite guard skipped,
the loss-spike detector's running mean and count, and a checksum per state leaf. The data position
needs no saving beyond that: the batch of step k depends only on (seed, k, skipped batches).
A LoRA run's 'params' are its adapters alone: the frozen base is recorded in the metadata as a
pointer and a hash (`base`, meshtrain/run/run_dir.py `base_record`), and rebuilt on every read.

Integrity: Orbax writes each step into a temporary folder and renames it when complete, so an
interrupted save is never listed. Once a save is durable, a manifest records the size of each of
its files. Only proven damage sets a checkpoint aside: the manifest (missing or truncated files),
Orbax failing to decode a file, or the checksums disagreeing. The damaged step is renamed
`<step>.damaged` (kept for inspection, never loaded again) and the previous one is tried, with a
warning naming the bad one. Anything else is not damage and harms nothing: a checkpoint of another
model or state layout is a `UserError` naming what differs (checked from metadata before any array
is read), and a transient failure (memory, permissions, I/O) is raised as it is. With several
processes, all agree on the verdict before any of them renames anything or loads a step.

Restoring reads each array straight into the shardings of the current mesh (resharding on load),
so a run saved on fsdp=8 continues on data=2,tensor=2 with 4 devices.

Readers of weights (export, generate, quantize, init_from) go through `read_params`: the same
checks on the parameters alone; a damaged checkpoint is skipped with a warning, never renamed.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import shutil
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshtrain.core import schema
from meshtrain.core.console import NOTICE, log
from meshtrain.core.errors import UserError
from meshtrain.core.folders import full_disk_is_user_error, is_full_disk, replace_file
from meshtrain.models import FAMILIES
from meshtrain.run.checksums import state_checksums

MANIFEST = "meshtrain_manifest.json"
# What the readers use of a checkpoint's files (meshtrain/core/schema.py): the manifest (each file's size) and
# the metadata: the checksums `save` adds to what its caller gives (`Trainer.save_checkpoint`: the rest; earlier
# versions lack some of it).
MANIFEST_SCHEMA = schema.Table(schema.Int())
METADATA_SCHEMA = {
    "checksums": [schema.Int(0, 2 ** 32 - 1)],
    "config": schema.Optional({"model": {"family": schema.Optional(tuple(FAMILIES))}, "optim": schema.Optional({
        "optimizer": schema.Optional(str)})}),
    "mesh": schema.Optional(str), "devices": schema.Optional(schema.Int(1)),
    "skip_batches": schema.Optional([schema.Int()]), "layer_order": schema.Optional([schema.Int()]),
    "spike_detector": schema.Optional(schema.Nullable({"mean": schema.Nullable(float), "seen": schema.Int()})),
    # a LoRA run's frozen base, which its checkpoints leave out (meshtrain/run/run_dir.py `lora_base`)
    "base": schema.Optional({"init_from": schema.Nullable(str), "seed": schema.Int(), "hash": str})}
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax writes step N into N<suffix>[-<time>], then renames it


class _FullDiskEchoes(logging.Filter):
    """Orbax logs a failed background save with its traceback, once per thread that sees it; a full
    disk is reported once, as the UserError of `Checkpointer._full_disk`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (is_full_disk(record.exc_info[1] if record.exc_info else None)
                    or is_full_disk(OSError(record.getMessage())))


logging.getLogger("absl").addFilter(_FullDiskEchoes())


class Checkpointer:
    """`owner`: the training run that saves here; it removes the temporary folders of saves that a
    crash or a full disk interrupted (readers leave them: the run may be saving right now)."""

    def __init__(self, directory: str | Path, keep: int, owner: bool = False):
        _write_replicas_from_one_process()
        self.directory = Path(directory).absolute()
        if owner and jax.process_index() == 0:
            for tmp in sorted(self.directory.glob(f"*{TMP_SUFFIX}*")):
                shutil.rmtree(tmp, ignore_errors=True)
                log.log(NOTICE, f"removed {tmp}, a checkpoint save that was interrupted")
        self.keep, self._manager, self._in_flight_gb = keep, None, None

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Orbax's manager, made by the first save (a reader never needs one); `close` ends it and
        the thread it keeps from its first save on."""
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, enable_async_checkpointing=True, create=False,  # made by the first save
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifests))
            state = ocp.StandardCheckpointHandler(save_concurrent_gb=self._in_flight_gb or 96)  # 96: Orbax's default
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
                "state": state, "metadata": ocp.JsonCheckpointHandler()})
        return self._manager

    def _write_manifests(self) -> None:
        """After a save is durable: record every file's size, so truncated or missing files are
        caught before Orbax reads them."""
        if jax.process_index() != 0:
            return
        for step in complete_steps(self.directory):
            folder = self.path(step)
            if not (folder / MANIFEST).exists():
                sizes = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
                replace_file(folder / MANIFEST, json.dumps(sizes))

    def save(self, state, metadata: dict) -> None:
        """Start an async save of `state` at its step; returns once the arrays are copied off-device."""
        step = int(state["step"])
        if self._manager is None:
            self._in_flight_gb = in_flight_gb(state)
        if step in self.manager.all_steps():
            return
        metadata = {**metadata, "checksums": state_checksums(state)}
        with self._full_disk():  # this save's start, or the previous one's end
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            metadata=ocp.args.JsonSave(metadata)), force=True)

    def wait(self) -> None:
        """Block until every started save is durable on disk."""
        with self._full_disk():
            if self._manager is not None:  # none: nothing was saved since it was made or closed
                self._manager.wait_until_finished()
            self._write_manifests()

    def _full_disk(self):
        """A full disk fails a save: one UserError; the complete steps before it stay as they were."""
        done = complete_steps(self.directory)
        return full_disk_is_user_error(self.directory, "a checkpoint", then="rerun the same command: it resumes "
                                       + (f"from step {done[0]}" if done else "from the start"))

    def restore(self, step: int, abstract_state, check_metadata=lambda meta, folder: None, optional=None,
                note_unused: bool = True):
        """Restore `step` into the shardings carried by `abstract_state` (jax.ShapeDtypeStructs).
        Raises `Damaged` on proof of damage, `UserError` when the checkpoint is of another model or
        state layout (`check_metadata` may raise it too), and anything else as it is.

        `optional`: top-level state entries -> a function making a fresh one. Such an entry is read
        when the checkpoint holds it in this run's layout and made fresh otherwise (a checkpoint of an
        earlier version, or of another data-parallel size). A top-level entry the checkpoint holds and
        this run does not use (int8 compression's residuals, resumed without it) is not read, with a
        notice unless `note_unused` is False.

        Reads go through Orbax's handlers, which hold no barrier: whatever fails on one process,
        every process reaches the one `agree` below, so collectives never pair up wrongly."""
        folder, state = self.path(step), None
        try:
            check_manifest(folder)
            meta = saved_metadata(folder)
            saved = ocp.PyTreeCheckpointHandler().metadata(folder / "state").tree
            check_metadata(meta, folder)  # UserErrors: the same files give every process the same verdict
            fresh = [k for k in (optional or {}) if k in abstract_state and (
                k not in saved or leaf_specs(saved[k]) != leaf_specs(abstract_state[k]))]
            read = {k: v for k, v in abstract_state.items() if k not in fresh}
            unused = sorted(saved.keys() - abstract_state.keys())
            check_same_layout(folder, leaf_specs({k: v for k, v in saved.items() if k in read}), leaf_specs(read))
            reader = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=in_flight_gb(read))
            state = reader.restore(folder / "state", args=ocp.args.PyTreeRestore(
                item=read, restore_args=ocp.checkpoint_utils.construct_restore_args(read), partial_restore=True))
            failure = None
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted by `_as_damage`, then agreed on
            failure = _as_damage(e)
        failure = agree(failure)  # before the checksums: they are a collective over every process
        if failure is not None:
            raise failure
        # The checksums are in the saved state's leaf order: its top-level entries sorted, each in its
        # own order, which the restored entry keeps (the metadata tree does not: a namedtuple's fields
        # come back as a dict, sorted by name).
        recorded, at = {}, 0
        for k in sorted(saved):
            n = len(jax.tree.leaves(saved[k]))
            recorded[k], at = meta["checksums"][at:at + n], at + n
        if state_checksums(state) != [c for k in sorted(state) for c in recorded[k]]:
            raise Damaged("checksums of the restored arrays differ from those recorded at save time")
        for k in fresh:
            state[k] = optional[k]()
            log.log(NOTICE, f"checkpoint {folder} has no '{k}' in this run's layout; it starts fresh")
        if unused and note_unused:
            log.log(NOTICE, f"checkpoint {folder} holds {', '.join(map(repr, unused))}, which this run does not use; "
                            f"not read")
        return {k: state[k] for k in abstract_state}, meta

    def restore_params(self, step: int, abstract_params, part: str = "params"):
        """Only the parameters of `step` (no optimizer state is read), into the shardings carried by
        `abstract_params`, in the checkpoint's storage order; and the checkpoint's metadata. Verified
        as a resume is (manifest, decode, the parameters' recorded checksums): `Damaged` on proof of
        damage, `UserError` for another layout. `part`: the state entry read, "params" or DPO's
        frozen "reference". Readers go through `read_params`, which chooses the step."""
        state, meta = self.restore(step, {part: abstract_params}, note_unused=False)
        return state[part], meta

    def restore_latest_intact(self, steps: list[int], abstract_state, check_metadata=lambda meta, folder: None,
                              optional=None):
        """Try `steps` newest first; a damaged one is set aside with a warning. Returns (step, state, meta)."""
        damaged = []
        for step in steps:
            try:
                with _quiet_async_failures():
                    return (step, *self.restore(step, abstract_state, check_metadata, optional))
            except Damaged as e:
                moved_to = self._set_aside(step)
                damaged.append(step)
                log.warning(f"checkpoint {self.path(step)} is damaged ({e}); moved to {moved_to}, falling back to "
                            f"the previous one")
        raise UserError(f"no intact checkpoint in {self.directory} "
                        f"(damaged: {', '.join(map(str, damaged)) or 'none'}); pass --resume never to start fresh")

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
            multihost_utils.sync_global_devices(f"meshtrain-set-aside-{step}")
        if self._manager is not None:
            self._manager.reload()
        return target

    def steps(self) -> list[int]:
        return complete_steps(self.directory)

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def close(self) -> None:
        """Wait for the saves started and end the manager (a later save makes a new one)."""
        if self._manager is not None:
            with self._full_disk():
                self._manager.close()
            self._manager = None


def in_flight_gb(state) -> float:
    """Orbax's cap on the bytes a save or restore has in flight in one process (written or read, not
    yet done), in its GB (10^9 bytes): an eighth of the process's share of the state, so that its
    buffers stay within the 0.25 S the docs promise (docs/checkpoints.md, Host memory), and above any
    single request (one array at most; chunk-aligned reads may round it up, hence twice the largest)."""
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(state)]
    return max(sum(sizes) // jax.process_count() // 8, 2 * max(sizes, default=0), 1 << 24) / 1e9


@functools.cache
def _write_replicas_from_one_process() -> None:
    """With one process, write each replicated array whole rather than in one slice per replica.
    Orbax's replica-parallel writes spread the bytes of a replicated array over the hosts that hold
    it; with a single process there is nothing to spread, and slicing costs a small compiled
    program per array and sharding (6 s of a 7 s save of the tiny MoE model on data=2,expert=4)."""
    if jax.process_count() == 1:
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        absl_log.setLevel(logging.ERROR)  # Orbax warns that the override overrides
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
        finally:
            absl_log.setLevel(level)


class Damaged(Exception):
    """Proof that a checkpoint's files are damaged: it is set aside and the previous one tried.
    `while_reading`: Orbax's concurrent reads failed (their echoes need muting), rather than one of
    our own checks (manifest, checksums)."""

    def __init__(self, reason: str, while_reading: bool = False):
        super().__init__(reason)
        self.while_reading = while_reading


# Failures that prove nothing about the files: the same read may succeed later or elsewhere.
TRANSIENT_ERRORS = (MemoryError, PermissionError, TimeoutError, ConnectionError, InterruptedError)
TRANSIENT_MESSAGES = ("RESOURCE_EXHAUSTED", "out of memory", "DEADLINE_EXCEEDED", "UNAVAILABLE", "Permission denied")


def _as_damage(error: Exception) -> Exception:
    """A failed read of a checkpoint whose metadata matches this run: `Damaged`, unless the failure is
    transient (then the error itself is returned, to be raised: an error, never a rename)."""
    if isinstance(error, (Damaged, UserError)):
        return error
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    transient = isinstance(root, TRANSIENT_ERRORS) or (isinstance(root, OSError) and not isinstance(
        root, (FileNotFoundError, IsADirectoryError, NotADirectoryError)))
    if transient or any(m.lower() in str(root).lower() for m in TRANSIENT_MESSAGES):
        return error
    return Damaged(_first_line(error), while_reading=True)


def agree(failure: Exception | None) -> Exception | None:
    """Every process's verdict on a read: the worst of them (a transient error, then damage, then
    none), so that no process renames a step or loads one that another could not read."""
    if jax.process_count() == 1:
        return failure
    code = 0 if failure is None else 1 if isinstance(failure, Damaged) else 2
    worst = int(np.max(multihost_utils.process_allgather(np.int32(code))))
    if worst == code:
        return failure
    if worst == 1:
        return Damaged("another process could not read its part of it")
    return RuntimeError("another process failed to read this checkpoint (a transient error there); "
                        "rerun to resume")


def leaf_specs(tree) -> dict[str, tuple]:
    """'opt_state/1/0/mu/w' -> (shape, dtype) for each array; namedtuple fields and dict keys alike, so
    a saved tree (Orbax metadata) and this run's abstract state compare."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)

    return {name(path): (tuple(x.shape), str(x.dtype)) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_same_layout(folder: Path, saved: dict, current: dict) -> None:
    """The saved state must have this run's arrays, shapes and dtypes; else a UserError naming them."""
    if saved == current:
        return
    missing, extra = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
    differ = [f"{k} {saved[k][0]}/{saved[k][1]} vs {current[k][0]}/{current[k][1]}"
              for k in sorted(saved.keys() & current.keys()) if saved[k] != current[k]]
    parts = ([f"this run has {len(missing)} arrays it lacks (e.g. {missing[0]})"] if missing else []) + \
            ([f"it has {len(extra)} arrays this run lacks (e.g. {extra[0]})"] if extra else []) + \
            ([f"{len(differ)} arrays differ (e.g. {differ[0]}, saved vs this run)"] if differ else [])
    raise UserError(f"checkpoint {folder} holds another state layout: {'; '.join(parts)}; resume it with the "
                    f"config it was saved with, or start fresh with a new --out")


def check_manifest(folder: Path) -> None:
    """Raise if a file recorded in the folder's manifest is missing or has another size. A manifest
    that is not one (not JSON, the wrong shape, a file outside the folder) proves nothing about the
    checkpoint: a UserError, nothing set aside."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return  # written after the save became durable; older checkpoints rely on the read checks
    fix = f"delete {manifest} (the checkpoint is still verified as it is read) or restore it"
    sizes = schema.read_json(manifest, MANIFEST_SCHEMA, fix)
    for name, size in sizes.items():
        path = folder / name
        if "\0" in name or not Path(name).parts or Path(name).is_absolute() or ".." in Path(name).parts:
            raise UserError(f"{manifest}: {name!r} is not a file of the checkpoint; {fix}")
        if not path.is_file():
            raise Damaged(f"file {name} is missing")
        if path.stat().st_size != size:
            raise Damaged(f"file {name} has {path.stat().st_size} bytes, {size} were written")


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
    except Exception as e:
        if getattr(e, "while_reading", True):  # our own checks (manifest, checksums) start no reads
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


def read_params(root: Path, abstract_params, step: int | None = None, part: str = "params"):
    """The one loader of weights for every reader (export, generate, quantize, init_from, Python):
    (params in storage order, metadata, step) of `step`, or of the newest intact checkpoint under
    `root`, verified as a resume is. A damaged checkpoint is skipped with a one-line warning naming
    it; it is left in place (setting it aside is its run's job, on resume). A chosen `step` that is
    damaged or absent, or no intact checkpoint at all, is a UserError listing the steps there are."""
    root = Path(root)
    steps = complete_steps(root)
    if not steps:
        raise UserError(f"{root} holds no checkpoint; train first (python -m meshtrain.train --out {root.parent})")
    there = f"choose another --step (there: {', '.join(map(str, steps))})"
    if step is not None and step not in steps:
        raise UserError(f"{root} has no checkpoint of step {step}; {there}")
    reader, damaged = Checkpointer(root, keep=len(steps) + 1), []
    try:
        for candidate in [step] if step is not None else steps:
            try:
                with _quiet_async_failures():
                    return (*reader.restore_params(candidate, abstract_params, part), candidate)
            except Damaged as e:
                if step is not None:
                    raise UserError(f"checkpoint {reader.path(step)} is damaged ({e}); {there}, or omit --step "
                                    f"for the newest intact one") from None
                damaged.append(candidate)
                log.warning(f"checkpoint {reader.path(candidate)} is damaged ({e}); skipped (left in place), trying "
                            f"the previous one")
    finally:
        reader.close()
    raise UserError(f"no intact checkpoint in {root} (damaged: {', '.join(map(str, damaged))}); train again, "
                    f"or restore its checkpoints from a copy")


def abstract_like(state_shapes, shardings):
    """ShapeDtypeStructs carrying the target shardings, for restore."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_shapes, shardings)


def resolve_resume(resume: str, out_dir: Path) -> tuple[Path | None, list[int]]:
    """(checkpoint root, candidate steps newest first) to resume from, or (None, []) to start fresh.
    `auto` and a root folder offer every complete step (falling back past damaged ones); a step folder
    offers only itself. A PATH is where a fresh `out_dir` starts: once `out_dir` holds a newer step
    (the same command, rerun after a crash), the run continues from `out_dir` instead."""
    own_root = out_dir / "checkpoints"
    own = (own_root, complete_steps(own_root))
    if resume == "never":
        if own[1]:
            raise UserError(f"--resume never, but {own_root} holds checkpoints of an earlier run (newest: step "
                            f"{own[1][0]}); use a new --out, or delete that folder to discard them")
        return None, []
    if resume == "auto":
        return own if own[1] else (None, [])
    path = Path(resume)
    if path.is_dir() and path.name.isdigit():
        given = (path.parent, [int(path.name)])
    elif complete_steps(path):
        given = (path, complete_steps(path))
    else:
        raise UserError(f"checkpoint.resume={resume!r} is not a checkpoint folder; pass <out>/checkpoints or "
                        f"<out>/checkpoints/<step>, or auto / never")
    return own if own[1] and own[1][0] > given[1][0] else given


def saved_metadata(folder: Path) -> dict:
    """The metadata a checkpoint step was saved with (the resolved config, mesh, skipped batches, ...),
    checked against METADATA_SCHEMA: the wrong shape is a UserError naming the key (not proof of damage:
    nothing is set aside); a file Orbax cannot decode is raised as it is (`_as_damage` sorts it)."""
    meta = ocp.JsonCheckpointHandler().restore(Path(folder) / "metadata", args=ocp.args.JsonRestore())
    where, fix = str(Path(folder) / "metadata"), "resume from another step (--resume <out>/checkpoints/<step>)"
    schema.check(meta, METADATA_SCHEMA, where, fix)
    model = meta.get("config", {}).get("model", {})
    check_model(model, where, fix, "config.model")
    order = meta.get("layer_order")
    # an order of the stacked layers (deepseek_v3's: less its dense first layers; before, all of them)
    if order is not None and (sorted(order) != list(range(len(order))) or len(order) > model.get("num_layers", 0)):
        raise UserError(f"{where}: layer_order is not an order of the model's layers; {fix}")
    return meta


def check_model(model: dict, where: str, fix: str, key: str) -> None:
    """A recorded model section (run.json's, a checkpoint's) against its family's spec: every key it
    declares of the right type and range (a UserError naming `where` and `key`, ending with `fix`)."""
    spec = FAMILIES[model.get("family", "llama")].spec  # the family: checked by the caller's schema
    schema.check(model, schema.Settings(spec), where, fix, key)


def complete_steps(root: Path) -> list[int]:
    """Step folders under `root`, newest first; Orbax's in-progress saves carry a non-numeric tmp
    suffix and damaged ones a `.damaged` suffix."""
    if not root.is_dir():
        return []
    return sorted((int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
