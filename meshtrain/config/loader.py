"""Config files and overrides: YAML loading, dotted `--set` overrides, renamed keys, the reference.

The sections are declared in meshtrain/config/spec.py (`ModelSpec`, `ParallelPlan`, `OptimSpec`, ...);
their checks in meshtrain/config/validate.py. Every user-facing mistake raises `UserError` with a
one-line message that names the problem and the fix; the CLI prints it as `error: ...` and exits 2.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import yaml

from meshtrain.config.spec import (  # noqa: F401
    MAX_SIMULATED_DEVICES,
    RENAMED,
    CheckpointConfig,
    Config,
    DataConfig,
    GuardConfig,
    ModelSpec,
    OptimSpec,
    ParallelPlan,
    TrainConfig,
    settings,
)
from meshtrain.config.validate import check_config
from meshtrain.core import unicode
from meshtrain.core.bounds import Bounds
from meshtrain.core.console import NOTICE, log
from meshtrain.core.errors import UserError
from meshtrain.models import FAMILIES, declaring, with_family

DEFAULT_RUN = "default"  # the run folder's name without --config: runs/default


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


# Limits of a YAML text (a config, a sweep space, a --set value): a config is a few KB; an alias bomb
# (anchors of anchors) expands a few lines into billions of values, and deep nesting overflows the stack.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # the values of the document with every alias expanded
MAX_YAML_DEPTH = 64
_MERGE = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    """A YAML text meshtrain will not read: its message says why and what to do."""


def _check_duplicate_keys(node: yaml.MappingNode) -> None:
    """A key given twice in one mapping is an error (YAML's loaders keep the last in silence); merge
    keys (`<<: *base`) may be overridden, as YAML defines."""
    seen = {}
    for key, _ in node.value:
        if key.tag == _MERGE or not isinstance(key, yaml.ScalarNode):
            continue
        if key.value in seen:
            raise _Refused(f"line {key.start_mark.line + 1}: key {key.value!r} is given twice (first on line "
                           f"{seen[key.value] + 1}); keep one")
        seen[key.value] = key.start_mark.line


def _expanded_size(root: yaml.Node) -> int:
    """The number of values of the document with aliases expanded (each alias counts what it names), the
    mappings checked for duplicate keys on the way; _Refused past the limits or for an alias cycle."""
    sizes, open_ = {}, set()

    def size(node, depth):
        if depth > MAX_YAML_DEPTH:
            raise _Refused(f"nested deeper than {MAX_YAML_DEPTH} levels")
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_:
            raise _Refused("an alias refers to a value that contains it")
        open_.add(id(node))
        if isinstance(node, yaml.MappingNode):
            _check_duplicate_keys(node)
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        total = 1 + sum(size(child, depth + 1) for child in children)
        if total > MAX_YAML_VALUES:
            raise _Refused(f"expands to more than {MAX_YAML_VALUES:,} values (aliases included)")
        open_.discard(id(node))
        sizes[id(node)] = total
        return total

    return size(root, 0)


def parse_yaml(text: str, source: str):
    """The YAML value of `text` (YAML 1.2-style scalars), read within the limits above; any problem is
    one UserError naming `source`."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise UserError(f"{source} is larger than {MAX_YAML_BYTES >> 20} MB; a config or search space is a few KB: "
                        f"check that this is the file you meant")
    loader = None
    try:
        loader = _Loader(text)  # its reader refuses control characters at once
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return unicode.check(loader.construct_document(node), source, "write the text as valid Unicode")
    except _Refused as e:
        raise UserError(f"{source}: {e}") from None
    except RecursionError:
        raise UserError(f"{source}: nested deeper than {MAX_YAML_DEPTH} levels") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}{where}: {problem}; fix the YAML syntax") from None
    finally:
        if loader is not None:
            loader.dispose()


class _Typed(str):
    """A `--set` value as the user typed it: text for text settings, YAML for the others."""


def _value(raw, key: str):
    return parse_yaml(raw, f"--set {key}") if isinstance(raw, _Typed) and raw.strip() else raw


def _coerce(value, typ, key: str):
    """Convert a YAML/CLI value to the field's declared type, or fail naming the key."""
    if typ is str and isinstance(value, _Typed):
        return str(value)  # never YAML-typed: --mesh 0x8 stays '0x8'
    value = _value(value, key)
    if value is None:
        raise UserError(f"{key} has no value; give one or remove the key")
    if typ is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{key}={value!r} is a {type(value).__name__}, not text; give one value")
        return str(value)
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
    if typ is list:  # its entries are checked by meshtrain/config/validate.py
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list (YAML [a, b, ...]), got {value!r}")
        return list(value)
    return _number(value, typ, key)


def _number(value, typ, key: str):
    """An int or float setting from YAML or text ('1_0' is 10); range and finiteness are checked by
    meshtrain/config/validate.py."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        if typ is float:
            return float(value)
        if isinstance(value, str):
            value = float(value) if any(c in value for c in ".eEnN") else int(value)
        if isinstance(value, float) and not value.is_integer():  # also NaN and infinity
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):
        raise UserError(f"{key}={value!r} is not a valid {typ.__name__}") from None


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    key = prefix + head
    if head not in names:
        if isinstance(obj, ModelSpec) and not rest and _other_familys_default(obj, head, value, key):
            return
        raise UserError(f"unknown config key {key!r}; valid keys here: {', '.join(names)}")
    current = getattr(obj, head)
    if isinstance(current, ModelSpec) and rest == "family":  # the family decides the section's keys
        return setattr(obj, head, with_family(current, _coerce(value, str, key + ".family")))
    if dataclasses.is_dataclass(current):
        if rest:
            return _set(current, rest, value, key + ".")
        value = _value(value, key)
        if not isinstance(value, dict):
            raise UserError(f"config key '{key}' is a section; set one of its fields, "
                            f"e.g. {key}.{dataclasses.fields(current)[0].name}=...")
        for k, v in sorted(value.items(), key=lambda kv: kv[0] != "family"):  # the family first
            _set(obj, f"{head}.{k}", v, prefix)
    elif hints[head] is dict and rest:
        current[rest] = _value(value, f"{key}.{rest}")
    elif rest:
        raise UserError(f"config key '{key}' has no field '{rest}'")
    else:
        setattr(obj, head, _coerce(value, hints[head], key))


def _other_familys_default(spec, name: str, value, key: str) -> bool:
    """True for a key of another family at that family's default (a run's config.yaml written
    before model keys moved to their families holds every family's, e.g. a llama run's
    num_experts: 0: they change nothing). Any other value is a UserError naming the families."""
    owners = declaring(name)
    if not owners:
        return False
    default = next(f for f in dataclasses.fields(owners[0].spec) if f.name == name)
    if _coerce(value, type(default.default), key) == default.default:
        return True
    names = ", ".join(f.name for f in owners)
    raise UserError(f"{key}={_value(value, key)}: the {spec.family} family has no {name} (the {names} "
                    f"famil{'y has' if len(owners) == 1 else 'ies have'} it); set model.family={owners[0].name}")


def split_override(item: str) -> tuple[str, str]:
    """A `--set` item's (key, raw value); argv's undecodable bytes (kept by Python as surrogate escapes)
    are one error."""
    key, eq, raw = unicode.check(item, f"--set {item.encode('utf-8', 'replace').decode()!r}",
                                 "pass the value as valid UTF-8").partition("=")
    if not eq or not key.strip():
        raise UserError(f"--set {item!r} needs the form key=value, e.g. --set train.steps=100")
    return key.strip(), raw


def apply_overrides(cfg: Config, overrides: dict | list[str]) -> Config:
    """Apply a mapping (from YAML) or a list of `a.b=value` strings (from `--set`)."""
    if isinstance(overrides, dict):
        pairs = [(str(k), v) for k, v in overrides.items()]
    else:
        pairs = [(key, _Typed(raw.strip())) for key, raw in map(split_override, overrides)]
    for key, value in pairs:
        for new_key, new_value in _renamed(key, value):
            _set(cfg, new_key, new_value)
    return cfg


_NOTICED: set[str] = set()


def _renamed(key: str, value) -> list[tuple[str, object]]:
    """[(key, value)] with an earlier version's key replaced by today's (spec.RENAMED), noting it once
    on stderr; a mapping given for a section that holds renamed keys is split into its keys."""
    for old, new in RENAMED.items():
        if key == old or key.startswith(old + "."):
            if old not in _NOTICED:
                _NOTICED.add(old)
                log.log(NOTICE, f"config key '{old}' is now '{new}' (docs/config.md)")
            if old == "train.microbatches" and _value(value, key) == 1:
                return []  # the old default, which a pipeline ignored: leaves parallel.microbatches as it is
            return [(new + key[len(old):], value)]
    if any(old.startswith(key + ".") for old in RENAMED):
        mapping = _value(value, key)
        if isinstance(mapping, dict):
            family_first = sorted(mapping.items(), key=lambda kv: kv[0] != "family")  # it decides the keys
            return [pair for k, v in family_first for pair in _renamed(f"{key}.{k}", v)]
    return [(key, value)]


POD_COMMENT = re.compile(r"^# pod[^:]*: (.+)$", re.MULTILINE)


def documented_pod(path) -> list[str]:
    """The `python -m meshtrain.plan` flags of the pod a shipped config documents in its `# pod:
    --devices N` comment (tests/test_shipped_configs.py plans each one). A pod config's layout is its
    own `parallel.mesh`; only the CPU-scale configs, whose mesh stays `data=-1` so they train on any
    device count, name the mesh their pod is planned on there (`--mesh M`)."""
    found = POD_COMMENT.search(Path(path).read_text())
    if not found:
        raise UserError(f"{path} documents no pod: add a '# pod: --devices N' comment")
    return found.group(1).split()


def read_text(path: Path, what: str) -> str:
    """A user-given text file's contents, or a UserError naming it (unreadable, not UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                        f"save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"{what} {path} cannot be read ({e.strerror}); check the path and its permissions") from None


def load_config(path: str | None = None, overrides: list[str] = (), recorded: bool = False) -> Config:
    """The config of the YAML file `path` with `overrides` (`--set` items), checked. `recorded`: a run's
    own config.yaml, read back (a setting it holds without effect is not refused: the run is what it is)."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {path} not found; see configs/ for the shipped ones")
        data = parse_yaml(read_text(p, "config file"), str(path)) or {}
        if not isinstance(data, dict):
            raise UserError(f"config file {path} must hold a mapping of sections")
        apply_overrides(cfg, data)
    apply_overrides(cfg, list(overrides))
    cfg.out = cfg.out or default_out(path)
    check_config(cfg, effective=not recorded)
    return cfg


def reference_markdown() -> str:
    """docs/config.md: every key, its type, default and meaning."""
    lines = ["# Configuration reference", "",
             "Generated by `python -m meshtrain.train --config-reference > docs/config.md` from "
             "`meshtrain/config/spec.py`",
             "(a test keeps it in sync). Set any key in a YAML file (`section: {key: value}`) or with",
             "`--set section.key=value`; `python -m meshtrain.train --print-config` prints the resolved",
             "values of a command. Numbers must be finite (no NaN or infinity) and integers at most",
             "2^31 - 1; a value outside its range is an error naming the key, the value and the range. A key",
             "marked *only where ...* has no effect elsewhere: changed from its default there, it is an error.", ""]
    for section in dataclasses.fields(Config):
        default = getattr(Config(), section.name)
        if not dataclasses.is_dataclass(default):
            continue
        lines += [f"## `{section.name}`: {section.metadata['help']}", "",
                  "| key | default | meaning |", "|---|---|---|"]
        lines += [_reference_row(key, f, value) for key, f, value in settings(default, f"{section.name}.")]
        lines.append("")
        if section.name == "model":
            lines += _families_reference()
    lines += ["## Top-level keys", "", "| key | default | meaning |", "|---|---|---|"]
    lines += [_reference_row(key, f, value) for key, f, value in settings() if "." not in key]
    lines += ["", "## Resuming", "",
              "A checkpoint resumes only into the same model: the `model` keys that define the weights must",
              "match it (compared after resolving `head_dim` and `mlp_dim`). Model keys marked *may change on",
              "resume*, and every `parallel`, `optim`, `data`, `train`, `eval`, `checkpoint`, `guard` and top-level",
              "key, may differ: a run moves to another mesh, remat policy or attention backend freely.", "",
              "## Renamed keys", "",
              "Keys of earlier versions still work; each prints a one-line notice naming its new place.", "",
              "| earlier key | today |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    lines += ["", "`train.microbatches: 1`, the earlier default (which a pipeline ignored), leaves "
              "`parallel.microbatches` as it is.", ""]
    return "\n".join(lines)


def _families_reference() -> list[str]:
    """The model families (`model.family`) and the keys each adds to the ones above."""
    lines = ["### Model families", "", "`model.family` picks one; the keys above are every family's, and a family",
             "may add its own (meshtrain/models/, docs/families.md).", "",
             "| family | what it is | its own keys |", "|---|---|---|"]
    lines += [f"| `{f.name}` | {f.help} | {', '.join(f'`{x.name}`' for x in f.fields()) or '-'} |"
              for f in FAMILIES.values()]
    for f in FAMILIES.values():
        if f.fields():
            lines += ["", f"#### Keys of the `{f.name}` family", "", "| key | default | meaning |", "|---|---|---|"]
            lines += [_reference_row(f"model.{x.name}", x, x.default) for x in f.fields()]
    return lines + [""]


def _reference_row(key: str, f, value) -> str:
    notes = [f.metadata["help"]]
    if f.metadata["choices"]:
        notes.append("one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"]))
    if f.metadata["bounds"] != Bounds() and not f.metadata["choices"]:
        notes.append(str(f.metadata["bounds"]))
    if not f.metadata["architecture"] and key.startswith("model."):
        notes.append("*may change on resume*")
    if applies := f.metadata.get("applies"):  # config/validate.py check_effective refuses it elsewhere
        where = " or ".join(f"`{v}`" for v in applies.values) if applies.values else "set"
        notes.append(f"*only where `{applies.key}` is {where}*")
    return f"| `{key}` | `{_flow_yaml(value)}` | {'; '.join(notes)} |"


def _flow_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def commented_yaml(cfg: Config) -> str:
    """The config as YAML, each key followed by its meaning (`--print-config`)."""
    lines, section = [], []
    for key, f, value in settings(cfg):
        *head, name = key.split(".")  # a section's sections (model.lora) nest one indent deeper
        shared = next((i for i, (a, b) in enumerate(zip(section, head)) if a != b), min(len(section), len(head)))
        lines += [f"{'  ' * i}{head[i]}:" for i in range(shared, len(head))]
        section = head
        lines.append(f"{'  ' * len(head)}{name}: {_flow_yaml(value)}  # {f.metadata['help']}")
    return "\n".join(lines) + "\n"
