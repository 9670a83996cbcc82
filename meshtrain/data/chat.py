"""Chat data: conversations rendered with a chat template, tokenized with a per-token loss mask.

A row holds `messages`, a list of {"role", "content"} (jsonl, Parquet, a datasets folder). It is
rendered with the tokenizer's own `chat_template` (tokenizer_config.json or chat_template.jinja
beside tokenizer.json) in the Jinja2 environment transformers renders it in
(transformers/utils/chat_template_utils.py: sandboxed, trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, its `tojson`, the special tokens as `bos_token`, `eos_token`, ...),
or with a built-in template (`chatml`) for tokenizers without one.

Assistant spans: turn k's answer is the text between the rendering of messages[:k] with the
generation prompt and the rendering of messages[:k+1] (its end-of-turn marker included, so the
model learns to stop); both must be prefixes of the whole conversation's rendering, else the
template is not incremental and is refused. The whole rendering is tokenized at once (no special
tokens added: the template writes them, as `apply_chat_template` does), and a token is trained when
its first character lies in an assistant span.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from meshtrain.core.errors import UserError

MESSAGES = "messages"
BUILTIN = {  # templates for tokenizers that ship none
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
}
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled as transformers compiles it (jinja2 >= 3.1.6, sandboxed)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # `{% generation %}` blocks render their body (spans are found by prefixes)
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template)


class ChatFormat:
    """A chat template and the special tokens it is rendered with; picklable (prepare's workers)."""

    def __init__(self, template: str, name: str, specials: dict[str, str] | None = None):
        self.template, self.name, self.specials = template, name, dict(specials or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return _compiled(self.template).render(messages=messages, tools=None, documents=None,
                                                   add_generation_prompt=add_generation_prompt, **self.specials)
        except jinja2.TemplateError as e:
            raise UserError(f"chat template {self.name} fails on a conversation ({e}); fix the data or pass "
                            f"another --chat-template") from None

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the [start, end) characters of each assistant turn)."""
        text, spans = self.render(messages), []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.render(messages[:k], True), self.render(messages[:k + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise UserError(f"chat template {self.name} does not render a conversation turn by turn (the "
                                f"text up to assistant turn {k} is not a prefix of the whole), so its answers "
                                f"cannot be located; pass --chat-template chatml or a template that does")
            spans.append((len(before), len(through)))
        return text, spans


def end_of_turn(fmt: ChatFormat, tok) -> int | None:
    """The special token the template closes an assistant turn with (chatml's <|im_end|>, Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>): the longest of the tokenizer's special tokens that the text the
    template writes right after an answer starts with. None where it writes none (the marker is text
    of several tokens: a byte tokenizer's) or where that token is the EOS."""
    answer = "meshtrain's answer"
    text = fmt.render([{"role": "user", "content": "a question"}, {"role": "assistant", "content": answer}])
    after = text[text.rfind(answer) + len(answer):] if answer in text else ""
    ends = sorted((t for t in tok.special_tokens if after.startswith(t)), key=len)
    token = tok.special_tokens[ends[-1]] if ends else None
    return None if token == tok.eos_id else token


def load_format(spec: str, tok) -> ChatFormat:
    """--chat-template: `auto` (the tokenizer's own), a built-in name, or a .jinja file."""
    folder = tok.path
    specials = _specials(folder.parent) if folder is not None else {}
    if spec in BUILTIN:
        return ChatFormat(BUILTIN[spec], spec, specials)
    if spec != "auto":
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"--chat-template {spec!r} is neither a built-in ({', '.join(BUILTIN)}), auto, nor a "
                            f"file; pass one of those")
        return ChatFormat(path.read_text(), str(path), specials)
    own = _own_template(folder.parent) if folder is not None else None
    if own is None:
        raise UserError(f"tokenizer {tok.name} ships no chat template (chat_template in tokenizer_config.json or "
                        f"chat_template.jinja); pass --chat-template {' or '.join(BUILTIN)}, or a .jinja file")
    return ChatFormat(own, f"of {tok.name}", specials)


def _config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _own_template(folder: Path) -> str | None:
    """transformers' order: chat_template.jinja, else tokenizer_config.json's chat_template (a string,
    or a list of named ones: `default`)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    own = _config(folder).get("chat_template")
    if isinstance(own, list):
        own = next((t["template"] for t in own if t.get("name") == "default"), None)
    return own


def _specials(folder: Path) -> dict[str, str]:
    """The special tokens' text as `special_tokens_map` gives them to the template."""
    config, out = _config(folder), {}
    for name in SPECIAL_NAMES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None:
            out[name] = value
    return out


def messages_of(value, field: str, where: str) -> list[dict]:
    """A row's conversation, checked: a list of {"role": str, "content": str}."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise UserError(f"{where}: {field!r} is not a conversation (a non-empty list of {{\"role\": ..., "
                        f"\"content\": ...}} with text values); fix the row, or set --text-field to the messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def encode(fmt: ChatFormat, tok, conversations: list[list[dict]]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Each conversation's (rendered text, token ids, uint8 mask: 1 on the assistant turns' tokens)."""
    out = []
    for messages in conversations:
        text, spans = fmt.spans(messages)
        ids, starts = ids_and_starts(tok, text)
        inside = np.zeros(len(text) + 1, np.int8)
        for lo, hi in spans:
            inside[lo:hi] = 1
        out.append((text, ids, inside[starts].astype(np.uint8)))
    return out


def ids_and_starts(tok, text: str) -> tuple[np.ndarray, np.ndarray]:
    """The text's ids (no special tokens added) and each token's first character."""
    if tok.rust is None:  # bytes: every byte of a character starts at it
        ids = tok.encode(text)
        widths = [len(c.encode("utf-8", "surrogateescape")) for c in text]
        return ids, np.repeat(np.arange(len(text)), widths)
    valid = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    enc = tok.rust.encode(valid, add_special_tokens=False)
    return np.asarray(enc.ids, np.int64), np.array([s for s, _ in enc.offsets], np.int64).reshape(-1)
