"""The fast local checkpoint tier (`checkpoint.local_dir`, e.g. a node's NVMe), beside the persistent
one (`<out>/checkpoints`, run/checkpoint.py).

Each process writes only the shards its own devices hold, into its own folder:
`<local_dir>/<out name>-<hash of out>/process-<i>/<step>/` with `shards.bin` (the shards' bytes, one
after another) and `manifest.json` (step, process index and count, mesh, the run it belongs to, the
metadata a resume needs, and per leaf its path, shape, dtype and shards: index, offset, bytes, CRC-32).
The loop waits only for the device-to-host copy; a background thread writes a `<step>.tmp-*` folder
and renames it when whole, then keeps the newest `checkpoint.local_keep` steps (and drops any step
newer than the one just written: a timeline the run left, after a rollback).

A local checkpoint is only valid on the same process count and the same shards per process. To
restore, the processes all-gather the steps each holds intact (manifest, sizes, run, layout); the
newest step that every process holds is read when it is newer than the persistent tier's newest,
each process checking its shards' CRC-32, then all agreeing (run/checkpoint.py `agree`), then the
state's recorded checksums (`state_checksums`, bit-exact). Any failure falls back: to an older
common local step, then to the persistent tier; nothing crashes and nothing persistent is touched.
A process whose copy failed its checks renames it `<step>.damaged` (never read again; pruned when
its step would be). A save that fails on a process (a full disk) is said in its log, and by process
0 at the next save or the run's end (`report_failures`), naming the processes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
import zlib
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshtrain.core.console import NOTICE, log
from meshtrain.run.checkpoint import Damaged, agree, leaf_specs
from meshtrain.run.checksums import state_checksums

MANIFEST, SHARDS = "manifest.json", "shards.bin"
MAX_LISTED = 64  # steps per process compared across processes (retention keeps far fewer)


def run_folder(local_dir: str | Path, out: Path) -> Path:
    """This run's folder under `local_dir`: named after `out`, with a hash of its absolute path, so
    two runs sharing a local_dir never meet."""
    out = Path(out).absolute()
    return Path(local_dir).expanduser().absolute() / f"{out.name}-{hashlib.sha256(str(out).encode()).hexdigest()[:8]}"


def _index(index, shape) -> list[list[int]]:
    """A shard's index (a tuple of slices) as [[start, stop], ...]: comparable and JSON-able."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _holds(leaf: dict, x) -> bool:
    """The saved `leaf` has every shard this process's devices hold of `x` (a jax.ShapeDtypeStruct
    with its sharding): false after another sharding of the same mesh (another ZeRO stage, rules)."""
    saved = {str(s["index"]) for s in leaf["shards"]}
    needed = x.sharding.addressable_devices_indices_map(x.shape).values()
    return all(str(_index(index, x.shape)) in saved for index in needed)


class LocalTier:
    """One process's local checkpoints of one run. `run_id` names the run (its first start, from
    run.json): a step written by another run in a folder of the same path is never read."""

    def __init__(self, root: Path, keep: int, run_id: str | None):
        self.root = Path(root) / f"process-{jax.process_index()}"
        self.keep, self.run_id = keep, run_id
        self._thread, self._warned = None, False
        self.failed = -1  # the newest step whose save failed on this process, not yet told to process 0
        for tmp in self.root.glob("*.tmp-*"):  # a save a kill interrupted (the run's lock excludes others)
            shutil.rmtree(tmp, ignore_errors=True)

    def path(self, step: int) -> Path:
        return self.root / str(step)

    def steps(self) -> list[int]:
        """Step folders written whole, newest first."""
        if not self.root.is_dir():
            return []
        return sorted((int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)

    # Saving.

    def save(self, state, metadata: dict, mesh: str) -> None:
        """Copy this process's shards of `state` to the host, then write them in the background. The
        checksums are a collective: every process saves the same step."""
        self.report_failures()
        step = int(state["step"])
        meta = {**metadata, "checksums": state_checksums(state)}
        picked = []  # per leaf: (path, array, its distinct shards on this process's devices)
        for path, x in jax.tree_util.tree_leaves_with_path(state):
            distinct = {str(_index(s.index, x.shape)): s for s in x.addressable_shards}
            picked.append((path, x, list(distinct.values())))
            for shard in distinct.values():
                shard.data.copy_to_host_async()  # every copy in flight at once, then collected below
        leaves, chunks, offset = [], [], 0
        for path, x, distinct in picked:
            shards = []
            for shard in distinct:
                data = np.ascontiguousarray(np.asarray(shard.data))
                shards.append({"index": _index(shard.index, x.shape), "offset": offset, "nbytes": data.nbytes})
                chunks.append(data)
                offset += data.nbytes
            leaves.append({"name": jax.tree_util.keystr(path), "shape": list(x.shape), "dtype": str(x.dtype),
                           "shards": shards})
        manifest = {"step": step, "run": self.run_id, "process_index": jax.process_index(),
                    "process_count": jax.process_count(), "mesh": mesh, "layout": leaf_specs(state),
                    "leaves": leaves, "meta": meta}
        self._thread = threading.Thread(target=self._write, args=(step, manifest, chunks), daemon=True,
                                        name=f"meshtrain-local-save-{step}")
        self._thread.start()

    def _write(self, step: int, manifest: dict, chunks: list[np.ndarray]) -> None:
        tmp = self.root / f"{step}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            with open(tmp / SHARDS, "wb") as f:
                for shard, data in zip((s for leaf in manifest["leaves"] for s in leaf["shards"]), chunks):
                    view = memoryview(data.reshape(-1).view(np.uint8))
                    shard["crc32"] = zlib.crc32(view)
                    f.write(view)
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            shutil.rmtree(self.path(step), ignore_errors=True)  # an earlier attempt's copy of this step
            os.replace(tmp, self.path(step))
            kept = [s for s in self.steps() if s <= step][:self.keep]
            for old in set(self.steps()) - set(kept):  # older ones, and a timeline left behind (newer)
                shutil.rmtree(self.path(old), ignore_errors=True)
            for damaged in self.root.glob("*.damaged"):  # set aside by a restore: kept while its step would be
                s = damaged.name.removesuffix(".damaged")
                if s.isdigit() and not kept[-1] <= int(s) <= step:
                    shutil.rmtree(damaged, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - the local tier is a cache: the persistent tier still holds
            shutil.rmtree(tmp, ignore_errors=True)
            self.failed = step
            if not self._warned:
                log.warning(f"local checkpoint of step {step} not written to {self.root} ({e}); the persistent "
                            f"tier goes on (said once)")
                self._warned = True

    def wait(self) -> None:
        """Block until the save in flight is written (or failed: it said so)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def report_failures(self) -> None:
        """Wait for the save in flight; then process 0, whose log a user reads, says which processes
        failed a local save since the last report (each said why in its own log). A collective: every
        process calls it, at each save and at the run's end."""
        self.wait()
        failed, self.failed = self.failed, -1
        if jax.process_count() == 1:
            return  # this process said so itself
        every = multihost_utils.process_allgather(np.int64(failed))
        lacking = [i for i, s in enumerate(np.asarray(every).reshape(-1)) if s >= 0 and i != jax.process_index()]
        if lacking and jax.process_index() == 0:
            log.warning(f"local checkpoint of step {int(max(every))} not written on process(es) "
                        f"{', '.join(map(str, lacking))} (each process's log says why); the persistent tier goes "
                        f"on, and a restore takes a local step only where every process holds it")
    # Restoring.

    def _manifest(self, step: int, abstract_state, mesh: str) -> dict | None:
        """The manifest of `step` when this process may read it onto this run's state: whole (sizes),
        of this run, process count, mesh and layout; else None. Cheap: no shard is read."""
        folder = self.path(step)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            size = sum(s["nbytes"] for leaf in manifest["leaves"] for s in leaf["shards"])
            usable = (manifest["run"] == self.run_id and manifest["step"] == step
                      and manifest["process_count"] == jax.process_count()
                      and manifest["process_index"] == jax.process_index() and manifest["mesh"] == mesh
                      and {k: [list(v[0]), v[1]] for k, v in leaf_specs(abstract_state).items()} == manifest["layout"]
                      and (folder / SHARDS).stat().st_size == size
                      and all(_holds(leaf, x) for leaf, x in zip(manifest["leaves"], jax.tree.leaves(abstract_state))))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return manifest if usable else None

    def _read(self, manifest: dict, abstract_state):
        """This process's shards of a usable step, put on its devices as the global arrays of
        `abstract_state`'s shardings; `Damaged` when a shard's CRC-32 differs or one is missing."""
        folder, values = self.path(manifest["step"]), []
        data = np.memmap(folder / SHARDS, dtype=np.uint8, mode="r")
        flat, tree = jax.tree_util.tree_flatten(abstract_state)
        for leaf, x in zip(manifest["leaves"], flat):
            saved = {str(s["index"]): s for s in leaf["shards"]}
            arrays = []
            for device, index in x.sharding.addressable_devices_indices_map(x.shape).items():
                s = saved.get(str(_index(index, x.shape)))
                if s is None:
                    raise Damaged(f"{leaf['name']} has no shard {_index(index, x.shape)} here")
                raw = data[s["offset"]:s["offset"] + s["nbytes"]]
                if zlib.crc32(raw) != s["crc32"]:
                    raise Damaged(f"{leaf['name']}: a shard's CRC-32 differs from the one written")
                shard_shape = [b - a for a, b in _index(index, x.shape)]
                host = np.frombuffer(raw, dtype=x.dtype).reshape(shard_shape)
                arrays.append(jax.device_put(host, device))
            values.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
        return jax.tree_util.tree_unflatten(tree, values)

    def restore_newer(self, than: int, abstract_state, mesh: str):
        """(step, state, metadata) of the newest local step every process holds intact, when it is
        newer than `than` (the persistent tier's newest step, -1 without one); else None. A collective:
        every process calls it."""
        self.wait()
        mine = {s: m for s in self.steps()[:MAX_LISTED] if (m := self._manifest(s, abstract_state, mesh))}
        listed = np.full(MAX_LISTED, -1, np.int64)
        listed[:len(mine)] = sorted(mine, reverse=True)
        every = (multihost_utils.process_allgather(listed) if jax.process_count() > 1 else listed[None])
        common = set(mine)
        for row in every:
            common &= set(int(s) for s in row if s >= 0)
        newest = max((int(s) for s in every.flat if s > than), default=None)
        if newest is not None and newest not in common:
            lacking = [i for i, row in enumerate(every) if newest not in row]
            log.log(NOTICE, f"local checkpoint of step {newest} is missing or unusable on process(es) "
                            f"{', '.join(map(str, lacking))}; " + ("trying an older local step" if any(
                                s > than for s in common) else "using the persistent tier"))
        for step in sorted((s for s in common if s > than), reverse=True):
            state, own = None, None
            try:
                state = self._read(mine[step], abstract_state)
            except (Damaged, ValueError) as e:  # a bad CRC, a shard missing or of another size
                own = e if isinstance(e, Damaged) else Damaged(str(e))
            except Exception as e:  # noqa: BLE001 - transient (I/O, memory): proves nothing about the files
                own = e
            failure = agree(own)  # every process's verdict, before the checksums' collective
            if failure is None and state_checksums(state) != mine[step]["meta"]["checksums"]:
                failure = own = Damaged("checksums of the restored arrays differ from those recorded at save time")
            if failure is None:
                return step, state, mine[step]["meta"]
            if not isinstance(failure, Damaged):
                log.warning(f"local checkpoint of step {step} could not be read ({failure}); using the persistent "
                            f"tier")
                return None
            if isinstance(own, Damaged):
                self._set_aside(step)
            log.warning(f"local checkpoint of step {step} is damaged ({failure}); falling back")
        return None

    def _set_aside(self, step: int) -> None:
        target = self.path(step).with_name(f"{step}.damaged")
        shutil.rmtree(target, ignore_errors=True)
        self.path(step).rename(target)


def run_id(record: dict | None) -> str | None:
    """The run a local checkpoint belongs to: when its first start began (run.json), or None."""
    starts = (record or {}).get("starts") or []
    return f"{starts[0]['at']}" if starts else None
