"""Declared schemas of the files meshtrain reads: a value read from JSON or YAML is checked against its
file kind's schema where it is read, so a wrong type, a missing key or an absurd value is one UserError
naming the file and the key, never a KeyError or TypeError deep inside.

A schema is
- a type (`int`, `float`, `str`, `bool`; int excludes bool, float accepts int), or `Int(min, max)`;
- a tuple of the allowed values (`("uint16", "uint32")`);
- `[item]`: a list whose every item has the schema `item`;
- `{key: schema}`: a mapping holding every key (`Optional(schema)` for a key that may be missing);
  keys it does not declare are allowed (later versions add fields);
- `Name()`: a file name inside the folder being read (no separators, not `.` or `..`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.core.errors import UserError


@dataclass(frozen=True)
class Optional:
    schema: object


@dataclass(frozen=True)
class Int:
    min: int = 0
    max: int = 2 ** 63 - 1


@dataclass(frozen=True)
class Name:
    """A file name inside the folder (a manifest never points outside it)."""


def shown(value, limit: int = 40) -> str:
    """A value (or an exception) quoted in an error line, at most `limit` characters."""
    text = str(value) if isinstance(value, Exception) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _expected(schema) -> str:
    if isinstance(schema, Int):
        return f"an integer from {schema.min:,} to {schema.max:,}"
    if isinstance(schema, Name):
        return "a file name in the folder"
    if isinstance(schema, tuple):
        return "one of " + ", ".join(map(repr, schema))
    if isinstance(schema, list):
        return "a list"
    if isinstance(schema, dict):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "text", bool: "true or false"}[schema]


def _fits(value, schema) -> bool:
    if isinstance(schema, Int):
        return type(value) is int and schema.min <= value <= schema.max
    if isinstance(schema, Name):
        return type(value) is str and value not in ("", ".", "..") and "/" not in value and "\\" not in value
    if isinstance(schema, tuple):
        return any(type(value) is type(v) and value == v for v in schema)
    if isinstance(schema, list):
        return type(value) is list
    if isinstance(schema, dict):
        return type(value) is dict
    if schema is float:
        return type(value) in (int, float) and math.isfinite(value)
    return type(value) is schema


def check(value, schema, where: str, fix: str, key: str = "") -> None:
    """UserError `<where>: <key> must be <what>, not <value>; <fix>` at the first place `value` does not
    fit `schema` (`where` names the file, `fix` says what to do)."""
    if not _fits(value, schema):
        at = f"{key} must be" if key else "must hold"
        raise UserError(f"{where}: {at} {_expected(schema)}, not {shown(value)}; {fix}")
    if isinstance(schema, list):
        for i, item in enumerate(value):
            check(item, schema[0], where, fix, f"{key}[{i}]")
    elif isinstance(schema, dict):
        for name, inner in schema.items():
            optional = isinstance(inner, Optional)
            if name not in value:
                if optional:
                    continue
                raise UserError(f"{where}: the key {f'{key}.{name}' if key else name} is missing; {fix}")
            check(value[name], inner.schema if optional else inner, where, fix, f"{key}.{name}" if key else name)
