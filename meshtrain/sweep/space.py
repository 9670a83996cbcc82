"""The search space: a YAML file of config key -> Optuna distribution, checked as configs before any
trial starts (every bound and choice with the base config), and sampled values as the `--set` items
of a trial's `python -m meshtrain.train` command."""
from __future__ import annotations

import json
from pathlib import Path

from meshtrain.config.loader import load_config, parse_yaml, split_override
from meshtrain.core.bounds import Bounds
from meshtrain.core.errors import UserError

FIELDS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"), "categorical": ("choices",)}
SWEEP_KEYS = {"out": "--out", "devices": "--devices", "checkpoint.resume": "(trials resume automatically)"}


def load_space(path: str) -> dict:
    """{config key: Optuna distribution} from a YAML mapping such as
    `optim.lr: {type: float, low: 1e-4, high: 1e-2, log: true}`."""
    if not Path(path).is_file():
        raise UserError(f"--space {path} not found")
    data = parse_yaml(Path(path).read_text(), f"--space {path}")
    if not isinstance(data, dict) or not data:
        raise UserError(f"--space {path} must map config keys to distributions, e.g. "
                        f"optim.lr: {{type: float, low: 1e-4, high: 1e-2, log: true}}")
    return {str(key): distribution(f"--space {path}: {key}", spec) for key, spec in data.items()}


def distribution(where: str, spec):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not isinstance(spec, dict) or "type" not in spec:
        raise UserError(f"{where}: expected a mapping with a type (float, int or categorical), got {spec!r}")
    kind = spec["type"]
    if kind not in FIELDS:
        raise UserError(f"{where}: type {kind!r} is not one of float, int, categorical")
    unknown = [f for f in spec if f != "type" and f not in FIELDS[kind]]
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r}; {kind} takes {', '.join(FIELDS[kind])}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{where}: choices must be a non-empty list, got {choices!r}")
        for c in choices:
            if not isinstance(c, (bool, int, float, str)):
                raise UserError(f"{where}: choice {c!r} is not a number, string or boolean")
        if len({json.dumps(c) for c in choices}) < len(choices):
            raise UserError(f"{where}: choices repeat a value: {choices}")
        return CategoricalDistribution(choices)
    if "low" not in spec or "high" not in spec:
        raise UserError(f"{where}: {kind} needs low and high")
    number, noun = ((int,), "an integer") if kind == "int" else ((int, float), "a number")
    for name in ("low", "high", "step"):
        value = spec.get(name)
        if name in spec and (isinstance(value, bool) or not isinstance(value, number)):
            raise UserError(f"{where}: {name}={value!r} is not {noun}")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
    for name in ("low", "high", "step"):
        if name in spec:
            Bounds().check(f"{where}: {name}", spec[name])  # finite (and an integer within int32)
    if not isinstance(log, bool):
        raise UserError(f"{where}: log={log!r} must be true or false")
    if low > high:
        raise UserError(f"{where}: low={low} is above high={high}")
    if log and low <= 0:
        raise UserError(f"{where}: log needs low > 0, got {low}")
    if log and step is not None:
        raise UserError(f"{where}: log and step cannot be combined")
    if step is not None and step <= 0:
        raise UserError(f"{where}: step={step} must be > 0")
    if kind == "int":
        return IntDistribution(low, high, log=log, step=step or 1)
    return FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))


def as_set(value) -> str:
    """A sampled value as meshtrain's --set reads it (YAML scalars; text settings take it verbatim)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def param_sets(params: dict) -> list[str]:
    """Sampled values as --set items: `optim.lr=0.003 train.seed=2`."""
    return [f"{key}={as_set(value)}" for key, value in params.items()]


def train_args(config: str | None, sets: list[str], out) -> list[str]:
    """The arguments of `python -m meshtrain.train` for one trial's run."""
    return [*(["--config", config] if config else []), *(a for item in sets for a in ("--set", item)),
            "--out", str(out)]


def suggest(trial, key: str, dist):
    from optuna.distributions import FloatDistribution, IntDistribution

    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(key, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_categorical(key, dist.choices)


def check_space(config: str | None, sets: list[str], space: dict, space_path: str):
    """The base config (config + --set), once every bound and choice of the space gives a valid config
    by itself; unknown keys and bad values are found here, before any trial starts."""
    set_keys = [split_override(item)[0] for item in sets]
    for key, flag in SWEEP_KEYS.items():
        if key in space or key in set_keys:
            raise UserError(f"{key} is set by the sweep for each trial; use {flag} of python -m meshtrain.sweep")
    both = [key for key in space if key in set_keys]
    if both:
        raise UserError(f"{both[0]} is in --space {space_path} and in --set; keep it in one of them")
    base = load_config(config, sets)
    for key, dist in space.items():
        for value in getattr(dist, "choices", None) or (dist.low, dist.high):
            try:
                load_config(config, [*sets, f"{key}={as_set(value)}"])
            except UserError as e:
                raise UserError(f"--space {space_path}: {e}") from None
    if not base.train.eval_every:
        raise UserError("the sweep minimizes eval_loss, but train.eval_every is 0; set it, e.g. "
                        "--set train.eval_every=50")
    return base

