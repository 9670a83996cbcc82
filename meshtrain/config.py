"""Dataclass configs, YAML loading, dotted `--set` overrides, validation and the config reference.

Each setting is declared once, with its default, its meaning (`help`), its allowed values or lower
bound, and whether it defines the weights or only how the run executes; the validation, the
reference (`python -m meshtrain.config`, docs/config.md) and the resume check all read that.
Every user-facing mistake raises `UserError` with a one-line message that names the problem and
the fix; the CLI prints it as `error: ...` and exits 2.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class UserError(Exception):
    """Bad input from the user: printed as one `error: ...` line by the CLI."""


MAX_SIMULATED_DEVICES = 4096  # XLA starts 4096 CPU devices in ~15 s, 8192 in ~100 s
DEFAULT_RUN = "default"  # the run folder's name without --config: runs/default


def setting(default, help: str, *, choices=(), min=None, execution: bool = False):
    """A config field. `execution`: a model setting that changes how the run computes, not the
    weights, so it may differ on resume."""
    meta = {"help": help, "choices": tuple(choices), "min": min, "execution": execution}
    if dataclasses.is_dataclass(default) or isinstance(default, dict):
        return field(default_factory=lambda: type(default)(), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    vocab_size: int = setting(256, "vocabulary size (256 for byte-level text)", min=1)
    num_layers: int = setting(4, "transformer blocks", min=1)
    d_model: int = setting(128, "model width", min=1)
    num_heads: int = setting(4, "query heads", min=1)
    num_kv_heads: int = setting(4, "key/value heads (fewer than num_heads: grouped-query attention)", min=1)
    head_dim: int = setting(0, "width of one head; 0 = d_model / num_heads", min=0)
    mlp_dim: int = setting(0, "SwiGLU hidden width; 0 = 8/3 x d_model rounded up to a multiple of 64", min=0)
    rope_theta: float = setting(10000.0, "rotary embedding base", min=1.0)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", min=0.0)
    tie_embeddings: bool = setting(True, "the output head reuses the embedding table")
    attention: str = setting("xla", "attention kernel: xla (forms [B, H, L, L] scores), blockwise (online "
                                    "softmax over blocks of positions, any backend), cudnn (fused, GPU, bf16)",
                            choices=("xla", "blockwise", "cudnn"), execution=True)
    remat: str = setting("none", "activation rematerialisation policy",
                         choices=("none", "full", "save_matmuls", "offload"), execution=True)

    def resolved(self) -> "ModelConfig":
        head_dim = self.head_dim or self.d_model // self.num_heads
        mlp_dim = self.mlp_dim or -(-(8 * self.d_model // 3) // 64) * 64
        return dataclasses.replace(self, head_dim=head_dim, mlp_dim=mlp_dim)

    def architecture(self) -> dict:
        """What defines the weights (resolved): a checkpoint resumes only into the same one."""
        resolved = self.resolved()
        return {f.name: getattr(resolved, f.name) for f in dataclasses.fields(self) if not f.metadata["execution"]}


@dataclass
class OptimConfig:
    lr: float = setting(1e-3, "peak learning rate (AdamW)", min=0.0)
    min_lr_ratio: float = setting(0.1, "cosine decays to lr x min_lr_ratio at the last step", min=0.0)
    warmup_steps: int = setting(20, "linear warmup steps", min=0)
    weight_decay: float = setting(0.1, "decoupled weight decay on matrices (not norms)", min=0.0)
    b1: float = setting(0.9, "Adam beta1", min=0.0)
    b2: float = setting(0.95, "Adam beta2", min=0.0)
    eps: float = setting(1e-8, "Adam epsilon", min=0.0)
    clip_norm: float = setting(1.0, "global gradient-norm clipping; 0 disables it", min=0.0)


@dataclass
class DataConfig:
    path: str = setting("", "text file, folder of text files, or uint16 .bin token file; "
                            "'' = the Python standard library's .py files")
    kind: str = setting("auto", "auto picks tokens for .bin, text otherwise, stdlib without a path",
                        choices=("auto", "text", "tokens", "synthetic", "stdlib"))
    val_fraction: float = setting(0.05, "tail of the token stream held out for eval_loss", min=0.0)
    prefetch: int = setting(1, "batches built ahead in a background thread while the device computes; "
                               "0 builds each one in the loop", min=0)


@dataclass
class TrainConfig:
    steps: int = setting(200, "optimizer steps", min=1)
    batch_size: int = setting(32, "global batch, in sequences", min=1)
    seq_len: int = setting(64, "tokens per sequence", min=1)
    microbatches: int = setting(1, "gradient accumulation inside one step (not with pipeline > 1)", min=1)
    seed: int = setting(0, "seeds the initial weights and the data order")
    log_every: int = setting(10, "steps between log lines and metrics.jsonl records", min=1)
    eval_every: int = setting(50, "steps between eval_loss measurements; 0 disables them", min=0)
    eval_batches: int = setting(4, "batches per evaluation", min=1)


@dataclass
class CheckpointConfig:
    every: int = setting(0, "save every N steps (async); 0 = by time only, at the end and on preemption", min=0)
    every_minutes: float = setting(10.0, "also save when this many minutes passed since the last save; "
                                         "0 disables it", min=0.0)
    keep: int = setting(3, "keep the newest N checkpoints", min=1)
    resume: str = setting("auto", "auto (newest under <out>/checkpoints), never, or a checkpoint folder")


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass
class PipelineConfig:
    schedule: str = setting("1f1b", "pipeline schedule when the mesh's pipeline axis is > 1 (zb: zero-bubble "
                                    "ZB-H1, weight gradients deferred into the bubbles)", choices=PIPELINE_SCHEDULES)
    microbatches: int = setting(0, "microbatches per step, >= pipeline stages; 0 = 2 x stages", min=0)
    virtual_stages: int = setting(1, "chunks of layers per device (interleaved only)", min=1)
    residuals: str = setting("save", "save: a stage keeps each chunk's backward residuals from its forward "
                                     "(what model.remat lets it keep); recompute: it keeps only the chunk's "
                                     "input and reruns the forward in the backward", choices=("save", "recompute"))


@dataclass
class GuardConfig:
    max_consecutive_bad: int = setting(3, "NaN/Inf steps in a row before rolling back to the last checkpoint",
                                       min=1)
    max_rollbacks: int = setting(3, "rollbacks before stopping with an error", min=0)


@dataclass
class Config:
    model: ModelConfig = setting(ModelConfig(), "what is trained")
    optim: OptimConfig = setting(OptimConfig(), "AdamW, warmup + cosine decay, clipping")
    data: DataConfig = setting(DataConfig(), "where tokens come from")
    train: TrainConfig = setting(TrainConfig(), "the loop")
    checkpoint: CheckpointConfig = setting(CheckpointConfig(), "saving and resuming")
    guard: GuardConfig = setting(GuardConfig(), "the NaN/Inf guard")
    pipeline: PipelineConfig = setting(PipelineConfig(), "pipeline schedule (mesh pipeline axis > 1)")
    mesh: str = setting("data=-1", "'8x8x4' (data x fsdp x tensor [x pipeline]) or 'data=2,fsdp=4'; -1 = the rest")
    devices: int = setting(0, f"simulate this many CPU devices (1 to {MAX_SIMULATED_DEVICES}) when no "
                              "accelerator is present; 0 = the machine's devices", min=0)
    zero: int = setting(1, "what the data axis shards: 0 nothing, 1 optimizer state, 2 + gradients, "
                           "3 + parameters", choices=(0, 1, 2, 3))
    precision: str = setting("fp32", "fp32, or bf16 compute with fp32 master weights", choices=("fp32", "bf16"))
    rules: dict = setting({}, "logical axis -> mesh axes overrides, e.g. {mlp: [tensor, fsdp]}")
    out: str = setting("", "output folder; '' = runs/<config file name> (runs/default without --config)")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def default_out(config_path: str | None = None) -> str:
    """runs/<config file name>: the README's commands, each with its own config, never collide."""
    return str(Path("runs") / (Path(config_path).stem if config_path else DEFAULT_RUN))


# ---- parsing: YAML 1.2-style scalars, so '0x8' or '2:30' stays text and 1e-3 is a float ----
class _Loader(yaml.SafeLoader):
    pass


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9]+[eE][-+]?[0-9]+$"
                       r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"), list("-+0123456789."))


def parse_yaml(text: str, source: str):
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}{where}: {problem}; fix the YAML syntax") from None


class _Typed(str):
    """A `--set` value as the user typed it: text for text settings, YAML for the others."""


def _value(raw, key: str):
    return parse_yaml(raw, f"--set {key}") if isinstance(raw, _Typed) and raw.strip() else raw


def _coerce(value, typ, key: str):
    """Convert a YAML/CLI value to the field's declared type, or fail naming the key."""
    if typ is str:
        return str(value)  # never YAML-typed: --mesh 0x8 stays '0x8'
    value = _value(value, key)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
            return str(value).lower() in ("true", "1", "yes")
        raise UserError(f"{key}={value!r} is not a boolean; use true or false")
    if typ is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    try:
        if typ is int and (isinstance(value, bool) or isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return typ(float(value)) if typ is int else typ(value)
    except (TypeError, ValueError):
        raise UserError(f"{key}={value!r} is not a valid {typ.__name__}") from None


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    key = prefix + head
    if head not in names:
        raise UserError(f"unknown config key '{key}'; valid keys here: {', '.join(names)}")
    current = getattr(obj, head)
    if dataclasses.is_dataclass(current):
        if rest:
            return _set(current, rest, value, key + ".")
        value = _value(value, key)
        if not isinstance(value, dict):
            raise UserError(f"config key '{key}' is a section; set one of its fields, "
                            f"e.g. {key}.{dataclasses.fields(current)[0].name}=...")
        for k, v in value.items():
            _set(current, k, v, key + ".")
    elif hints[head] is dict and rest:
        current[rest] = _value(value, f"{key}.{rest}")
    elif rest:
        raise UserError(f"config key '{key}' has no field '{rest}'")
    else:
        setattr(obj, head, _coerce(value, hints[head], key))


def split_override(item: str) -> tuple[str, str]:
    key, eq, raw = item.partition("=")
    if not eq or not key.strip():
        raise UserError(f"--set {item!r} needs the form key=value, e.g. --set train.steps=100")
    return key.strip(), raw


def apply_overrides(cfg: Config, overrides: dict | list[str]) -> Config:
    """Apply a mapping (from YAML) or a list of `a.b=value` strings (from `--set`)."""
    if isinstance(overrides, dict):
        for k, v in overrides.items():
            _set(cfg, str(k), v)
        return cfg
    for item in overrides:
        key, raw = split_override(item)
        _set(cfg, key, _Typed(raw.strip()))
    return cfg


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {path} not found; see configs/ for the shipped ones")
        data = parse_yaml(p.read_text(), str(path)) or {}
        if not isinstance(data, dict):
            raise UserError(f"config file {path} must hold a mapping of sections")
        apply_overrides(cfg, data)
    apply_overrides(cfg, list(overrides))
    cfg.out = cfg.out or default_out(path)
    validate(cfg)
    return cfg


def settings(cfg=None, prefix: str = ""):
    """(dotted key, dataclasses.Field, value) for every leaf setting, in declaration order."""
    cfg = Config() if cfg is None else cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from settings(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, value


def validate(cfg: Config) -> None:
    """Checks that need no devices; mesh-dependent checks live in `sharding.check_divisibility`."""
    for key, f, value in settings(cfg):
        choices, low = f.metadata["choices"], f.metadata["min"]
        if choices and value not in choices:
            raise UserError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")
        if low is not None and value < low:
            raise UserError(f"{key}={value} must be >= {low}")
    m, t = cfg.model, cfg.train
    if m.num_heads % m.num_kv_heads:
        raise UserError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
    if not m.head_dim and m.d_model % m.num_heads:
        raise UserError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
                        f"set model.head_dim")
    if m.resolved().head_dim % 2:
        raise UserError(f"rotary embeddings need an even head_dim, got {m.resolved().head_dim}; set model.head_dim")
    if t.batch_size % t.microbatches:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by train.microbatches={t.microbatches}")
    if cfg.devices > MAX_SIMULATED_DEVICES:
        raise UserError(f"devices={cfg.devices}: at most {MAX_SIMULATED_DEVICES} CPU devices can be simulated "
                        f"(XLA takes minutes to start more); plan a smaller mesh")
    if cfg.data.kind == "synthetic" and cfg.data.path:
        raise UserError(f"data.kind=synthetic ignores data.path={cfg.data.path!r}; set data.kind=auto or drop the path")
    if not cfg.data.val_fraction < 1:
        raise UserError(f"data.val_fraction={cfg.data.val_fraction} must be below 1")


def reference_markdown() -> str:
    """docs/config.md: every key, its type, default and meaning."""
    lines = ["# Configuration reference", "",
             "Generated by `python -m meshtrain.train --config-reference > docs/config.md` from `meshtrain/config.py`",
             "(a test keeps it in sync). Set any key in a YAML file (`section: {key: value}`) or with",
             "`--set section.key=value`; `python -m meshtrain.train --print-config` prints the resolved",
             "values of a command.", ""]
    for section in dataclasses.fields(Config):
        default = getattr(Config(), section.name)
        if not dataclasses.is_dataclass(default):
            continue
        lines += [f"## `{section.name}`: {section.metadata['help']}", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [_reference_row(key, f, value) for key, f, value in settings(default, f"{section.name}.")]
        lines.append("")
    lines += ["## Top-level keys", "", "| key | default | meaning |", "|---|---|---|"]
    lines += [_reference_row(key, f, value) for key, f, value in settings() if "." not in key]
    lines += ["", "Model keys marked *execution* may change when a run resumes from a checkpoint; the others define",
              "the weights and must match it (compared after resolving `head_dim` and `mlp_dim`). Every",
              "optimizer, data, train, checkpoint and top-level key may change on resume.", ""]
    return "\n".join(lines)


def _reference_row(key: str, f, value) -> str:
    notes = [f.metadata["help"]]
    if f.metadata["choices"]:
        notes.append("one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"]))
    if f.metadata["min"] is not None and not f.metadata["choices"]:
        notes.append(f">= {f.metadata['min']}")
    if f.metadata["execution"]:
        notes.append("*execution*")
    return f"| `{key}` | `{_flow_yaml(value)}` | {'; '.join(notes)} |"


def _flow_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def commented_yaml(cfg: Config) -> str:
    """The config as YAML, each key followed by its meaning (`--print-config`)."""
    lines, section = [], None
    for key, f, value in settings(cfg):
        head, _, name = key.rpartition(".")
        if head != section and head:
            lines.append(f"{head}:")
        section = head
        lines.append(f"{'  ' if head else ''}{name}: {_flow_yaml(value)}  # {f.metadata['help']}")
    return "\n".join(lines) + "\n"
