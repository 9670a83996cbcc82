"""Hugging Face checkpoints (`config.json` + safetensors) <-> meshtrain parameters, for every model
family with a Hugging Face form (its `FAMILY.hf`, models/spec.py `HFMap`: the model types it imports,
its tensor name map, its config translation). This module knows no family.

- `read_spec(dir)` / `hf_config(spec)`: config.json <-> the family's spec; what meshtrain does not
  implement (biases, sliding windows, other rope scalings, ...) is a UserError, never an approximation.
- The family's `tensors` is the one table of names. A Hugging Face linear weight is [out, in]; ours
  puts the input first ([D, H, K] for q_proj [H*K, D]), so ours = hf.T reshaped, hf = ours reshaped
  to [in, out], .T. Stacked block parameters hold layer i at index i (and expert j at [i, j]).
- `load_params(dir, model, shardings)`: each device's shard is read from the memory-mapped files
  by `jax.make_array_from_callback`: a process reads only the rows of the tensors its devices hold,
  so no host holds the whole model when the shardings split it.
- `save_params(params, spec, dir)`: tensors are gathered to the host one (layer of one weight) at a
  time and written file by file, each of at most `max_shard_bytes` (the most the host holds), with
  `model.safetensors.index.json`, as `save_pretrained` does. One process writes: export reads a
  checkpoint onto one host's devices (meshtrain/convert.py).
- `write_sums(dir)` / `check_sums(dir)`: an export's `SHA256SUMS` (`sha256sum` format, so
  `sha256sum -c SHA256SUMS` in the folder verifies it too); `read_spec` checks it when present.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from meshtrain.core import schema
from meshtrain.core.bounds import INT_LIMIT
from meshtrain.core.errors import UserError
from meshtrain.interop import safetensors_writer
from meshtrain.models import FAMILIES, Family, ModelSpec, family
from meshtrain.models.axes import contracted_axes
from meshtrain.models.lora import adapted_weight
from meshtrain.models.spec import HFConfig

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
DTYPE_NAMES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
INDEX = "model.safetensors.index.json"
SUMS = "SHA256SUMS"
# What meshtrain reads of a Hugging Face folder's files (meshtrain/core/schema.py); the families' translations
# (models/, `HFMap.read`) read more keys, and the spec they make is checked against its declared settings.
DIMENSION = schema.Int(1, INT_LIMIT)
ROPE = schema.Nullable({"rope_type": schema.Optional(str), "type": schema.Optional(str),
                        "rope_theta": schema.Optional(float), "factor": schema.Optional(float)})
CONFIG_SCHEMA = {
    "model_type": schema.Optional(str), **{k: schema.Optional(DIMENSION) for k in (
        "vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads")},
    **{k: schema.Optional(schema.Nullable(schema.Int(0, INT_LIMIT)))  # null or 0: the default
       for k in ("num_key_value_heads", "head_dim", "intermediate_size")},
    "rms_norm_eps": schema.Optional(float), "rope_theta": schema.Optional(float),
    "tie_word_embeddings": schema.Optional(bool), "rope_scaling": schema.Optional(ROPE),
    "rope_parameters": schema.Optional(schema.Nullable({}))}  # a family's: flat, or per layer type
INDEX_SCHEMA = {"weight_map": schema.Table(schema.Name())}
TENSOR_SCHEMA = {"dtype": str, "shape": [schema.Int(0, INT_LIMIT)], "data_offsets": [schema.Int()]}


# ---- config.json <-> the family's spec ----

def importers() -> dict[str, Family]:
    """config.json's model_type -> the family that imports it."""
    return {kind: f for f in FAMILIES.values() if f.hf for kind in f.hf.model_types}


def read_spec(folder: str | Path) -> ModelSpec:
    """The spec of a Hugging Face checkpoint folder (its config.json, translated by the family that
    imports its model_type), once the folder's files match its SHA256SUMS (when it has one:
    meshtrain's exports do)."""
    path = Path(folder) / "config.json"
    check_sums(folder)
    if not path.is_file():
        raise UserError(f"{folder} has no config.json; pass a Hugging Face checkpoint folder "
                        f"(save_pretrained's output, or a download of one)")
    fix = "download or export the checkpoint again, or fix config.json"
    c = schema.read_json(path, CONFIG_SCHEMA, fix)
    kind, by_type = c.get("model_type"), importers()
    if kind not in by_type:
        raise UserError(f"{path}: model_type {kind!r} is not supported; meshtrain imports "
                        f"{', '.join(by_type)} checkpoints")
    try:
        spec = by_type[kind].hf.read(HFConfig(c, path))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
        # a key of the family's own (models/) of a shape CONFIG_SCHEMA does not declare: the translation
        # is a pure function of config.json, so what fails in it is the file's
        raise UserError(f"{path} is not a {kind} config.json meshtrain can read ({type(e).__name__}: "
                        f"{schema.shown(e, 80)}); {fix}") from None
    schema.check(dataclasses.asdict(spec), schema.Settings(type(spec)), f"{path} (as meshtrain's config)", fix,
                 "model")
    return spec


def hf_form(spec_or_family) -> Family:
    """The family of a spec (or a family name), which must have a Hugging Face form."""
    f = family(spec_or_family if isinstance(spec_or_family, str) else spec_or_family.family)
    if f.hf is None:
        raise UserError(f"the {f.name} family has no Hugging Face form; export is for "
                        f"{', '.join(x.name for x in FAMILIES.values() if x.hf)}")
    return f


def hf_config(spec: ModelSpec, dtype: str = "float32") -> dict:
    """config.json for `spec` (its family's translation, with the dtype)."""
    return {**hf_form(spec).hf.write(spec.resolved()), "torch_dtype": dtype, "dtype": dtype}


# ---- tensor names ----

def tensor_names(f: Family, spec: ModelSpec, path: tuple[str, ...], shape: tuple[int, ...]):
    """(Hugging Face name, index into our array) for every tensor our parameter `path` holds (layer
    i of a stack is Hugging Face's layer i + the family's `layer_offset`)."""
    if path not in f.hf.tensors:
        raise UserError(f"parameter {'/'.join(path)} has no Hugging Face counterpart in the {f.name} family")
    template, _ = f.hf.tensors[path]
    if "{i}" not in template:
        return [(template, ())]
    first = f.hf.layer_offset(spec, path)
    if "{j}" in template:
        return [(template.format(i=first + i, j=j), (i, j)) for i in range(shape[0]) for j in range(shape[1])]
    return [(template.format(i=first + i), (i,)) for i in range(shape[0])]


def _path(key_path) -> tuple[str, ...]:
    return tuple(k.key for k in key_path)


def hf_shape(f: Family, path, shape) -> tuple[int, ...]:
    """The Hugging Face shape of our array of `shape` at one layer / expert index."""
    if not f.hf.tensors[path][1]:
        return tuple(shape)
    inputs = len(contracted_axes(f.model.param_axes[path[-1]]))
    return math.prod(shape[inputs:]), math.prod(shape[:inputs])


def to_hf(f: Family, path, x_ours: np.ndarray) -> np.ndarray:
    """One tensor (our array at one layer / expert index) in Hugging Face layout."""
    if not f.hf.tensors[path][1]:
        return x_ours
    return x_ours.reshape(hf_shape(f, path, x_ours.shape)[::-1]).T


# ---- reading: memory-mapped safetensors ----

class SafetensorsFolder:
    """Every tensor of a checkpoint folder as a read-only memory-mapped numpy array (the format: an
    8-byte little-endian header length, a JSON header, the raw data). Read directly rather than
    with safetensors' numpy loader, which cannot return bfloat16."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        fix = "download or export it again"
        files = ([folder / f for f in sorted(set(schema.read_json(folder / INDEX, INDEX_SCHEMA, fix)["weight_map"]
                                                 .values()))]
                 if (folder / INDEX).is_file() else sorted(folder.glob("*.safetensors")))
        if not files:
            raise UserError(f"{folder} holds no .safetensors files (PyTorch .bin checkpoints are not read); "
                            f"convert them with transformers' save_pretrained(safe_serialization=True)")
        self.tensors = {}
        for f in files:
            try:
                size = f.stat().st_size
                with open(f, "rb") as fh:
                    length = int.from_bytes(fh.read(8), "little")
                    if not 0 < length <= size - 8:
                        raise ValueError(f"a header of {length:,} bytes in a file of {size:,}")
                    header = schema.parse_json(fh.read(length), f"{f}'s header", fix)
            except (OSError, ValueError) as e:  # missing, unreadable, or no header
                raise UserError(f"{f} cannot be read as safetensors ({type(e).__name__}: {e}); {fix}") from None
            schema.check(header, {}, f"{f}'s header", fix)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                tensor = schema.printable(name)
                schema.check(info, TENSOR_SCHEMA, f"{f}'s header", fix, tensor)
                if info["dtype"] not in DTYPES:
                    raise UserError(f"{f}: tensor {tensor} has dtype {schema.shown(info['dtype'])}; meshtrain reads "
                                    f"F32, BF16, F16")
                begin, end = (info["data_offsets"] + [-1, -1])[:2]
                nbytes = math.prod(info["shape"]) * np.dtype(DTYPES[info["dtype"]]).itemsize
                if len(info["data_offsets"]) != 2 or 8 + length + end > size or end - begin != nbytes:
                    raise UserError(f"{f}: tensor {tensor} lies outside the file or has the wrong size (a truncated "
                                    f"download?); {fix}")
                self.tensors[name] = np.memmap(f, dtype=DTYPES[info["dtype"]], mode="r", offset=8 + length + begin,
                                               shape=tuple(info["shape"]))

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise UserError(f"the checkpoint lacks tensor {name}; its config.json does not describe its files")
        return self.tensors[name]


# Tensors of a Hugging Face checkpoint that are no weights: rotary inverse frequencies an older
# transformers saved as buffers (recomputed from config.json), and a tied head's copy (transformers ties it
# to the embedding and ignores it too).
NOT_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def check_tensors(files: SafetensorsFolder, model, folder) -> None:
    """Every tensor the model needs is in the files with the shape its config.json implies, and every
    tensor of the files is one the model reads: a checkpoint whose config.json describes less than its
    files hold (2 layers over a file of 4, an extra head) is refused, not read in part."""
    f = hf_form(model.cfg)
    used = set()
    for key_path, x in jax.tree_util.tree_leaves_with_path(jax.eval_shape(model.init, jax.random.key(0))):
        path = _path(key_path)
        for name, index in tensor_names(f, model.cfg, path, x.shape):
            needed = hf_shape(f, path, x.shape[len(index):])
            if files.get(name).shape != needed:
                raise UserError(f"{folder}: tensor {name} has shape {files.get(name).shape}, the model of its "
                                f"config.json needs {needed}")
            used.add(name)
    unread = sorted(name for name in files.tensors.keys() - used if not NOT_WEIGHTS.search(name)
                    and not (name == "lm_head.weight" and model.cfg.tie_embeddings))
    if unread:
        names = ", ".join(map(schema.printable, unread[:3])) + (", ..." if len(unread) > 3 else "")
        raise UserError(f"{folder}: {len(unread)} tensor(s) of its files are no part of the model its config.json "
                        f"describes ({names}); fix config.json (its layer count, its architecture) or export the "
                        f"checkpoint again")


def load_params(folder: str | Path, model, shardings):
    """The model's parameters from a Hugging Face folder, each array built shard by shard straight
    into `shardings` (a tree like the params). Checks names and shapes before reading any data."""
    files = SafetensorsFolder(folder)
    check_tensors(files, model, folder)
    f = hf_form(model.cfg)

    def finite(name: str, part: np.ndarray) -> np.ndarray:
        """A weight holding NaN or inf would train to NaN at the first step: refused as it is read."""
        bad = part.size - np.count_nonzero(np.isfinite(part))
        if bad:
            raise UserError(f"{folder}: tensor {name} holds {bad:,} NaN/inf values; the checkpoint is damaged or "
                            f"was saved from a run that diverged: download or export it again")
        return part

    def load(key_path, x, sharding):
        path = _path(key_path)
        by_index = {index: name for name, index in tensor_names(f, model.cfg, path, x.shape)}
        lead = len(next(iter(by_index)))  # 0, 1 (layer) or 2 (layer, expert) leading index dims

        def shard(index):  # one slice per dimension
            outer = [range(*s.indices(n)) for s, n in zip(index[:lead], x.shape[:lead])]
            parts = [finite(by_index[ij], from_hf(f, path, files.get(by_index[ij]), x.shape[lead:])[index[lead:]])
                     for ij in itertools.product(*outer)]
            return np.stack(parts).reshape(tuple(map(len, outer)) + parts[0].shape).astype(x.dtype)


        return jax.make_array_from_callback(x.shape, sharding, shard)

    return jax.tree_util.tree_map_with_path(load, jax.eval_shape(model.init, jax.random.key(0)), shardings)


def from_hf(f: Family, path, x_hf: np.ndarray, shape) -> np.ndarray:
    """A Hugging Face tensor as our array at one layer / expert index (a lazy view: only what is
    indexed afterwards is read from the memory map)."""
    return x_hf.T.reshape(shape) if f.hf.tensors[path][1] else x_hf


# ---- writing ----

def save_params(params, spec: ModelSpec, folder: str | Path, dtype: str = "float32",
                max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `params` (model order; jax arrays on any mesh, or numpy) as a Hugging Face folder:
    config.json, and model.safetensors, or model-0000k-of-0000n.safetensors + index when larger than
    `max_shard_bytes`. One tensor at a time is gathered to the host, converted and written
    (safetensors_writer.py): host memory holds the largest tensor and its conversion, not a file's worth.
    Returns the files written."""
    if dtype not in DTYPE_NAMES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPE_NAMES)}")
    folder = Path(folder)
    config, f = hf_config(spec, dtype), hf_form(spec)
    itemsize = np.dtype(DTYPE_NAMES[dtype]).itemsize
    leaves = jax.tree_util.tree_leaves_with_path(params)
    plan = [(name, _path(kp), x, index) for kp, x in leaves
            for name, index in tensor_names(f, spec, _path(kp), x.shape)]
    sizes = [math.prod(x.shape[len(index):]) * itemsize for _, _, x, index in plan]
    groups, current, used = [], [], 0
    for entry, size in zip(plan, sizes):  # split into files in order, as save_pretrained does
        if current and used + size > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(entry)
        used += size
    groups.append(current)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    out_dtype = np.dtype(DTYPE_NAMES[dtype])
    for file, group in zip(names, groups):
        made = lambda path, x, index: lambda: to_hf(f, path, _fetch(x, index)).astype(out_dtype)
        safetensors_writer.write(folder / file, [
            safetensors_writer.Entry(name, out_dtype, hf_shape(f, path, x.shape[len(index):]), made(path, x, index))
            for name, path, x, index in group], metadata={"format": "pt"})
        user_mode(folder / file)
        weight_map.update(dict.fromkeys((name for name, *_ in group), file))
    if len(names) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
                                               indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return [folder / n for n in names]


def save_adapters(params, spec: ModelSpec, folder: str | Path, base: str, dtype: str = "float32") -> Path:
    """A LoRA run's adapters as a PEFT adapter folder: adapter_config.json (base_model_name_or_path
    `base`) and adapter_model.safetensors under PEFT's names (`base_model.model.<module>.lora_A.weight`
    [r, in], `lora_B.weight` [out, r], for each layer's module of the base tensor's name; a routed
    expert's adapter for each layer's and expert's, `mlp.experts.{j}.gate_proj`), which
    `peft.PeftModel.from_pretrained(base model, folder)` loads. transformers 5 fuses each expert's
    gate and up (`gate_up_proj`), and PEFT converts per-expert adapters onto it only when both have
    one: with one of them adapted, the other is written with a zero adapter (the same model)."""
    f, lora, folder, blocks = hf_form(spec), spec.lora, Path(folder), params["blocks"]
    adapters = {n: (blocks[f"{n}_a"], blocks[f"{n}_b"]) for t in lora.targets
                for n in (f"lora_{t}", f"lora_expert_{t}") if f"{n}_a" in blocks}
    for one, other in (("lora_expert_gate", "lora_expert_up"), ("lora_expert_up", "lora_expert_gate")):
        if one in adapters and other not in adapters:
            adapters[other] = tuple(np.zeros(x.shape, np.float32) for x in adapters[one])
    tensors, modules = {}, []
    for adapter, (a, b) in adapters.items():
        weight = adapted_weight(adapter)
        template = f.hf.tensors[("blocks", weight)][0].removesuffix(".weight")
        modules.append(template.rsplit(".", 1)[-1])
        for index in np.ndindex(a.shape[:a.ndim + b.ndim - blocks[weight].ndim - 2]):  # (layer[, expert])
            a_IxR, b_RxO = _fetch(a, index), _fetch(b, index)
            module = template.format(**dict(zip("ij", index)))
            for part, x in (("A", a_IxR.reshape(-1, lora.rank).T), ("B", b_RxO.reshape(lora.rank, -1).T)):
                tensors[f"base_model.model.{module}.lora_{part}.weight"] = np.ascontiguousarray(
                    x.astype(DTYPE_NAMES[dtype]))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": list(dict.fromkeys(modules)),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder / "adapter_model.safetensors"


def _fetch(x, index) -> np.ndarray:
    """x[index] on this host: a numpy slice, or a gather of one layer / expert of a jax array."""
    if isinstance(x, np.ndarray):
        return x[index]
    return np.asarray(jax.device_get(_take(x, *map(np.int32, index)) if index else x))


@jax.jit
def _take(x, *index):
    return x[index]


def user_mode(path: Path) -> None:
    """Give a file the mode any file the user creates gets (0666 less the umask): safetensors writes
    through a private temporary file (0600)."""
    mask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(mask)
    path.chmod(0o666 & ~mask)


# ---- checksums of an export ----

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_sums(folder: str | Path) -> None:
    """SHA256SUMS: a line `<sha256>  <file>` per file of the folder (its subfolders' too), the format
    `sha256sum -c` reads."""
    folder = Path(folder)
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.name != SUMS)
    (folder / SUMS).write_text("".join(f"{_sha256(f)}  {f.relative_to(folder).as_posix()}\n" for f in files))


def check_sums(folder: str | Path) -> None:
    """Every file the folder's SHA256SUMS lists is there with that digest (nothing to check without
    one); else a UserError naming the file."""
    folder = Path(folder)
    sums = folder / SUMS
    if not sums.is_file():
        return
    fix = f"export or download it again (or delete {sums} if you changed the file on purpose)"
    try:
        lines = sums.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{sums} is not UTF-8 text (byte {e.start}); {fix}") from None
    for number, line in enumerate(lines, 1):  # the format: 64 hex digits, '  ' (or ' *'), a file of the folder
        digest, mark, name = line[:64], line[64:66], line[66:]
        if (len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest) or mark not in ("  ", " *")
                or not name or "\0" in name or Path(name).is_absolute() or ".." in Path(name).parts):
            raise UserError(f"{sums} has a line that is not '<sha256>  <file>': {line[:80]!r} (line {number}, "
                            f"a file in the folder); {fix}")
        if not (folder / name).is_file():
            raise UserError(f"{folder / name} is listed in {sums} but missing; {fix}")
        if _sha256(folder / name) != digest.lower():
            raise UserError(f"{folder / name} does not match its SHA256SUMS entry (damaged or changed since "
                            f"it was written); {fix}")
