"""Where documents come from: source kinds, their detection, and reading them in units.

A raw source (text files, jsonl, Parquet, a Hugging Face `datasets` folder, the Python standard
library) is split into `Unit`s (a file, a byte range of a jsonl file, a Parquet row group, a run of
Arrow record batches) that can be read independently and in any process; reading the units in order
gives the documents in order. `prepare` tokenizes units in parallel; training tokenizes small raw
sources the same way on load.
"""
from __future__ import annotations

import itertools
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshtrain.core import unicode
from meshtrain.core.errors import UserError
from meshtrain.data.tokens import MANIFEST

# data.kind's values; auto detects one from the path (`detect`).
KINDS = ("auto", "text", "jsonl", "parquet", "hf_datasets", "tokens", "prepared", "synthetic", "stdlib")
RAW_KINDS = ("text", "jsonl", "parquet", "hf_datasets", "stdlib")  # documents, tokenized by a tokenizer
SUFFIXES = {".bin": "tokens", ".jsonl": "jsonl", ".parquet": "parquet"}  # a file's kind; others are text
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".tex")  # in a folder of text
UNIT_BYTES = 8 << 20  # a jsonl byte range or a run of Arrow batches: the work of one task in prepare
HF_STATE, HF_SPLITS = "state.json", "dataset_dict.json"  # what Dataset(Dict).save_to_disk writes


@dataclass(frozen=True)
class Unit:
    kind: str  # text, jsonl, parquet or arrow
    file: str
    lo: int = 0  # jsonl: byte range; parquet: row groups; arrow: record batches
    hi: int = 0


UNICODE_FIX = "save the source as valid UTF-8 text"
BOM = "\ufeff"  # the byte order mark some editors write first: no part of the text

def stdlib_files() -> list[Path]:
    """The Python standard library's own .py files: a real corpus every machine has offline. The walk
    prunes the folders it skips (site-packages alone can hold tens of thousands of files)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _files(folder: Path, suffix: str) -> list[Path]:
    """`suffix` files under `folder`, skipping hidden and bookkeeping ones (Spark's _SUCCESS, .crc)."""
    return sorted(p for p in folder.rglob(f"*{suffix}") if p.is_file()
                  and not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts))


def detect(path: str, kind: str = "auto", flag: str | None = None) -> str:
    """`kind`, or for auto: stdlib without a path; a file by its suffix (text otherwise); a folder by
    its contents (manifest.json: prepared; save_to_disk files: hf_datasets; else .jsonl files, else
    .parquet files, else text files). `flag`: the command's name for the path in errors (None:
    training's --data)."""
    if kind != "auto":
        return kind
    if not path:
        return "stdlib"
    p = Path(path)
    if not p.exists():
        if flag:
            raise UserError(f"{flag} {path!r} does not exist; pass an existing file or folder")
        raise UserError(f"data path {path!r} does not exist; pass --data FILE_OR_FOLDER "
                        f"(or omit it to train on the Python standard library)")
    if p.is_file():
        return SUFFIXES.get(p.suffix, "text")
    if (p / MANIFEST).is_file():
        return "prepared"
    if (p / HF_STATE).is_file() or (p / HF_SPLITS).is_file():
        return "hf_datasets"
    return next((k for s, k in SUFFIXES.items() if k != "tokens" and _files(p, s)), "text")


def units(kind: str, path: str) -> list[Unit]:
    """The source's units in document order."""
    if kind == "stdlib":
        return [Unit("text", str(f)) for f in stdlib_files()]
    p = Path(path)
    if not p.exists():
        raise UserError(f"data path {path!r} does not exist; pass an existing file or folder")
    if kind == "text":
        files = [p] if p.is_file() else sorted(
            f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        return [Unit("text", str(f)) for f in _need(files, p, f"text files ({', '.join(TEXT_SUFFIXES)})")]
    if kind == "jsonl":
        files = _need([p] if p.is_file() else _files(p, ".jsonl"), p, ".jsonl files")
        return [Unit("jsonl", str(f), lo, min(lo + UNIT_BYTES, f.stat().st_size))
                for f in files for lo in range(0, f.stat().st_size, UNIT_BYTES)]
    if kind == "parquet":
        files = _need([p] if p.is_file() else _files(p, ".parquet"), p, ".parquet files")
        return [Unit("parquet", str(f), g, g + 1) for f in files for g in range(_parquet(f).num_row_groups)]
    if kind == "hf_datasets":
        return [u for f in _arrow_files(p) for u in _arrow_units(f)]
    raise UserError(f"data.kind={kind} holds tokens, not documents; pass a text, jsonl, Parquet or "
                    f"datasets source")


def _need(files: list[Path], where: Path, what: str) -> list[Path]:
    if not files:
        raise UserError(f"no {what} under {where}; pass a folder that holds some, or set data.kind")
    return files


def source_bytes(parts: list[Unit]) -> int:
    return sum(Path(f).stat().st_size for f in {u.file for u in parts})


def read(unit: Unit, field: str | None, value=None, columns: tuple = ()) -> Iterator:
    """The unit's documents: a text file whole; jsonl lines' / Parquet or Arrow rows' `field`, checked
    by `value(field value, field, where)` (default: text; meshtrain/data/chat.py: a conversation);
    `field` None: whole rows, jsonl lines' or Parquet/Arrow rows' `columns` as a dict
    (meshtrain/data/preference.py: a preference pair). Text that is not valid Unicode (bytes that are not
    UTF-8, a lone surrogate) is one error naming the file and line (meshtrain/core/unicode.py)."""
    value = value or _text
    if unit.kind == "text":
        if value is not _text:
            what = "preference data is rows of prompt, chosen and rejected" if field is None else \
                "chat data is rows of messages"
            raise UserError(f"{unit.file} is a text file; {what} (jsonl, Parquet or a datasets folder)")
        yield unicode.decode(Path(unit.file).read_bytes(), unit.file, UNICODE_FIX).removeprefix(BOM)
    elif unit.kind == "jsonl":
        yield from _jsonl(unit, field, value)
    else:
        names = list(columns) if field is None else [field]
        table = _parquet_rows(unit, names) if unit.kind == "parquet" else _arrow_rows(unit, names)
        try:  # Arrow's strings are UTF-8 (its writers refuse surrogates); another writer's bad bytes are one line
            rows = table.to_pylist() if field is None else table.column(field).to_pylist()
        except UnicodeDecodeError as e:
            raise UserError(f"{unit.file} ({unit.kind} part {unit.lo}): a string is not UTF-8 ({e.reason}); "
                            f"{UNICODE_FIX}") from None
        for i, row in enumerate(rows):
            yield value(row, field, f"{unit.file} ({unit.kind} part {unit.lo}, row {i})")


def _text(value, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: {field!r} is {type(value).__name__}, not text; set data.text_field "
                        f"(--text-field) to a text field")
    return value


def _jsonl(unit: Unit, field: str, value) -> Iterator:
    """Lines that start in [lo, hi): a line crossing `hi` belongs to this unit, not the next."""
    with open(unit.file, "rb") as f:
        if unit.lo:
            f.seek(unit.lo - 1)
            f.readline()
        while (at := f.tell()) < unit.hi and (line := f.readline()):
            if not line.strip():
                continue
            where = f"{unit.file}, line at byte {at}"
            line = line.removeprefix(BOM.encode()) if at == 0 else line  # an editor's byte order mark: not text
            try:
                row = unicode.check(json.loads(unicode.decode(line, where, UNICODE_FIX, None)), where, UNICODE_FIX)
            except ValueError as e:
                raise UserError(f"{unit.file}, line at byte {at}: not JSON ({e}); fix the line or the "
                                f"file (one JSON object per line)") from None
            if field is None:
                yield value(row, field, f"{unit.file}, line at byte {at}")
                continue
            if not isinstance(row, dict) or field not in row:
                keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
                raise UserError(f"{unit.file}, line at byte {at}: no field {field!r} (has: {keys}); set "
                                f"data.text_field (--text-field) to the field holding the text")
            yield value(row[field], field, f"{unit.file}, line at byte {at}")


def _parquet(file: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{file} is not a Parquet file ({e}); remove it or set data.kind") from None


def _check_columns(file: str, names: list[str], fields: list[str]) -> None:
    """Every one of `fields` is a column: one field is the text (data.text_field), several a whole row's."""
    for field in fields:
        if field not in names:
            fix = ("set data.text_field (--text-field) to the column holding the text" if len(fields) == 1 else
                   f"a row needs the columns {', '.join(fields)}")
            raise UserError(f"{file} has no column {field!r} (has: {', '.join(names)}); {fix}")


def _parquet_rows(unit: Unit, fields: list[str]):
    parquet = _parquet(Path(unit.file))
    _check_columns(unit.file, parquet.schema_arrow.names, fields)
    return parquet.read_row_groups(range(unit.lo, unit.hi), columns=fields)


def _arrow_files(folder: Path) -> list[Path]:
    """A Dataset.save_to_disk folder's Arrow files (state.json lists them)."""
    if (folder / HF_SPLITS).is_file():
        splits = json.loads((folder / HF_SPLITS).read_text()).get("splits", [])
        raise UserError(f"{folder} is a DatasetDict with splits {', '.join(splits)}; pass one split's "
                        f"folder, e.g. --data {folder / (splits[0] if splits else 'train')}")
    if not (folder / HF_STATE).is_file():
        raise UserError(f"{folder} is not a datasets save_to_disk folder (no {HF_STATE}); pass one "
                        f"written by Dataset.save_to_disk, or set data.kind")
    state = json.loads((folder / HF_STATE).read_text())
    return [folder / f["filename"] for f in state.get("_data_files", [])]


def _arrow_stream(file: Path):
    import pyarrow as pa

    return pa.ipc.open_stream(pa.memory_map(str(file)))  # zero-copy: skipping batches reads nothing


def _arrow_units(file: Path) -> list[Unit]:
    """Runs of consecutive record batches of about UNIT_BYTES each."""
    sizes = [batch.nbytes for batch in _arrow_stream(file)]
    cuts, size = [0], 0
    for i, nbytes in enumerate(sizes):
        if size >= UNIT_BYTES:
            cuts, size = cuts + [i], 0
        size += nbytes
    return [Unit("arrow", str(file), lo, hi) for lo, hi in zip(cuts, cuts[1:] + [len(sizes)]) if hi > lo]


def _arrow_rows(unit: Unit, fields: list[str]):
    import pyarrow as pa

    stream = _arrow_stream(Path(unit.file))
    _check_columns(unit.file, stream.schema.names, fields)
    batches = [b.select(fields) for b in itertools.islice(stream, unit.lo, unit.hi)]
    return pa.Table.from_batches(batches, schema=pa.schema([stream.schema.field(f) for f in fields]))
