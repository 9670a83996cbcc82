"""Hugging Face checkpoints (`config.json` + safetensors) <-> meshtrain parameters, for the llama
family (`LlamaForCausalLM`: GQA, tied or untied head, Llama 3.x rope scaling) and the moe family
(`MixtralForCausalLM`).

- `read_spec(dir)` / `write_config(spec, dir)`: config.json <-> `ModelSpec`; what meshtrain does not
  implement (biases, sliding windows, other rope scalings, shared experts in Mixtral form) is a
  UserError, never an approximation.
- `TENSORS`: the one table of names. A Hugging Face linear weight is [out, in]; ours puts the input
  first ([D, H, K] for q_proj [H*K, D]), so ours = hf.T reshaped, hf = ours reshaped to [in, out], .T.
  Stacked block parameters hold layer i at index i (and expert j at [i, j]).
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

import hashlib
import itertools
import json
import math
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from meshtrain.core.errors import UserError
from meshtrain.config.spec import ModelSpec
from meshtrain.models.moe import MOE_PARAM_AXES
from meshtrain.models.transformer import contracted_axes

LAYER = "model.layers.{i}."
EXPERT = LAYER + "block_sparse_moe.experts.{j}."
# our parameter path -> (Hugging Face name, is a linear weight [out, in])
TENSORS = {
    ("embedding",): ("model.embed_tokens.weight", False),
    ("lm_head",): ("lm_head.weight", True),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("blocks", "attn_norm", "scale"): (LAYER + "input_layernorm.weight", False),
    ("blocks", "mlp_norm", "scale"): (LAYER + "post_attention_layernorm.weight", False),
    ("blocks", "wq"): (LAYER + "self_attn.q_proj.weight", True),
    ("blocks", "wk"): (LAYER + "self_attn.k_proj.weight", True),
    ("blocks", "wv"): (LAYER + "self_attn.v_proj.weight", True),
    ("blocks", "wo"): (LAYER + "self_attn.o_proj.weight", True),
    ("blocks", "w_gate"): (LAYER + "mlp.gate_proj.weight", True),
    ("blocks", "w_up"): (LAYER + "mlp.up_proj.weight", True),
    ("blocks", "w_down"): (LAYER + "mlp.down_proj.weight", True),
    ("blocks", "router"): (LAYER + "block_sparse_moe.gate.weight", True),
    ("blocks", "expert_gate"): (EXPERT + "w1.weight", True),
    ("blocks", "expert_down"): (EXPERT + "w2.weight", True),
    ("blocks", "expert_up"): (EXPERT + "w3.weight", True),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
DTYPE_NAMES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
INDEX = "model.safetensors.index.json"
SUMS = "SHA256SUMS"


# ---- config.json <-> ModelSpec ----

def read_spec(folder: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint folder (its config.json), once the folder's files
    match its SHA256SUMS (when it has one: meshtrain's exports do)."""
    path = Path(folder) / "config.json"
    check_sums(folder)
    if not path.is_file():
        raise UserError(f"{folder} has no config.json; pass a Hugging Face checkpoint folder "
                        f"(save_pretrained's output, or a download of one)")
    c = json.loads(path.read_text())
    kind = c.get("model_type")
    if kind not in ARCHITECTURES:
        raise UserError(f"{path}: model_type {kind!r} is not supported; meshtrain imports "
                        f"{', '.join(ARCHITECTURES)} checkpoints")
    unsupported = {"attention_bias": True, "mlp_bias": True, "hidden_act": lambda v: v != "silu",
                   "sliding_window": lambda v: v is not None}
    for key, bad in unsupported.items():
        if key in c and (bad(c[key]) if callable(bad) else c[key] == bad):
            raise UserError(f"{path}: {key}={c[key]!r} is not implemented by meshtrain's {kind} model; "
                            f"this checkpoint cannot be imported exactly")
    def need(table, key):
        if key not in table:
            raise UserError(f"{path} lacks {key!r}, which a {kind} config.json has; the file is incomplete")
        return table[key]

    rope = c.get("rope_parameters") or {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 10000.0)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"{path}: rope scaling {rope_type!r} is not implemented (meshtrain has none and llama3)")
    heads, width = need(c, "num_attention_heads"), need(c, "hidden_size")
    spec = ModelSpec(
        family="moe" if kind == "mixtral" else "llama", vocab_size=need(c, "vocab_size"),
        num_layers=need(c, "num_hidden_layers"), d_model=width, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or width // heads,
        mlp_dim=need(c, "intermediate_size"), rope_theta=float(rope["rope_theta"]),
        norm_eps=float(need(c, "rms_norm_eps")), tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    if rope_type == "llama3":
        spec.rope_scaling, spec.rope_factor = "llama3", float(need(rope, "factor"))
        spec.rope_low_freq_factor = float(need(rope, "low_freq_factor"))
        spec.rope_high_freq_factor = float(need(rope, "high_freq_factor"))
        spec.rope_original_max_len = int(need(rope, "original_max_position_embeddings"))
    if kind == "mixtral":  # Hugging Face routes dropless (capacity_factor 0), with no z-loss
        spec.num_experts, spec.experts_per_token = need(c, "num_local_experts"), need(c, "num_experts_per_tok")
        spec.capacity_factor, spec.router_z_loss = 0.0, 0.0
        spec.router_aux_loss = float(c.get("router_aux_loss_coef", 0.001))  # MixtralConfig's default
    return spec


def hf_config(spec: ModelSpec, dtype: str = "float32") -> dict:
    """config.json for `spec`: rope given both as `rope_parameters` (transformers 5) and as
    `rope_theta` + `rope_scaling` (earlier versions)."""
    m = spec.resolved()
    moe = m.family == "moe" and m.num_experts > 0
    if m.family == "moe" and m.num_shared_experts:
        raise UserError("model.num_shared_experts > 0 has no Mixtral form (DeepSeek's layout); export is for "
                        "llama and Mixtral-style moe models")
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor, original_max_position_embeddings=m.rope_original_max_len)
    kind = "mixtral" if moe else "llama"
    config = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": m.vocab_size,
        "hidden_size": m.d_model, "intermediate_size": m.mlp_dim, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling != "none" else None,
        "max_position_embeddings": int(max(m.rope_original_max_len * (m.rope_factor if m.rope_scaling != "none"
                                                                        else 1), 2048)),
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype,
    }
    if moe:
        config.update(num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                      router_aux_loss_coef=m.router_aux_loss, sliding_window=None)
        del config["mlp_bias"]
    return config


# ---- tensor names ----

def tensor_names(path: tuple[str, ...], shape: tuple[int, ...]):
    """(Hugging Face name, index into our array) for every tensor our parameter `path` holds."""
    if path not in TENSORS:
        raise UserError(f"parameter {'/'.join(path)} has no Hugging Face counterpart")
    template, _ = TENSORS[path]
    if path[0] != "blocks":
        return [(template, ())]
    if "{j}" in template:
        return [(template.format(i=i, j=j), (i, j)) for i in range(shape[0]) for j in range(shape[1])]
    return [(template.format(i=i), (i,)) for i in range(shape[0])]


def _path(key_path) -> tuple[str, ...]:
    return tuple(k.key for k in key_path)


def hf_shape(path, shape) -> tuple[int, ...]:
    """The Hugging Face shape of our array of `shape` at one layer / expert index."""
    if not TENSORS[path][1]:
        return tuple(shape)
    inputs = len(contracted_axes(MOE_PARAM_AXES[path[-1]]))
    return math.prod(shape[inputs:]), math.prod(shape[:inputs])


def to_hf(path, x_ours: np.ndarray) -> np.ndarray:
    """One tensor (our array at one layer / expert index) in Hugging Face layout."""
    if not TENSORS[path][1]:
        return x_ours
    return x_ours.reshape(hf_shape(path, x_ours.shape)[::-1]).T


# ---- reading: memory-mapped safetensors ----

class SafetensorsFolder:
    """Every tensor of a checkpoint folder as a read-only memory-mapped numpy array (the format: an
    8-byte little-endian header length, a JSON header, the raw data). Read directly rather than
    with safetensors' numpy loader, which cannot return bfloat16."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        files = ([folder / f for f in sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))]
                 if (folder / INDEX).is_file() else sorted(folder.glob("*.safetensors")))
        if not files:
            raise UserError(f"{folder} holds no .safetensors files (PyTorch .bin checkpoints are not read); "
                            f"convert them with transformers' save_pretrained(safe_serialization=True)")
        self.tensors = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    length = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(length))
            except (OSError, ValueError) as e:  # missing, unreadable, or no JSON header
                raise UserError(f"{f} cannot be read as safetensors ({type(e).__name__}: {e}); download or "
                                f"export it again") from None
            size = f.stat().st_size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise UserError(f"{f}: tensor {name} has dtype {info['dtype']}; meshtrain reads F32, BF16, F16")
                begin, end = info["data_offsets"]
                if 8 + length + end > size or end - begin != math.prod(info["shape"]) * np.dtype(DTYPES[info["dtype"]]).itemsize:
                    raise UserError(f"{f}: tensor {name} lies outside the file or has the wrong size (a truncated "
                                    f"download?); download or export it again")
                self.tensors[name] = np.memmap(f, dtype=DTYPES[info["dtype"]], mode="r", offset=8 + length + begin,
                                               shape=tuple(info["shape"]))

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise UserError(f"the checkpoint lacks tensor {name}; its config.json does not describe its files")
        return self.tensors[name]


def check_tensors(files: SafetensorsFolder, model, folder) -> None:
    """Every tensor the model needs is in the files with the shape its config.json implies."""
    for key_path, x in jax.tree_util.tree_leaves_with_path(jax.eval_shape(model.init, jax.random.key(0))):
        path = _path(key_path)
        for name, index in tensor_names(path, x.shape):
            needed = hf_shape(path, x.shape[len(index):])
            if files.get(name).shape != needed:
                raise UserError(f"{folder}: tensor {name} has shape {files.get(name).shape}, the model of its "
                                f"config.json needs {needed}")


def load_params(folder: str | Path, model, shardings):
    """The model's parameters from a Hugging Face folder, each array built shard by shard straight
    into `shardings` (a tree like the params). Checks names and shapes before reading any data."""
    files = SafetensorsFolder(folder)
    check_tensors(files, model, folder)

    def load(key_path, x, sharding):
        path = _path(key_path)
        by_index = {index: name for name, index in tensor_names(path, x.shape)}
        lead = len(next(iter(by_index)))  # 0, 1 (layer) or 2 (layer, expert) leading index dims

        def shard(index):  # one slice per dimension
            outer = [range(*s.indices(n)) for s, n in zip(index[:lead], x.shape[:lead])]
            parts = [from_hf(path, files.get(by_index[ij]), x.shape[lead:])[index[lead:]]
                     for ij in itertools.product(*outer)]
            return np.stack(parts).reshape(tuple(map(len, outer)) + parts[0].shape).astype(x.dtype)

        return jax.make_array_from_callback(x.shape, sharding, shard)

    return jax.tree_util.tree_map_with_path(load, jax.eval_shape(model.init, jax.random.key(0)), shardings)


def from_hf(path, x_hf: np.ndarray, shape) -> np.ndarray:
    """A Hugging Face tensor as our array at one layer / expert index (a lazy view: only what is
    indexed afterwards is read from the memory map)."""
    return x_hf.T.reshape(shape) if TENSORS[path][1] else x_hf


# ---- writing ----

def save_params(params, spec: ModelSpec, folder: str | Path, dtype: str = "float32",
                max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `params` (model order; jax arrays on any mesh, or numpy) as a Hugging Face folder:
    config.json, and model.safetensors, or model-0000k-of-0000n.safetensors + index when larger than
    `max_shard_bytes`. One tensor at a time is gathered to the host, one file's worth is held there.
    Returns the files written."""
    if dtype not in DTYPE_NAMES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPE_NAMES)}")
    folder = Path(folder)
    config = hf_config(spec, dtype)
    itemsize = np.dtype(DTYPE_NAMES[dtype]).itemsize
    leaves = jax.tree_util.tree_leaves_with_path(params)
    plan = [(name, _path(kp), x, index) for kp, x in leaves for name, index in tensor_names(_path(kp), x.shape)]
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
    for file, group in zip(names, groups):
        tensors = {name: np.ascontiguousarray(to_hf(path, _fetch(x, index)).astype(DTYPE_NAMES[dtype]))
                   for name, path, x, index in group}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        user_mode(folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(names) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
                                               indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return [folder / n for n in names]


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
    for line in sums.read_text().splitlines():
        digest, mark, name = line[:64], line[64:66], line[66:]
        if len(digest) != 64 or mark not in ("  ", " *") or not name:
            raise UserError(f"{sums} has a line that is not '<sha256>  <file>': {line[:80]!r}; {fix}")
        if not (folder / name).is_file():
            raise UserError(f"{folder / name} is listed in {sums} but missing; {fix}")
        if _sha256(folder / name) != digest.lower():
            raise UserError(f"{folder / name} does not match its SHA256SUMS entry (damaged or changed since "
                            f"it was written); {fix}")
