"""Dataclass configs, YAML loading, dotted `--set` overrides and validation.

Every user-facing mistake raises `UserError` with a one-line message that names the problem and
the fix; the CLI prints it as `error: ...` and exits non-zero.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class UserError(Exception):
    """Bad input from the user: printed as one `error: ...` line by the CLI."""


@dataclass
class ModelConfig:
    vocab_size: int = 256
    num_layers: int = 4
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 0  # 0 -> d_model // num_heads
    mlp_dim: int = 0  # 0 -> SwiGLU's 8/3 * d_model rounded up to a multiple of 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention: str = "xla"  # xla | cudnn
    remat: str = "none"  # none | full | save_matmuls | offload

    def resolved(self) -> "ModelConfig":
        head_dim = self.head_dim or self.d_model // self.num_heads
        mlp_dim = self.mlp_dim or -(-(8 * self.d_model // 3) // 64) * 64
        return dataclasses.replace(self, head_dim=head_dim, mlp_dim=mlp_dim)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 disables clipping


@dataclass
class DataConfig:
    path: str = ""  # "" -> the Python standard library's .py files; or a text file/folder, or .bin
    kind: str = "auto"  # auto | text | tokens | synthetic | stdlib
    val_fraction: float = 0.05


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 32  # global, in sequences
    seq_len: int = 64
    microbatches: int = 1  # gradient accumulation inside one step
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # 0 disables periodic eval
    eval_batches: int = 4


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (async); 0 saves only at the end and on preemption
    keep: int = 3  # keep the newest N checkpoints
    resume: str = "auto"  # auto (latest under <out>/checkpoints) | never | path to a checkpoint folder


@dataclass
class PipelineConfig:
    # Used when the mesh's pipeline axis is > 1; see README "Pipeline parallelism".
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    microbatches: int = 0  # >= pipeline stages; 0 -> 2 x stages
    virtual_stages: int = 1  # chunks of layers per device (interleaved only)


@dataclass
class GuardConfig:
    # A step with a NaN/Inf loss or gradient never updates the state; after this many in a row the
    # run rolls back to the last checkpoint and skips the offending batches.
    max_consecutive_bad: int = 3
    max_rollbacks: int = 3  # then stop with an error: the run is diverging, not unlucky


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    mesh: str = "data=-1"  # "8x8x4" (data x fsdp x tensor [x pipeline]) or "data=2,fsdp=4"
    devices: int = 0  # >0: simulate this many CPU devices when no accelerator is present
    zero: int = 1  # what the `data` axis shards: 1 opt state, 2 + grads, 3 + params
    precision: str = "fp32"  # fp32 | bf16
    rules: dict = field(default_factory=dict)  # logical axis -> mesh axes overrides
    out: str = "runs/default"


CHOICES = {
    "model.attention": ("xla", "cudnn"),
    "model.remat": ("none", "full", "save_matmuls", "offload"),
    "pipeline.schedule": ("gpipe", "1f1b", "interleaved"),
    "data.kind": ("auto", "text", "tokens", "synthetic", "stdlib"),
    "precision": ("fp32", "bf16"),
    "zero": (0, 1, 2, 3),
}


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _coerce(value, typ, key: str):
    """Convert a YAML/CLI value to the field's declared type, or fail naming the key."""
    if typ is bool:
        if isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
        if isinstance(value, bool):
            return value
        raise UserError(f"{key}={value!r} is not a boolean; use true or false")
    if typ is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if typ in (int, float):
        try:
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return typ(float(value)) if typ is int else typ(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}={value!r} is not a valid {typ.__name__}") from None
    return str(value)


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    key = prefix + head
    if head not in names:
        raise UserError(f"unknown config key '{key}'; valid keys here: {', '.join(names)}")
    current = getattr(obj, head)
    if dataclasses.is_dataclass(current):
        if not rest:
            if not isinstance(value, dict):
                raise UserError(f"config key '{key}' is a section; set one of its fields, e.g. {key}.{dataclasses.fields(current)[0].name}=...")
            for k, v in value.items():
                _set(current, k, v, key + ".")
            return
        _set(current, rest, value, key + ".")
    elif hints[head] is dict and rest:
        current[rest] = value
    elif rest:
        raise UserError(f"config key '{key}' has no field '{rest}'")
    else:
        setattr(obj, head, _coerce(value, hints[head], key))


def apply_overrides(cfg: Config, overrides: dict | list[str]) -> Config:
    """Apply a mapping (from YAML) or a list of `a.b=value` strings (from `--set`)."""
    if isinstance(overrides, dict):
        for k, v in overrides.items():
            _set(cfg, k, v)
        return cfg
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq:
            raise UserError(f"--set {item!r} needs the form key=value, e.g. --set train.steps=100")
        _set(cfg, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return cfg


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {path} not found; see configs/ for the shipped ones")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise UserError(f"config file {path} must hold a mapping of sections")
        apply_overrides(cfg, data)
    apply_overrides(cfg, list(overrides))
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that need no devices; mesh-dependent checks live in `sharding.check_divisibility`."""
    for dotted, allowed in CHOICES.items():
        obj, name = cfg, dotted
        if "." in dotted:
            section, name = dotted.split(".")
            obj = getattr(cfg, section)
        if getattr(obj, name) not in allowed:
            raise UserError(f"{dotted}={getattr(obj, name)!r} is not one of {', '.join(map(str, allowed))}")
    m, t = cfg.model, cfg.train
    if m.num_heads % m.num_kv_heads:
        raise UserError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
    if not m.head_dim and m.d_model % m.num_heads:
        raise UserError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; set model.head_dim")
    if m.resolved().head_dim % 2:
        raise UserError("rotary embeddings need an even head_dim")
    for key in ("steps", "batch_size", "seq_len", "microbatches", "log_every", "eval_batches"):
        if getattr(t, key) < 1:
            raise UserError(f"train.{key}={getattr(t, key)} must be >= 1")
    if t.batch_size % t.microbatches:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by train.microbatches={t.microbatches}")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise UserError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
    if cfg.pipeline.microbatches < 0 or cfg.pipeline.virtual_stages < 1:
        raise UserError("pipeline.microbatches must be >= 0 (0 = 2 x stages) and pipeline.virtual_stages >= 1")
    if cfg.guard.max_consecutive_bad < 1 or cfg.guard.max_rollbacks < 0:
        raise UserError("guard.max_consecutive_bad must be >= 1 and guard.max_rollbacks >= 0")
    if cfg.data.kind == "synthetic" and cfg.data.path:
        raise UserError(f"data.kind=synthetic ignores data.path={cfg.data.path!r}; set data.kind=auto or drop the path")
    if not 0 <= cfg.data.val_fraction < 1:
        raise UserError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
