"""Downstream multiple-choice tasks: the file format, the config entries (`eval.tasks`) and the
requests a scorer rates (meshtrain/engine/scoring.py).

A task file is JSON lines, one item each, as HellaSwag, ARC and PIQA are commonly normalised:

    {"context": "ROMEO: But, soft! what light through yonder", "choices": ["window breaks?", "door"], "label": 0}

Each choice is scored as lm-eval-harness scores a `multiple_choice` task: the log-likelihood of the
continuation " " + choice (its `target_delimiter`) given the context; the pair is encoded as
lm-eval's `_encode_pair` does (whitespace ending the context moves into the continuation, and the
continuation's tokens are those of context + continuation past the context's own, so a merge at the
boundary is the tokenizer's whole-text one). An empty context is the tokenizer's document end
(`document_end`: EOS, or a newline).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.core import schema
from meshtrain.core.errors import UserError
from meshtrain.data.mixture import names
from meshtrain.data.tokenizer import document_end

ENTRY_KEYS = ("name", "path", "limit")  # an eval.tasks entry's keys; name defaults to the file's, limit to all
DELIMITER = " "  # between context and choice: lm-eval-harness's default target_delimiter


@dataclass(frozen=True)
class TaskEntry:
    name: str  # in metrics: eval_acc_<name>, eval_acc_norm_<name>
    path: str
    limit: int  # the file's first `limit` items; 0 = all


@dataclass(frozen=True)
class Task:
    """A task read and encoded: its items and every choice's (context ids, continuation ids), in order."""
    name: str
    items: list
    requests: list


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int


def entries(tasks: list, key: str = "eval.tasks") -> list[TaskEntry]:
    """The checked entries of `eval.tasks` ([{name, path, limit}], name and limit optional); every
    mistake a one-line UserError naming the entry and the fix. The files are read by `read`."""
    out = []
    for i, entry in enumerate(tasks):
        where = f"{key}[{i}]"
        if isinstance(entry, str):  # a bare path
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise UserError(f"{where}={entry!r} is not a mapping; write each task as {{name: ..., path: FILE.jsonl}}")
        unknown = [str(k) for k in entry if k not in ENTRY_KEYS]
        if unknown:
            raise UserError(f"{where} has unknown key {unknown[0]!r}; its keys are {', '.join(ENTRY_KEYS)}")
        path, limit = entry.get("path"), entry.get("limit", 0)
        if not isinstance(path, str) or not path:
            raise UserError(f"{where} needs a path: {{name: ..., path: FILE.jsonl}}")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise UserError(f"{where}.limit={limit!r} must be an integer >= 0 (0 = every item)")
        name = entry.get("name", names([path])[0])
        if not isinstance(name, str) or not name or names([name])[0] != name:
            raise UserError(f"{where}.name={name!r} must be letters, digits, '-' or '_' (it names metrics)")
        out.append(TaskEntry(name, path, limit))
    seen = [e.name for e in out]
    for i, name in enumerate(seen):
        if name in seen[:i]:
            raise UserError(f"{key}[{i}] repeats the task name {name!r}; give each task its own name")
    return out


def read(path: str | Path, limit: int = 0) -> list[Item]:
    """The items of a task file (the first `limit`, 0 = all), each checked: a UserError names the
    file, the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"task file {path} not found; eval.tasks' paths name JSON-lines files of "
                        f"{{context, choices, label}} items")
    try:
        lines = path.read_bytes().splitlines()  # only \n and \r end a line (JSON text may hold U+2028)
    except OSError as e:
        raise UserError(f"task file {path} cannot be read ({e.strerror}); check the file") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        items.append(_item(line, f"{path} line {number}"))
        if limit and len(items) == limit:
            break
    if not items:
        raise UserError(f"task file {path} holds no items; write one JSON object per line: "
                        f'{{"context": ..., "choices": [...], "label": INDEX}}')
    return items


ITEM_SCHEMA = {"context": str, "choices": [str], "label": schema.Int()}  # meshtrain/core/schema.py


def _item(line: bytes, where: str) -> Item:
    fix = 'write {"context": TEXT, "choices": [TEXT, ...], "label": INDEX}'
    record = schema.parse_json(line, where, fix)
    schema.check(record, ITEM_SCHEMA, where, fix)
    context, choices, label = record["context"], record["choices"], record["label"]
    if len(choices) < 2 or not all(choices):
        raise UserError(f"{where}: choices must be a list of at least 2 non-empty texts; {fix}")
    if label >= len(choices):
        raise UserError(f"{where}: label={label!r} is not an index into its {len(choices)} choices; {fix}")
    return Item(context, tuple(choices), label)


def encode_pair(tok, context: str, continuation: str) -> tuple[np.ndarray, np.ndarray]:
    """(context ids, continuation ids) as lm-eval-harness's `_encode_pair` makes them (module doc)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return document_end(tok).astype(np.int32), np.asarray(tok.encode(continuation), np.int32)
    whole, head = (np.asarray(ids, np.int32) for ids in tok.encode_batch([context + continuation, context]))
    return head, whole[len(head):]


def requests(tok, items: list[Item]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every choice of every item as a (context ids, continuation ids) pair, items in order."""
    return [encode_pair(tok, item.context, DELIMITER + choice) for item in items for choice in item.choices]


def load(tasks: list, tok, key: str = "eval.tasks") -> list[Task]:
    """The tasks of `eval.tasks` (or entries like it) read and encoded with `tok` (the run's tokenizer)."""
    found = entries(tasks, key)
    if found and tok is None:
        raise UserError(f"{key} need a tokenizer to encode their text, and the data names none (synthetic data, or "
                        f"token files without one); set data.tokenizer")
    out = []
    for entry in found:
        items = read(entry.path, entry.limit)
        out.append(Task(entry.name, items, requests(tok, items)))
    return out


def choice_metrics(items: list[Item], loglikelihoods) -> dict[str, float]:
    """acc: the share of items whose most likely choice is the label; acc_norm: the same with each
    log-likelihood divided by its choice's length, as lm-eval-harness's acc_norm (its code divides by
    the length in characters, `len(choice)`; in UTF-8 bytes, its acc_bytes, for ASCII the same).
    Ties go to the first choice, as numpy's argmax."""
    ll = np.asarray(loglikelihoods, np.float64)
    right = right_norm = start = 0
    for item in items:
        scores = ll[start:start + len(item.choices)]
        start += len(item.choices)
        right += int(np.argmax(scores)) == item.label
        right_norm += int(np.argmax(scores / np.array([len(c) for c in item.choices], np.float64))) == item.label
    return {"acc": right / len(items), "acc_norm": right_norm / len(items)}
