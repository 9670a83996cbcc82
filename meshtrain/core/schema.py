"""Declared schemas of the files meshtrain reads: a value read from JSON or YAML is checked against its
file kind's schema where it is read, so a wrong type, a missing key or an absurd value is one UserError
naming the file and the key, never a KeyError or TypeError deep inside.

A schema is
- a type (`int`, `float`, `str`, `bool`; int excludes bool, float accepts int), or `Int(min, max)`;
- a tuple of the allowed values (`("uint16", "uint32")`);
- `[item]`: a list whose every item has the schema `item`;
- `{key: schema}`: a mapping holding every key (`Optional(schema)` for a key that may be missing);
  keys it does not declare are allowed (later versions add fields);
- `Table(schema)`: a mapping of any text keys, each value with the schema `schema`;
- `Nullable(schema)`: null, or a value with the schema `schema`;
- `object`: any value (a part that another reader checks, e.g. a config section);
- `Settings(cls)`: a mapping whose keys that name fields of the dataclass `cls` (declared with
  meshtrain/core/bounds.py `setting`) hold the field's type, one of its choices, within its bounds
  (a model section recorded in run.json or a checkpoint: its family's spec declares it);
- `Name()`: a file name inside the folder being read (no separators, not `.` or `..`);
- `Line()`: text without line breaks or other unprintable characters (a value an error line quotes).

`read_json(path, schema, fix)` reads a JSON file and checks it: unreadable, not UTF-8, not JSON
(or nested past Python's recursion limit) and the wrong shape are each one UserError naming the file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from meshtrain.core import unicode
from meshtrain.core.bounds import Bounds
from meshtrain.core.errors import UserError


@dataclass(frozen=True)
class Optional:
    schema: object


@dataclass(frozen=True)
class Int:
    min: int = 0
    max: int = 2 ** 63 - 1


@dataclass(frozen=True)
class Nullable:
    schema: object


@dataclass(frozen=True)
class Table:
    schema: object


@dataclass(frozen=True)
class Settings:
    cls: type


@dataclass(frozen=True)
class Line:
    """Printable text (an error line that shows it stays one line)."""


@dataclass(frozen=True)
class Name:
    """A file name inside the folder (a manifest never points outside it)."""


def shown(value, limit: int = 40) -> str:
    """A value (or an exception) quoted in an error line, at most `limit` characters."""
    text = str(value) if isinstance(value, Exception) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def printable(name: str) -> str:
    """A key or name read from a file, as an error line shows it: as it is, or quoted where it holds a
    line break or another unprintable character (the error stays one line)."""
    return name if name.isprintable() else repr(name)


def _expected(schema) -> str:
    if isinstance(schema, Int):
        return f"an integer from {schema.min:,} to {schema.max:,}"
    if isinstance(schema, Name):
        return "a file name in the folder"
    if isinstance(schema, Line):
        return "text on one line"
    if isinstance(schema, tuple):
        return "one of " + ", ".join(map(repr, schema))
    if isinstance(schema, Nullable):
        return f"null or {_expected(schema.schema)}"
    if isinstance(schema, list):
        return "a list"
    if isinstance(schema, (dict, Table, Settings)):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "text", bool: "true or false"}[schema]


def _fits(value, schema) -> bool:
    if isinstance(schema, Int):
        return type(value) is int and schema.min <= value <= schema.max
    if isinstance(schema, Name):
        return type(value) is str and value not in ("", ".", "..") and not any(c in value for c in "/\\\0")
    if isinstance(schema, Line):
        return type(value) is str and value.isprintable()
    if isinstance(schema, tuple):
        return any(type(value) is type(v) and value == v for v in schema)
    if isinstance(schema, Nullable):
        return value is None or _fits(value, schema.schema)
    if isinstance(schema, list):
        return type(value) is list
    if isinstance(schema, (dict, Table, Settings)):
        return type(value) is dict
    if schema is object:
        return True
    if schema is float:
        return type(value) in (int, float) and math.isfinite(value)
    return type(value) is schema


@functools.cache
def _settings(cls) -> tuple:
    """(field, schema) of each field of the dataclass `cls`: its choices, or its type (text on one line;
    any other type, e.g. a list or a mapping, is not checked here)."""
    hints = typing.get_type_hints(cls)
    kinds = {int: int, float: float, bool: bool, str: Line()}
    return tuple((f, f.metadata.get("choices") or kinds.get(hints[f.name], object)) for f in dataclasses.fields(cls))


def check(value, schema, where: str, fix: str, key: str = "") -> None:
    """UserError `<where>: <key> must be <what>, not <value>; <fix>` at the first place `value` does not
    fit `schema` (`where` names the file, `fix` says what to do)."""
    if not _fits(value, schema):
        at = f"{key} must be" if key else "must hold"
        raise UserError(f"{where}: {at} {_expected(schema)}, not {shown(value)}; {fix}")
    if isinstance(schema, Nullable):
        if value is not None:
            check(value, schema.schema, where, fix, key)
    elif isinstance(schema, list):
        for i, item in enumerate(value):
            check(item, schema[0], where, fix, f"{key}[{i}]")
    elif isinstance(schema, Table):
        for name, item in value.items():
            check(item, schema.schema, where, fix, f"{key}.{printable(name)}" if key else printable(name))
    elif isinstance(schema, Settings):
        for f, kind in _settings(schema.cls):
            if f.name in value:
                inner = f"{key}.{f.name}" if key else f.name
                check(value[f.name], kind, where, fix, inner)
                problem = kind in (int, float) and f.metadata.get("bounds", Bounds()).problem(value[f.name])
                if problem:
                    raise UserError(f"{where}: {inner}={value[f.name]!r} {problem}; {fix}")
    elif isinstance(schema, dict):
        for name, inner in schema.items():
            optional = isinstance(inner, Optional)
            if name not in value:
                if optional:
                    continue
                raise UserError(f"{where}: the key {f'{key}.{name}' if key else name} is missing; {fix}")
            check(value[name], inner.schema if optional else inner, where, fix, f"{key}.{name}" if key else name)


def parse_json(text: str | bytes, where: str, fix: str):
    """A JSON document (text, or UTF-8 bytes), or one UserError naming `where`: not UTF-8, not JSON,
    nested deeper than Python's recursion limit, an integer of more than 4,300 digits, a lone surrogate
    escape ("\\ud800": not Unicode, meshtrain/core/unicode.py)."""
    try:
        value = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is unreadable (not UTF-8: byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                        f"{fix}") from None
    except (ValueError, RecursionError) as e:
        raise UserError(f"{where} is unreadable (not JSON: {shown(e, 100)}); {fix}") from None
    return unicode.check(value, where, fix)


def read_json(path: str | Path, schema, fix: str, where: str | None = None):
    """The JSON file `path`, checked against `schema`; every problem one UserError naming `where`
    (default: the path) and ending with `fix`."""
    where = where or str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{where} is unreadable ({shown(e, 100)}); {fix}") from None
    value = parse_json(data, where, fix)
    check(value, schema, where, fix)
    return value
