"""INT8 weights: per-channel quantization of a parameter tree and its export format (safetensors with
a SHA256SUMS beside quantization.json). The export of a run (`python -m meshtrain.convert --quantize
int8 RUN OUT`, its checkpoint read verified and both models evaluated) is meshtrain/run/int8_export.py.

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

Not Qwix (google/qwix): its PTQ intercepts the dot_generals that Flax modules run on their own
params, while our step runs on raw param pytrees (blocks merged inside a scan, the head in
meshtrain/ops/loss.py's tiled cross-entropy); the int8 format here is plain safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
from flax import traverse_util
from safetensors.numpy import load_file

from meshtrain.core.errors import UserError
from meshtrain.interop.hf import check_sums
from meshtrain.models.axes import contracted_axes

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
    check_sums(out)
    info = json.loads((Path(out) / INFO_FILE).read_text())
    stored = load_file(str(Path(out) / MODEL_FILE))
    one = lambda name, e: (QTensor(stored[name], stored[f"{name}_scale"], stored.get(f"{name}_zero_point"))
                           if e["quantized"] else stored[name])
    tree = {tuple(name.split(SEP)): one(name, e) for name, e in info["params"].items()}
    return traverse_util.unflatten_dict(tree), info
