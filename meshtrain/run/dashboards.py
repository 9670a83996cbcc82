"""The metric sinks for dashboards (meshtrain/run/loggers.py `Logger`s): TensorBoard event files under
<out>/tensorboard and a Weights & Biases run, one scalar per metric, tagged <group>/<name> (`tag`).
loggers.py `for_run` builds them from the `logging:` section.
"""
from __future__ import annotations

import importlib
import importlib.abc
import itertools
import os
import sys
import threading
from pathlib import Path

from meshtrain.core.errors import UserError
from meshtrain.core.folders import full_disk_is_user_error
from meshtrain.core.metrics import LOW_PEAK_NAMES

# TensorBoard / W&B tag of each record key: <group>/<name>. Keys not listed (loss, grad_norm, lr, a
# model's new metric) go under train/; those starting with a PREFIXES key under its group.
TAG_GROUPS = {
    "perf": ("tokens_per_sec", "trained_tokens_per_sec", "trained_tokens", "step_time_s", "data_wait_s", "mfu",
             *(f"mfu_{name}" for name in LOW_PEAK_NAMES.values()), "tflops_per_device",
             "checkpoint_blocking_s", "local_checkpoint_blocking_s"),
    "guard": ("skipped_steps",),
    "precision": ("loss_scale", "overflows"),
    "moe": ("router_aux_loss", "router_z_loss", "dropped", "expert_load_max", "batch_load_max"),
    "health": ("loss_spikes", "host_time_spread", "host_time_max_s", "data_wait_max_s", "comm_share", "comm_s"),
}
TAGS = {key: f"{group}/{key}" for group, keys in TAG_GROUPS.items() for key in keys} | {"eval_loss": "eval/loss"}
PREFIXES = {"memory_": "memory/", "share_": "data/share_", "eval_loss_": "eval/loss_",  # eval_loss_<source>
            "eval_reward_": "eval/reward_",  # DPO's held-out pairs' reward_accuracy and reward_margin
            "eval_acc_norm_": "eval/acc_norm_", "eval_acc_": "eval/acc_",  # a task's (eval.tasks); first match wins
            "grad_norm_": "grad_norms/"}  # grad_norm_layer_<i>, grad_norm_<kind> (train.grad_norms_every)
NOT_METRICS = ("step", "time")
FLUSH_SECONDS = 5


def tag(key: str) -> str:
    if key in TAGS:
        return TAGS[key]
    prefix = next((p for p in PREFIXES if key.startswith(p)), None)
    return PREFIXES[prefix] + key.removeprefix(prefix) if prefix else f"train/{key}"


def scalars(record: dict):
    """(tag, value) for each numeric metric of a record."""
    for key, value in record.items():
        if key not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield tag(key), value


class TensorBoard:
    """Event files under `logdir` (tensorboardX), one scalar per metric at the record's step. A
    rewind (and a resume from step k) reopens the writer with purge_step k + 1: TensorBoard then
    drops what earlier attempts logged past k, so a retrained step shows once. The writer's own
    thread writes the file every FLUSH_SECONDS (and on close), not the training loop."""

    def __init__(self, logdir: str | Path, keep_through: int | None = None):
        self.path = Path(logdir)
        self._open(None if keep_through is None else keep_through + 1)

    def _open(self, purge_step: int | None) -> None:
        SummaryWriter = tensorboardx().SummaryWriter
        # Event files are named by the second they were opened in: a suffix keeps a writer that
        # reopens within that second from overwriting the last one, and sorts after it.
        suffix = f".{os.getpid()}.{next(_writers):04d}"
        self.writer = SummaryWriter(str(self.path), purge_step=purge_step, filename_suffix=suffix,
                                    flush_secs=FLUSH_SECONDS)

    def write(self, record: dict) -> None:
        # One event holds the record's scalars: add_scalar's event per scalar costs a queue handoff
        # to the writer's thread each, ~6x the loop's time per record.
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=value) for name, value in scalars(record)]
        with self._full_disk():
            self.writer.file_writer.add_summary(Summary(value=values), record["step"], record.get("time"))

    def rewind(self, step: int) -> None:
        with self._full_disk():
            self.writer.close()
        self._open(step + 1)

    def close(self) -> None:
        with self._full_disk():
            self.writer.close()  # flushes

    def _full_disk(self):
        return full_disk_is_user_error(self.path, "TensorBoard events", "rerun the same command: it resumes")


_writers = itertools.count()  # TensorBoard writers opened by this process


class _NoTorchOnThisThread(importlib.abc.MetaPathFinder):
    """Refuses `import torch` on the thread that made it, and only there (other threads import as ever)."""

    def __init__(self):
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and threading.get_ident() == self.thread:
            raise ModuleNotFoundError("torch is not imported for tensorboardX's scalars", name=name)
        return None  # the next finder's


def tensorboardx():
    """The tensorboardX module, imported without torch where torch is not loaded yet. tensorboardX imports
    torch at its own import where torch is installed (1.3 s, 2-3 s more of a 2-core machine's start)
    only to name torch.Tensor in type hints; its methods that take torch tensors import torch
    themselves, and `TensorBoard` writes scalars."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("tensorboardX")
    finder = _NoTorchOnThisThread()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("tensorboardX")
    finally:
        sys.meta_path.remove(finder)


def preload_tensorboard() -> None:
    """Import tensorboardX on a thread of its own while the run builds and compiles (XLA releases the
    GIL). `TensorBoard` then finds the module loaded (or waits for the import to finish)."""
    threading.Thread(target=tensorboardx, name="meshtrain-import-tensorboardX", daemon=True).start()


def import_wandb():
    try:
        import wandb
    except ImportError:
        raise UserError("logging.wandb=true needs the wandb package: pip install wandb "
                        "(or set logging.wandb=false)") from None
    return wandb


class WandB:
    """A Weights & Biases run (offline by default: files under <out>/wandb, `wandb sync` uploads
    them). Each record is logged with its `step` as the x axis; W&B cannot forget logged steps, so
    after a guard rollback the retrained steps appear twice there (metrics.jsonl and TensorBoard
    hold them once)."""

    def __init__(self, out: Path, project: str, mode: str, config: dict):
        wandb = import_wandb()
        self.path = out / "wandb"
        self.path.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, dir=str(out), name=out.name, mode=mode, config=config)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        self.run.log({"step": record["step"], **dict(scalars(record))})

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.run.finish()
