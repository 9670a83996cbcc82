"""The run's output folder (`--out`): checked before anything is built, written only by a run
that starts training (config.yaml here, metrics.jsonl in metrics.py, checkpoints/ in checkpoint.py)."""
from __future__ import annotations

import importlib.metadata
import os
import tempfile
from pathlib import Path

import yaml

from meshtrain.config import Config, UserError, default_out, to_dict


def checked(out: str) -> Path:
    """The output folder, once it is known that it can be created or written; nothing is written."""
    path = Path(out or default_out())
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"--out {path}: {probe} is a file, not a folder; pick another --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--out {path}: {probe} is not writable; pick another --out")
    try:  # access() can pass where creating fails (/proc, a read-only mount as root): create a folder
        os.rmdir(tempfile.mkdtemp(prefix=".meshtrain-probe-", dir=probe))  # of our own there, then remove it
    except OSError as e:
        raise UserError(f"--out {path} cannot be created ({e.strerror}); pick another --out") from None
    return path


def version() -> str:
    try:
        return importlib.metadata.version("meshtrain")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def write_config(out: Path, cfg: Config, mesh) -> None:
    """config.yaml: the resolved config (head_dim and mlp_dim filled in), usable again as --config,
    under a header naming the meshtrain version and the devices it ran on."""
    resolved = to_dict(cfg)
    resolved["model"] = to_dict(cfg.model.resolved())
    device = mesh.devices.flat[0]
    header = (f"# written by meshtrain {version()} at the start of training on {mesh.size} x "
              f"{device.device_kind} ({device.platform}), {len({d.process_index for d in mesh.devices.flat})} "
              f"process(es)\n")
    tmp = out / "config.yaml.tmp"
    tmp.write_text(header + yaml.safe_dump(resolved, sort_keys=False))
    os.replace(tmp, out / "config.yaml")
