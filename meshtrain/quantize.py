"""INT8 export: per-channel weight quantization of a run's newest intact checkpoint (or --step N,
read verified: meshtrain.checkpoint.read_params), saved as safetensors with a SHA256SUMS, with the
eval loss of the quantized model beside the fp32 one. `python -m meshtrain.convert --quantize int8
RUN OUT [--scheme symmetric|affine] [--step N]` calls `cli`.

Formulas (Jacob et al. 2018, "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference"): w ~ (q - Z) * S, q = clip(round(w / S) + Z), per channel.
- symmetric: S = max|w| / 127, Z = 0, q in [-127, 127].
- affine: over the range [lo, hi] = [min(w, 0), max(w, 0)] (it holds 0, so Z fits int8),
  S = (hi - lo) / 255, Z = round(-lo / S) - 128, q in [-128, 127].
An all-zero channel gets S = 1. Both round to nearest: |(q - Z) * S - w| <= S / 2 per element
(plus fp32 rounding).

Channels: one (S, Z) per output channel of the weight's matmul: max and min run over the
contracted axes only. The rule reads the logical axes (PARAM_AXES): a weight lists its batch axes
(`layers`, `experts`), then its contracted input, then its outputs; so the first axis that is not
layers/experts/vocab is contracted, with `head_dim` when that axis is heads (wo contracts whole
heads). `vocab` is never contracted: the embedding's rows are tokens (looked up, and the tied
head's outputs). So wq [layers, D, H, K] gets a scale per (layer, head, k), wo and w_down one per
(layer, D), the embedding one per token. Kept as they are: the RMSNorm scales (1-D: a scale each
would cost more than the weight) and the MoE router (D x E, tiny, and top-k is a discrete choice
that rounding can flip).

Evaluation is weight-only, W8A16 (W8A32 under precision=fp32): the int8 weights are dequantized
and the run's own Trainer.evaluate runs on its validation batches. No int8 matmul runs, so this
measures accuracy and size, not speed.

Not Qwix (google/qwix): its PTQ intercepts the dot_generals that Flax modules run on their own
params, while our step runs on raw param pytrees (blocks merged inside a scan, the head in
meshtrain/loss.py's tiled cross-entropy); the int8 format here is plain safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
from flax import traverse_util

from meshtrain import run_dir
from meshtrain.errors import UserError
from meshtrain.folders import check_new, writing_whole
from models.transformer import contracted_axes

SCHEMES = ("symmetric", "affine")
KEPT = ("router",)  # by param name; 1-D params (norm scales) are kept too
SEP = "."  # a param path as a name: blocks.wq
MODEL_FILE, INFO_FILE = "model.safetensors", "quantization.json"


class QTensor(NamedTuple):
    """One quantized weight, w ~ (q - zero_point) * scale: scale and zero_point have the weight's
    rank, with size 1 on the contracted axes (they broadcast against q)."""
    q: np.ndarray  # int8
    scale: np.ndarray  # fp32
    zero_point: np.ndarray | None  # int8 (affine); None (symmetric)


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise UserError(f"unknown quantization scheme {scheme!r}; pass --scheme {' or '.join(SCHEMES)}")


def quantize_array(w, axes: tuple[int, ...], scheme: str) -> QTensor:
    """Per-channel int8 of `w`, max and min over `axes` (formulas in the module docstring)."""
    w = np.asarray(w, np.float32)
    if scheme == "symmetric":
        amax = np.max(np.abs(w), axis=axes, keepdims=True)
        scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
        return QTensor(np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale, None)
    lo = np.minimum(np.min(w, axis=axes, keepdims=True), 0)
    hi = np.maximum(np.max(w, axis=axes, keepdims=True), 0)
    scale = np.where(hi > lo, (hi - lo) / 255, 1).astype(np.float32)
    zero = np.round(-lo / scale) - 128
    q = np.clip(np.round(w / scale) + zero, -128, 127)
    return QTensor(q.astype(np.int8), scale, zero.astype(np.int8))


def dequantize_array(t: QTensor, dtype=np.float32) -> np.ndarray:
    q = t.q.astype(np.float32) - (0 if t.zero_point is None else t.zero_point.astype(np.float32))
    return (q * t.scale).astype(dtype)


def flat(tree) -> dict[tuple, object]:
    """{param path: leaf} of a params, logical-axes (tuple leaves) or quantized tree."""
    return traverse_util.flatten_dict(tree, is_leaf=lambda _, x: isinstance(x, QTensor))


def quantize(params, logical_axes, scheme: str):
    """The params tree with a QTensor for each weight matrix (2-D or stacked) and the array
    itself for what is kept (norm scales, the router)."""
    check_scheme(scheme)
    axes = {path: contracted_axes(names) for path, names in flat(logical_axes).items()}
    one = lambda path, w: (np.asarray(w) if not axes[path] or path[-1] in KEPT
                           else quantize_array(w, axes[path], scheme))
    return traverse_util.unflatten_dict({path: one(path, w) for path, w in flat(params).items()})


def dequantize(qtree, dtype=np.float32):
    """The params again, in `dtype` (np.float32, or jnp.bfloat16), from a quantized tree."""
    one = lambda t: dequantize_array(t, dtype) if isinstance(t, QTensor) else np.asarray(t).astype(dtype)
    return traverse_util.unflatten_dict({path: one(t) for path, t in flat(qtree).items()})


# ---- OUT: model.safetensors, quantization.json, the run's config.yaml and tokenizer ----

def tensors(qtree) -> dict[str, np.ndarray]:
    """safetensors entries: <name> (int8 q, or the kept array), <name>_scale (fp32) and
    <name>_zero_point (int8, affine only), as Hugging Face's compressed-tensors names them."""
    out = {}
    for path, t in flat(qtree).items():
        parts = dict(zip(("", "_scale", "_zero_point"), t)) if isinstance(t, QTensor) else {"": t}
        out.update({SEP.join(path) + suffix: np.asarray(a) for suffix, a in parts.items() if a is not None})
    return out


def describe(qtree, logical_axes, scheme: str) -> dict:
    """quantization.json's body: the scheme and, per param, its axes and whether it is int8."""
    params, leaves = {}, flat(qtree)
    for path, names in flat(logical_axes).items():
        t = leaves[path]
        e = {"quantized": isinstance(t, QTensor), "shape": list(np.shape(getattr(t, "q", t))),
             "logical_axes": list(names)}
        if e["quantized"]:
            e["contracted_axes"] = [names[i] for i in contracted_axes(names)]
            e["channel_axes"] = [n for n in names if n not in e["contracted_axes"]]
        params[SEP.join(path)] = e
    return {"format": "meshtrain-int8", "scheme": scheme, "dequantize": "w = (q - zero_point) * scale",
            "params": params}


def load(out: str | Path):
    """(quantized tree, quantization.json) of an export folder, once its files match its SHA256SUMS."""
    from safetensors.numpy import load_file

    from meshtrain.hf import check_sums

    check_sums(out)
    info = json.loads((Path(out) / INFO_FILE).read_text())
    stored = load_file(str(Path(out) / MODEL_FILE))
    one = lambda name, e: (QTensor(stored[name], stored[f"{name}_scale"], stored.get(f"{name}_zero_point"))
                           if e["quantized"] else stored[name])
    tree = {tuple(name.split(SEP)): one(name, e) for name, e in info["params"].items()}
    return traverse_util.unflatten_dict(tree), info


# ---- the export: quantize a run, evaluate both models, write OUT ----

def evaluate_with(trainer, params) -> float | None:
    """trainer.evaluate() with `params` (in model order, on the host) in place of its own."""
    import jax

    p = trainer.program
    params = {**params, "blocks": p.reorder_blocks(params["blocks"], p.layer_order)}  # storage order
    own = trainer.state
    trainer.state = {**own, "params": jax.device_put(params, p.state_shardings["params"])}
    try:
        return trainer.evaluate()
    finally:
        trainer.state = own


def cli(run: str | Path, out: str | Path, scheme: str = "symmetric", devices=None, step: int | None = None) -> dict:
    """Export RUN's checkpoint of `step` (default: the newest intact one, read verified) as int8 into
    OUT (made whole or not at all, with a SHA256SUMS); print and return the eval losses and sizes.
    `devices` as for Trainer (default: all, with the run's mesh)."""
    import shutil
    import tempfile

    import jax
    from safetensors.numpy import save

    from meshtrain import tokenizer
    from meshtrain.hf import write_sums
    from meshtrain.mesh import simulate_cpu_devices
    from meshtrain.trainer import Trainer
    from models import FAMILIES

    check_scheme(scheme)
    cfg = run_dir.run_config(run)
    out = check_new(out, "OUT")
    if cfg.devices and devices is None:  # the run's simulated devices, before reading starts JAX
        simulate_cpu_devices(cfg.devices)
    model = FAMILIES[cfg.model.family](cfg.model)
    params, step = run_dir.newest_params(run, model, step=step)  # before any compile: damage is found first
    params = jax.device_get(params)
    # The run's own evaluation (its data, mesh and eval step), on a Trainer that reads no checkpoint
    # (the weights are the ones read above) and owns a throwaway folder: the run's is never written.
    scratch = tempfile.mkdtemp(prefix="meshtrain-quantize-")
    cfg.out, cfg.checkpoint.resume, cfg.checkpoint.init_from = scratch, "never", ""
    try:
        trainer = Trainer(cfg, devices=devices)
        axes = model.logical_axes(params)
        qtree = quantize(params, axes, scheme)
        fp32, int8 = evaluate_with(trainer, params), evaluate_with(trainer, dequantize(qtree))
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
    print(table(info), flush=True)
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

