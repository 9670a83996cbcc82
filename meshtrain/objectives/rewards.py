"""Rewards of reinforcement learning with verifiable rewards (train.objective=grpo): host Python,
called on a rollout's completions as text. `rl.reward` is a weighted sum of terms,
comma-separated, each `[weight*]name`, e.g. `exact_answer,0.2*format`:

- `exact_answer`: 1 where the completion's final answer equals the row's `answer`, else 0. The
  final answer of a text is the content of its last \\boxed{...}, else what follows its last '####',
  else its last number; two answers are equal as numbers where both are numbers (commas dropped:
  "1,000" = "1000.0"), else as text with surrounding whitespace removed.
- `format`: 1 where the completion matches rl.format_pattern whole (`re.fullmatch`, `.` matching
  newlines), else 0.
- `module:function` (a user's): called as function(prompts, completions, rows) on a batch, the
  three lists of one length (the prompts' and completions' text, the rows as the prompt data holds
  them: `answer` and any other field), returning one finite number per completion.

A term that raises, returns the wrong count or a non-finite number is one `UserError` naming the
term and the row (a batch that raised is rerun a row at a time to find it), never a silent zero.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from meshtrain.core.errors import UserError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> str:
    """The answer a completion ends with: its last \\boxed{...}'s content, else the text after its
    last '####', else its last number, else the whole text (stripped)."""
    boxed = text.rfind("\\boxed{")
    if boxed >= 0:
        depth, start = 0, boxed + len("\\boxed{")
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth < 0:
                return text[start:i].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def same_answer(got: str, want) -> bool:
    """Equal as numbers where both parse as numbers (commas dropped), else as stripped text."""
    got, want = str(got).strip(), str(want).strip()
    as_number = lambda s: float(s.replace(",", "")) if NUMBER.fullmatch(s) else None
    a, b = as_number(got), as_number(want)
    return a == b if a is not None and b is not None else got == want


def exact_answer(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """1 where the completion's `final_answer` is the row's 'answer' (`same_answer`), else 0; the data's
    loader checks that every row has one (`needs_answer`)."""
    return [float(same_answer(final_answer(c), r["answer"])) for c, r in zip(completions, rows)]


def needs_answer(terms) -> bool:
    return any(t.fn is exact_answer for t in terms)


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)
    return lambda prompts, completions, rows: [float(compiled.fullmatch(c) is not None) for c in completions]


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    weight: float
    fn: Callable


def parse(spec: str, format_pattern: str = "") -> list[Term]:
    """`rl.reward`'s terms: 'exact_answer', 'format' or 'module:function', each with its weight (1
    unless `weight*` precedes it). A bad term, an unknown name, a module or function that does not
    import, or `format` without rl.format_pattern is one UserError."""
    terms = []
    for raw in spec.split(","):
        text = raw.strip()
        weight, _, name = text.rpartition("*") if "*" in text else ("1", "", text)
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not name or not math.isfinite(w):
            raise UserError(f"rl.reward term {text!r} is not [weight*]name; write e.g. exact_answer,0.2*format")
        terms.append(Term(name.strip(), w, _function(name.strip(), format_pattern)))
    if format_pattern and not any(t.name == "format" for t in terms):
        raise UserError(f"rl.format_pattern is set, and rl.reward={spec} has no format term to use it; add "
                        f"format to rl.reward (e.g. {spec},0.2*format) or drop rl.format_pattern")
    return terms


def _function(name: str, format_pattern: str) -> Callable:
    if name == "exact_answer":
        return exact_answer
    if name == "format":
        if not format_pattern:
            raise UserError("rl.reward names format, which matches rl.format_pattern: set rl.format_pattern to a "
                            "regular expression the whole completion must match")
        try:
            return format_reward(format_pattern)
        except re.error as e:
            raise UserError(f"rl.format_pattern {format_pattern!r} is not a regular expression ({e}); fix it") from None
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise UserError(f"rl.reward term {name!r} is neither exact_answer nor format nor module:function; name a "
                        f"built-in or your function as my_module:score")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise UserError(f"rl.reward {name}: cannot import {module} ({e}); put it on PYTHONPATH or in the "
                        f"working directory") from None
    except AttributeError:
        raise UserError(f"rl.reward {name}: {module} has no {attr}; name a function it defines") from None
    except Exception as e:  # the module itself fails to run: a SyntaxError, a NameError at import
        raise UserError(f"rl.reward {name}: importing {module} raised {type(e).__name__}: {e}; fix the module") \
            from None
    if not callable(fn):
        raise UserError(f"rl.reward {name} is not a function; name one taking (prompts, completions, rows)")
    return fn


def score(terms: Sequence[Term], prompts: list[str], completions: list[str], rows: list[dict],
          labels: list[str]) -> dict:
    """{'reward': [N] the weighted sum, and each term's own [N] as 'reward_<name>'} of N completions;
    `labels[i]` says where row i is, for errors."""
    out = {}
    for term in terms:
        out[f"reward_{term.name}"] = _call(term, prompts, completions, rows, labels)
    out["reward"] = sum((t.weight * out[f"reward_{t.name}"] for t in terms), np.zeros(len(completions)))
    return out


def _call(term: Term, prompts, completions, rows, labels) -> np.ndarray:
    try:
        values = term.fn(prompts, completions, rows)
    except UserError:
        raise
    except Exception as e:
        for i in range(len(completions)):  # which row: rerun one at a time
            try:
                term.fn(prompts[i:i + 1], completions[i:i + 1], rows[i:i + 1])
            except Exception as one:
                raise UserError(f"rl.reward {term.name} on {labels[i]} raised {type(one).__name__}: {one}; fix the "
                                f"function or the row") from None
        raise UserError(f"rl.reward {term.name} raised {type(e).__name__}: {e} on a batch of {len(completions)} "
                        f"(on no row alone); fix the function") from None
    try:
        values = np.asarray(values, np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise UserError(f"rl.reward {term.name} returned {type(values).__name__}, not numbers; return one float per "
                        f"completion") from None
    if len(values) != len(completions):
        raise UserError(f"rl.reward {term.name} returned {len(values)} values for {len(completions)} completions; "
                        f"return one per completion")
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise UserError(f"rl.reward {term.name} on {labels[bad[0]]} returned {values[bad[0]]}; return a finite number")
    return values
