"""`python -m meshtrain.convert --quantize int8 RUN OUT [--scheme symmetric|affine] [--step N]`: a
run's newest intact checkpoint (or step N, read verified: meshtrain/run/checkpoint.py `read_params`)
quantized per channel (meshtrain/interop/quantize.py), saved whole with a SHA256SUMS, with the eval loss
of the int8 model beside the fp32 one, both on the run's own validation batches and Trainer.

Evaluation is weight-only, W8A16 (W8A32 under precision=fp32): the int8 weights are dequantized and
the run's own Trainer.evaluate runs on its validation batches. No int8 matmul runs, so this measures
accuracy and size, not speed.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save

from meshtrain.core.console import log
from meshtrain.core.folders import check_new, writing_whole
from meshtrain.data import tokenizer
from meshtrain.interop.hf import write_sums
from meshtrain.interop.quantize import (
    INFO_FILE,
    MODEL_FILE,
    QTensor,
    check_scheme,
    dequantize,
    describe,
    flat,
    quantize,
    tensors,
)
from meshtrain.models import FAMILIES
from meshtrain.parallel import mesh
from meshtrain.run import run_dir
from meshtrain.run.trainer import Trainer


def evaluate_with(trainer, params) -> float | None:
    """trainer.evaluate() with `params` (in model order, on the host) in place of its own."""
    p = trainer.program
    params = {**params, "blocks": p.reorder_blocks(params["blocks"], p.layer_order)}  # storage order
    own = trainer.state
    trainer.state = {**own, "params": jax.device_put(params, p.state_shardings["params"])}
    try:
        return trainer.evaluate()
    finally:
        trainer.state = own


def export_int8(run: str | Path, out: str | Path, scheme: str = "symmetric", devices=None,
                step: int | None = None) -> dict:
    """Export RUN's checkpoint of `step` (default: the newest intact one, read verified) as int8 into
    OUT (made whole or not at all, with a SHA256SUMS); print and return the eval losses and sizes.
    `devices` as for Trainer (default: all, with the run's mesh)."""
    check_scheme(scheme)
    cfg = run_dir.run_config(run)
    out = check_new(out, "OUT")
    if cfg.devices and devices is None:  # the run's simulated devices, before reading starts JAX
        mesh.simulate_cpu_devices(cfg.devices)
    model = FAMILIES[cfg.model.family](cfg.model)
    params, step = run_dir.newest_params(run, model, step=step)  # before any compile: damage is found first
    params = jax.device_get(params)
    # The run's own evaluation (its data, mesh and eval step), on a Trainer that reads no checkpoint
    # (the weights are the ones read above) and owns a throwaway folder: the run's is never written.
    scratch = tempfile.mkdtemp(prefix="meshtrain-quantize-")
    cfg.out, cfg.checkpoint.resume, cfg.checkpoint.init_from = scratch, "never", ""
    try:
        trainer = Trainer(cfg, devices=devices)
        run_dir.check_run_data(run, trainer.mixture)  # its losses are the run's only on the run's data
        run_params, params = params, run_dir.trunk_params(run, model, params)
        axes = model.logical_axes(params)
        qtree = quantize(params, axes, scheme)
        # the run's program takes its whole tree; its evaluation reads the trunk only
        fp32, int8 = evaluate_with(trainer, run_params), evaluate_with(trainer, {**run_params, **dequantize(qtree)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    blob = save(tensors(qtree), metadata={"format": "meshtrain-int8"})
    sizes = {path: np.size(w) for path, w in flat(params).items()}
    quantized = sum(sizes[path] for path, t in flat(qtree).items() if isinstance(t, QTensor))
    fp32_bytes = 4 * sum(sizes.values())
    report = {"eval_loss_fp32": fp32, "eval_loss_int8": int8,
              "delta": None if fp32 is None else int8 / fp32 - 1,
              "bytes_fp32": fp32_bytes, "bytes_int8": len(blob), "ratio": fp32_bytes / len(blob),
              "quantized_fraction": quantized / sum(sizes.values())}
    info = {**describe(qtree, axes, scheme), "step": step,
            "run": str(Path(run).absolute()), "report": report}
    files = {MODEL_FILE: blob, INFO_FILE: json.dumps(info, indent=1).encode() + b"\n",
             "config.yaml": (Path(run) / "config.yaml").read_bytes()}
    with writing_whole(out, "OUT") as tmp:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        tokenizer.record(tmp, tokenizer.recorded(run))  # None: the run recorded none
        write_sums(tmp)
    log.info(table(info))
    return report


def table(info: dict) -> str:
    r, mb = info["report"], lambda b: f"{b / 2**20:.3f} MB"
    loss = lambda x: "n/a" if x is None else f"{x:.4f}"
    delta = "n/a: the run has no validation split" if r["delta"] is None else f"{100 * r['delta']:+.3f}%"
    kept = [name for name, e in info["params"].items() if not e["quantized"]]
    return "\n".join([
        f"int8 export of step {info['step']} ({info['scheme']}, per output channel, weight-only: "
        f"int8 weights dequantized for the matmuls)",
        f"{'':10}{'fp32':>12}{'int8':>12}   delta",
        f"{'eval loss':10}{loss(r['eval_loss_fp32']):>12}{loss(r['eval_loss_int8']):>12}   {delta}",
        f"{'size':10}{mb(r['bytes_fp32']):>12}{mb(r['bytes_int8']):>12}   {r['ratio']:.2f}x smaller",
        f"int8: {100 * r['quantized_fraction']:.2f}% of the parameters (every weight matrix); "
        f"kept: {', '.join(kept) or 'nothing'}"])

