"""The range a number may take, for config keys (meshtrain/config/spec.py) and command flags
(meshtrain/core/cli.py `number`) alike: every number finite, every integer at most INT_LIMIT, and within
its own bounds; `setting`, a config field with its default, meaning and range (the config sections
and the model families' architecture fields declare theirs with it). No JAX here: light commands
import it."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from meshtrain.core.errors import UserError

INT_LIMIT = 2**31 - 1  # an int32 on the device, an array dimension XLA indexes


@dataclass(frozen=True)
class Bounds:
    """`min`/`max` inclusive, `above`/`below` exclusive; None = unbounded on that side."""
    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None

    def __str__(self) -> str:
        show = lambda x: f"{x:g}" if isinstance(x, float) else str(x)
        low = (f"[{show(self.min)}" if self.min is not None else
               f"({show(self.above)}" if self.above is not None else "")
        high = (f"{show(self.max)}]" if self.max is not None else
                f"{show(self.below)})" if self.below is not None else "")
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
        return f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}" if high else "a finite number"

    def problem(self, value) -> str | None:
        """What is wrong with `value` ('must be a finite number >= 0', ...), or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number {self}" if self != Bounds() else "must be a finite number"
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            return f"is too large: integers here are at most 2^31 - 1 ({INT_LIMIT})"
        inside = ((self.min is None or value >= self.min) and (self.max is None or value <= self.max)
                  and (self.above is None or value > self.above) and (self.below is None or value < self.below))
        return None if inside else f"must be {self}"

    def check(self, name: str, value) -> None:
        """A UserError naming `name`, the value and the range when `value` is outside it."""
        problem = self.problem(value)
        if problem:
            raise UserError(f"{name}={value} {problem}")


class Applies(NamedTuple):
    """Where a setting has an effect: while the setting `key` (dotted, from the config's root) is one
    of `values`, or, with `values` empty, anything but its own default (a key that switches a feature
    on). A setting set to other than its default where it has none is refused (config/validate.py)."""
    key: str
    values: tuple = ()


def setting(default, help: str, *, choices=(), min=None, max=None, above=None, below=None,
            architecture: bool = True, applies: Applies | None = None):
    """A config field. `min`/`max` (inclusive), `above`/`below` (exclusive): its range (`Bounds`).
    `architecture=False`: a model setting that does not define the weights (a loss weight, a routing
    capacity), so it may differ on resume. `applies`: where it has an effect (`Applies`)."""
    meta = {"help": help, "choices": tuple(choices), "bounds": Bounds(min, max, above, below),
            "architecture": architecture, "applies": applies}
    if dataclasses.is_dataclass(default) or isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)
