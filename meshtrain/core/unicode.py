"""Text is valid Unicode or one error (issue 57, class 3): no reader substitutes U+FFFD for bytes that
are not UTF-8, and no lone surrogate (a JSON escape like "\\ud800", an undecodable byte Python kept
as a surrogate escape in argv) reaches a tokenizer, which would replace it or fail deep inside.

`decode` turns a file's bytes into text strictly, naming the line and byte of the first undecodable
one; `check` walks a parsed value (text, or lists, tuples and dicts of it) for lone surrogates, the
only characters of a Python str that UTF-8 cannot encode.
"""
from __future__ import annotations

from meshtrain.core.errors import UserError


def decode(data: bytes, where: str, fix: str, first_line: int | None = 1) -> str:
    """`data` as UTF-8, or one UserError naming `where`, the line (counted from `first_line`; None:
    `where` names the line) and the first undecodable byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start:e.start + 1]
        if first_line is None:
            raise UserError(f"{where}: byte {bad!r} ({e.start:,} into the line) is not UTF-8 ({e.reason}); "
                            f"{fix}") from None
        line = first_line + data.count(b"\n", 0, e.start)
        raise UserError(f"{where}, line {line:,}: byte {bad!r} (offset {e.start:,}) is not UTF-8 ({e.reason}); "
                        f"{fix}") from None


def check(value, where: str, fix: str):
    """`value` if no text in it holds a lone surrogate, else one UserError naming `where` and the
    character."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"{where}: the text holds a lone surrogate U+{ord(value[e.start]):04X} at character "
                            f"{e.start:,}, which is not valid Unicode; {fix}") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            check(item, where, fix)
    elif isinstance(value, dict):
        for key, item in value.items():
            check(key, where, fix)
            check(item, where, fix)
    return value
