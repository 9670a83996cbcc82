"""Rows that train nothing, or the wrong thing, found as `prepare` tokenizes them (issue 57, class 1).

Chat data: a row whose roles the chat format does not know (`Assistant`, `bot`: the template renders
them, and no turn of theirs is trained), a row with no assistant turn, and a row whose assistant turns
the template renders as no token. Preference pairs: chosen and rejected identical (a zero DPO
gradient) and a response that is blank or has no token (a response that holds another turn, the whole conversation
given as `chosen` HH-RLHF style, is an error in preference.py: it cannot be located). Each is
counted with the first row it was found in; prepare refuses the data at the first part holding one,
or, with --allow-degenerate-rows, keeps the rows and warns with the counts. Data whose loss mask
trains no token at all is refused either way.
"""
from __future__ import annotations

from meshtrain.core.console import log
from meshtrain.core.errors import UserError

# The roles chat templates are written for (transformers' and the model families' templates; OpenAI's
# `developer`, Llama 3's `ipython`, the older `function`).
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
ALLOW_FLAG = "--allow-degenerate-rows"

Faults = dict[str, list]  # reason -> [rows, where the first one is]


def _count(faults: Faults, reason: str, where: str) -> None:
    faults.setdefault(reason, [0, where])[0] += 1


def chat_faults(conversations: list[tuple[list[dict], str]], masks) -> Faults:
    """The faults of chat rows, (messages, where) each, given each row's loss mask."""
    faults: Faults = {}
    for (messages, where), mask in zip(conversations, masks):
        roles = {m["role"] for m in messages}
        for role in sorted(roles - set(KNOWN_ROLES)):
            _count(faults, f"role {role!r} is not one of {', '.join(KNOWN_ROLES)}", where)
        if "assistant" not in roles:
            _count(faults, "no assistant turn", where)
        elif not mask.any():
            _count(faults, "the chat template renders its assistant turns as no token", where)
    return faults


def pair_faults(examples: list[tuple], masks) -> Faults:
    """The faults of preference rows, (prompt, chosen, rejected, where) each, given the response masks
    of prompt + chosen and prompt + rejected (two a row)."""
    faults: Faults = {}
    for i, (_, chosen, rejected, where) in enumerate(examples):
        if chosen == rejected:
            _count(faults, "chosen and rejected are identical", where)
        blank = any(isinstance(r, str) and not r.strip() for r in (chosen, rejected))
        if blank or not (masks[2 * i].any() and masks[2 * i + 1].any()):
            _count(faults, "a response (chosen or rejected) is blank or has no token", where)
    return faults


class Degenerate:
    """The faults of every part tokenized so far: an error at the first part holding one, or, where the
    user allows it, a warning with the counts at the end."""

    def __init__(self, src: str, allowed: bool):
        self.src, self.allowed, self.faults = src, allowed, {}

    def add(self, faults: Faults) -> None:
        for reason, (n, where) in faults.items():
            self.faults.setdefault(reason, [0, where])[0] += n
        if self.faults and not self.allowed:
            raise UserError(f"{self.summary()} (of what was read so far); fix the rows, or pass {ALLOW_FLAG} to "
                            f"keep them")

    def summary(self) -> str:
        said = "; ".join(f"{reason}: {n:,} row{'s' * (n > 1)}, the first at {where}"
                         for reason, (n, where) in sorted(self.faults.items(), key=lambda f: -f[1][0]))
        return f"{self.src} holds rows that train nothing or the wrong thing: {said}"

    def warn(self) -> None:
        if self.faults:
            log.warning(f"{self.summary()}; they are kept ({ALLOW_FLAG})")


def check_trained(src: str, trained: int, what: str) -> None:
    """Data whose loss mask trains no token is refused, allowed or not."""
    if trained == 0:
        raise UserError(f"{src}: no token of its {what} is trained (the loss mask is empty); fix the rows' roles "
                        f"and turns, or the chat template")
