"""The run's output folder (`--out`): checked before anything is built, written only by a run
that starts training (config.yaml here, metrics.jsonl in loggers.py, checkpoints/ in checkpoint.py)."""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import yaml

from meshtrain.config import Config, UserError, default_out, to_dict
from meshtrain.folders import writable


def checked(out: str) -> Path:
    """The output folder, once it is known that it can be created or written; nothing is written."""
    return writable(Path(out or default_out()), "--out")


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


def run_config(run: str | Path) -> Config:
    """The config a finished or running run recorded (<run>/config.yaml), with out = the run."""
    from meshtrain.config import load_config

    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run} is not a meshtrain run folder (no config.yaml); pass the --out of a training run")
    return load_config(str(path), [f"out={run}"])


def newest_params(run: str | Path, model, shardings=None, step: int | None = None):
    """(params in model order, step) of the newest intact checkpoint under <run>/checkpoints, or of
    `step`, verified (meshtrain.checkpoint.read_params), read straight into `shardings` (a tree like
    the params, or one sharding for all; default: the first device). Only the parameters are read,
    never the optimizer state."""
    import jax
    import numpy as np

    from meshtrain.checkpoint import read_params
    from meshtrain.program import TrainProgram

    shapes = jax.eval_shape(model.init, jax.random.key(0))
    if shardings is None or not isinstance(shardings, dict):
        one = shardings or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    params, meta, step = read_params(Path(run) / "checkpoints", abstract, step)
    order = np.asarray(meta.get("layer_order", range(model.cfg.num_layers)))  # interleaved: permuted
    return {**params, "blocks": TrainProgram.reorder_blocks(params["blocks"], np.argsort(order))}, step


def initial_params(source: str, model, shardings):
    """checkpoint.init_from: the parameters (model order, in `shardings`) of a Hugging Face folder
    (`hf:DIR`, verified against its SHA256SUMS when it has one) or of a meshtrain run's newest intact
    checkpoint, whose architecture must be this model's."""
    from meshtrain import hf

    if source.startswith("hf:"):
        folder = source[3:]
        spec, fix = hf.read_spec(folder), f"python -m meshtrain.convert --from-hf {folder} --out RUN"
    else:
        spec, fix = run_config(source).model, f"use the model section of {Path(source) / 'config.yaml'}"
    differ = model.cfg.architecture_difference(spec.resolved(), "this run", f"checkpoint.init_from={source}")
    if differ:
        raise UserError(f"{differ}; the model must match the weights: {fix}")
    if source.startswith("hf:"):
        return hf.load_params(source[3:], model, shardings)
    return newest_params(source, model, shardings)[0]
