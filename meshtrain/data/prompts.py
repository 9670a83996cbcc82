"""Prompt data for reinforcement learning (train.objective=grpo, issue 60): jsonl rows of
{"prompt": text} or {"messages": [{"role", "content"}, ...]}, with any other fields (e.g.
"answer") kept for the rewards (meshtrain/objectives/rewards.py).

`python -m meshtrain.data prepare prompts.jsonl --prompts --tokenizer T [--chat-template C] --out DIR`
renders each prompt (with a chat template: as the conversation's messages, a prompt string being one
user message, followed by the generation prompt; without: the text as it is) and tokenizes it, with
no document end: the completion follows it. A completion ends at the tokenizer's EOS, or at the chat
template's end-of-turn token where the tokenizer has it as one special token (manifest.json's
`end_of_turn`, `chat.end_of_turn`). DIR holds `prompts.npy` (every prompt's ids, one after
another), `offsets.npy` (int64 [N + 1]: prompt i is ids[offsets[i]:offsets[i + 1]]), `rows.jsonl`
(each row's other fields and where it was read), the tokenizer, and manifest.json last, with the
files' sha256.

A step draws train.batch_size / rl.group_size prompts by (seed, split, step), as every other
batch is drawn (meshtrain/data/batches.py), so resuming or changing the mesh never changes them;
the file's last data.val_fraction of the prompts is held out for eval_reward, scored in order.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_whole
from meshtrain.data import chat as chat_lib
from meshtrain.data import tokenizer as tokenizer_lib
from meshtrain.data.prepare import DroppedText, Tokenized
from meshtrain.data.sources import read, units
from meshtrain.data.tokens import MANIFEST, token_dtype

KIND = "prompts"
FILES = ("prompts.npy", "offsets.npy", "rows.jsonl")


def _prompt_of(row, _field, where: str):
    """(the row's prompt: text or messages, the row without it, where it was read)."""
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{where}: a prompt row needs one of the fields prompt (text) or messages (a conversation) "
                        f"(has: {keys}); fix the row")
    name = "prompt" if "prompt" in row else "messages"
    value = row[name]
    if not isinstance(value, str):
        value = chat_lib.messages_of(value, name, where)
    return value, {k: v for k, v in row.items() if k != name}, where


def render(prompt, fmt: chat_lib.ChatFormat | None, where: str) -> str:
    """The prompt's text: with a chat template its messages and the generation prompt; without one the
    text itself (messages need a template)."""
    if fmt is None:
        if not isinstance(prompt, str):
            raise UserError(f"{where}: the row holds messages: pass --chat-template (auto, chatml or a .jinja file) "
                            f"to render them")
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return fmt.render(messages, add_generation_prompt=True)


def prepare_prompts(src: str, tok, out: str, fmt: chat_lib.ChatFormat | None = None,
                    allow_dropped_text: bool = False) -> dict:
    """Write the prompt folder `out` (the module's layout) from the jsonl `src`; returns its manifest.
    Text the tokenizer maps to no token is an error (as prepare's, meshtrain/data/prepare.py
    `DroppedText`), a warning with `allow_dropped_text`."""
    parts = units("jsonl", src)
    rows = [r for unit in parts for r in read(unit, None, _prompt_of)]
    if not rows:
        raise UserError(f"{src} holds no prompt rows; add {{\"prompt\": ...}} lines")
    texts = [render(prompt, fmt, where) for prompt, _, where in rows]
    if tok.may_drop:
        dropped = DroppedText(tok, src, allow_dropped_text, f"pass --allow-dropped-text to prepare {src} anyway")
        counts = collections.Counter()
        for text in texts:
            counts.update(text)
        dropped.add(Tokenized(np.zeros(0), np.zeros(0), sum(n for c, n in counts.items() if not c.isspace()),
                              tok.dropped(counts)))
        dropped.warn()
    encoded = [np.asarray(ids) for ids in tok.encode_batch(texts)]
    empty = next((where for (_, _, where), ids in zip(rows, encoded) if len(ids) == 0), None)
    if empty:
        raise UserError(f"{empty}: the prompt is empty once tokenized; give it some text")
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids in encoded])]).astype(np.int64)
    ids = np.concatenate(encoded).astype(token_dtype(tok.vocab_size))
    with writing_whole(out, "--out") as tmp:
        np.save(tmp / FILES[0], ids)
        np.save(tmp / FILES[1], offsets)
        with open(tmp / FILES[2], "w") as f:
            for (_, fields, where), text in zip(rows, texts):
                f.write(json.dumps({"where": where, "text": text, "fields": fields}, ensure_ascii=False) + "\n")
        tokenizer_lib.record(tmp, tok)
        manifest = {"kind": KIND, "prompts": len(rows), "tokens": int(len(ids)), "tokenizer": tok.name,
                    "chat_template": None if fmt is None else fmt.name,
                    "end_of_turn": None if fmt is None else chat_lib.end_of_turn(fmt, tok),
                    "sha256": {name: hashlib.sha256((tmp / name).read_bytes()).hexdigest() for name in FILES}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def is_prompts(folder: str | Path) -> bool:
    manifest = Path(folder) / MANIFEST
    return manifest.is_file() and json.loads(manifest.read_text()).get("kind") == KIND


class Identity:
    """A prompt folder as the run's record fingerprints data (meshtrain/run/run_dir.py
    `data_fingerprint`: its length, dtype and sha256): its prompt tokens' count and dtype, and the
    sha256 of its files' manifest hashes, so another prompt set is another run's data."""

    def __init__(self, folder: str | Path):
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        self.dtype = np.load(Path(folder) / FILES[0], mmap_mode="r").dtype
        self.tokens = manifest["tokens"]
        self.digest = hashlib.sha256(json.dumps(manifest["sha256"], sort_keys=True).encode()).hexdigest()

    def __len__(self) -> int:
        return self.tokens

    def sha256(self) -> str:
        return self.digest


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A prompt folder read and checked: `ids[i]` prompt i's tokens, `texts[i]` its rendered text,
    `rows[i]` its other fields, `where[i]` where it was read; `end_of_turn`: the chat template's
    end-of-turn token, where prepare found one (`chat.end_of_turn`), at which a completion ends."""
    ids: list
    texts: list
    rows: list
    where: list
    end_of_turn: int | None = None

    def __len__(self):
        return len(self.ids)

    def subset(self, indices) -> Prompts:
        pick = lambda xs: [xs[i] for i in indices]
        return Prompts(pick(self.ids), pick(self.texts), pick(self.rows), pick(self.where), self.end_of_turn)


def read_prompts(folder: str | Path) -> Prompts:
    """The prompts of a folder prepared with --prompts, each file checked against its manifest."""
    folder = Path(folder)
    if not is_prompts(folder):
        raise UserError(f"train.objective=grpo reads prompts; {folder} holds none: prepare {{\"prompt\", \"answer\"}} "
                        f"rows with python -m meshtrain.data prepare --prompts")
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in FILES:
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != manifest["sha256"][name]:
            raise UserError(f"{path} is not the file prepare wrote (its manifest's sha256); prepare the prompts again")
    ids, offsets = np.load(folder / FILES[0]), np.load(folder / FILES[1])
    lines = [json.loads(line) for line in (folder / FILES[2]).read_text().splitlines()]
    return Prompts([ids[a:b].astype(np.int32) for a, b in zip(offsets[:-1], offsets[1:])],
                   [x["text"] for x in lines], [x["fields"] for x in lines], [x["where"] for x in lines],
                   manifest.get("end_of_turn"))


def split_prompts(prompts: Prompts, val_fraction: float) -> tuple[Prompts, Prompts | None]:
    """(training prompts, held-out ones or None): the file's last data.val_fraction, at least one each."""
    if val_fraction <= 0:
        return prompts, None
    held = max(1, round(len(prompts) * val_fraction))
    if held >= len(prompts):
        raise UserError(f"the data holds {len(prompts):,} prompts, leaving none for training with "
                        f"data.val_fraction={val_fraction}; use more prompts or a smaller data.val_fraction")
    n = len(prompts)
    return prompts.subset(range(n - held)), prompts.subset(range(n - held, n))


class PromptBatches:
    """`batches(k)` -> step k's `count` prompts (`Prompts`), drawn from the training `prompts` by
    (seed, split 0, k) with replacement, as preference pairs are drawn."""

    def __init__(self, prompts: Prompts, count: int, seed: int):
        self.prompts, self.count, self.seed = prompts, count, seed

    def shares(self, step: int) -> dict:
        return {}

    def __call__(self, step: int) -> Prompts:
        rng = np.random.default_rng([self.seed, 0, step])
        return self.prompts.subset(rng.integers(0, len(self.prompts), size=self.count))


def batches(folder, val_fraction: float, count: int, seed: int, longest: int, vocab_size: int):
    """(the training prompt batches, `count` prompts a batch, {"": the held-out `Prompts`} or {}); a prompt
    longer than `longest` tokens (train.seq_len + 1 - rl.max_new_tokens) or an id the model cannot
    embed is one error naming its row."""
    prompts = read_prompts(folder)
    for ids, where in zip(prompts.ids, prompts.where):
        if len(ids) > longest:
            raise UserError(f"{where}: the prompt is {len(ids)} tokens, longer than train.seq_len + 1 - "
                            f"rl.max_new_tokens = {longest}; raise train.seq_len or shorten the prompt")
        if ids.max() >= vocab_size:
            raise UserError(f"{where}: token id {ids.max()} >= model.vocab_size={vocab_size}; set model.vocab_size "
                            f"to the tokenizer's vocabulary")
    train, held = split_prompts(prompts, val_fraction)
    return PromptBatches(train, count, seed), {} if held is None else {"": held}
