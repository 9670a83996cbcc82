"""Tokenizers: text <-> integer ids, and the record of which one a run (or a prepared corpus) used.

- `ByteTokenizer` (`byte`, the default): the text's UTF-8 bytes, vocabulary 256, no EOS id: all 256
  ids are text. Documents are separated by a newline byte (id 10), exactly as meshtrain has always
  joined text files, so a byte-level model cannot tell a document's end from a line's end.
- `HFTokenizer`: a Hugging Face `tokenizers` file (tokenizer.json, e.g. shipped with a checkpoint or
  written by `train_bpe`). Its EOS id ends every document.
- `load(spec)`: `byte`, a tokenizer.json, or a folder holding one.
- `record(folder, tok)` / `for_run(folder)`: a run or prepared folder keeps its tokenizer
  (tokenizer.json + tokenizer_config.json, or tokenizer.txt reading `byte`), so its tokens can be
  decoded later.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from meshtrain.core import unicode
from meshtrain.core.errors import UserError

HF_FILE, HF_CONFIG, BYTE_NOTE = "tokenizer.json", "tokenizer_config.json", "tokenizer.txt"
# Special tokens that end a document, most specific first (GPT-2/NeoX, Llama 3, Llama 2/Mistral, Gemma).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")
NEWLINE = 10


class Tokenizer(Protocol):
    name: str  # what is recorded: "byte" or the tokenizer.json path
    vocab_size: int
    eos_id: int | None
    path: Path | None  # the tokenizer.json (None: bytes)
    rust: object | None  # the `tokenizers` library's Tokenizer, for offsets (None: bytes, one id per byte)
    may_drop: bool  # whether encoding may drop characters (no unknown token): prepare counts them
    special_tokens: dict[str, int]  # the special tokens' text -> id (none for bytes)

    def encode(self, text: str) -> np.ndarray: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def decode(self, ids) -> str: ...


def document_end(tok: Tokenizer) -> np.ndarray:
    """The ids appended after every document: [eos_id], or a newline where there is no EOS."""
    return np.array([tok.eos_id], np.int64) if tok.eos_id is not None else tok.encode("\n")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (uint8 arrays); decoding replaces invalid UTF-8."""
    name, vocab_size, eos_id = "byte", 256, None
    path, rust, may_drop, special_tokens = None, None, False, {}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise UserError(f"token id {int(ids.max())} is not a byte; these tokens came from another "
                            f"tokenizer: pass its tokenizer.json")
        return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer.json. `encode` adds what the file's own template adds, as Hugging Face
    does by default (Llama: a BOS first; GPT-2 style files: nothing); prepare appends EOS. Text that
    holds undecodable bytes (surrogate escapes) has them replaced by U+FFFD: the library takes
    valid Unicode only.
    EOS: `eos` if given (a token or an id), else tokenizer_config.json's eos_token beside the file,
    else the first of `EOS_NAMES` among the file's special tokens; None if none is found."""

    def __init__(self, path: str | Path, eos: str | int | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        self.path = _hf_file(Path(path))
        try:
            self.rust = RustTokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust parser's errors carry no type of their own
            raise UserError(f"{self.path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
                            f"pass a tokenizer.json written by the tokenizers library") from None
        self.name = str(self.path)
        self.vocab_size = self.rust.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {t["content"]: t["id"] for t in json.loads(self.path.read_text()).get("added_tokens", [])
                               if t.get("special")}
        self.eos_id = self._eos_id(eos)
        model = json.loads(self.rust.to_str()).get("model", {})
        # Without an unknown token or byte fallback, a character outside the vocabulary becomes no token
        self.may_drop = model.get("unk_token") is None and model.get("unk_id") is None and not model.get(
            "byte_fallback")
        self._dropped: dict[str, bool] = {}

    def dropped(self, counts: dict[str, int]) -> dict[str, int]:
        """Of a text's characters (`counts`: character -> occurrences), those that encode to no token
        (whitespace aside: a pre-tokenizer may split on it by design)."""
        if not self.may_drop:
            return {}
        for c in counts.keys() - self._dropped.keys():
            self._dropped[c] = not c.isspace() and not self.rust.encode(c, add_special_tokens=False).ids
        return {c: n for c, n in counts.items() if self._dropped[c]}

    def _eos_id(self, eos) -> int | None:
        if isinstance(eos, int):
            return eos
        if eos is None:
            config = self.path.parent / HF_CONFIG
            if config.is_file():
                eos = json.loads(config.read_text()).get("eos_token")
                eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is not None:
            if self.rust.token_to_id(eos) is None:
                raise UserError(f"EOS token {eos!r} is not in {self.path}; name one of its special tokens")
            return self.rust.token_to_id(eos)
        return next((self.special_tokens[n] for n in EOS_NAMES if n in self.special_tokens), None)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        valid = [t.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.rust.encode_batch(valid, add_special_tokens=True)]

    def decode(self, ids) -> str:
        return self.rust.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def __getstate__(self):  # pickled into prepare's worker processes
        return {"path": self.path, "eos": self.eos_id}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eos"])


def _hf_file(path: Path) -> Path:
    file = path / HF_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no {HF_FILE}" if path.is_dir() else f"{path} does not exist"
        raise UserError(f"tokenizer {where}; pass 'byte', a {HF_FILE}, or a folder holding one")
    return file


def load(spec: str) -> Tokenizer:
    """`byte`, or a path to a tokenizer.json or a folder holding one (a checkpoint, a run)."""
    if spec == "byte":
        return ByteTokenizer()
    if not spec:
        raise UserError("tokenizer '' is empty; pass 'byte', a tokenizer.json, or a folder holding one")
    return HFTokenizer(spec)


def check_vocab(tok: Tokenizer, vocab_size: int, source: str) -> None:
    """The model's embedding must hold every id the tokenizer (named by `source`) can produce."""
    if vocab_size < tok.vocab_size:
        raise UserError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of {source} "
                        f"({tok.vocab_size} ids, tokenizer {tok.name}); "
                        f"set model.vocab_size >= {tok.vocab_size}")


def record(folder: Path, tok: Tokenizer | None) -> None:
    """Keep `tok` in `folder`: tokenizer.json and tokenizer_config.json (naming its EOS), or
    tokenizer.txt reading `byte`; None (unknown: token files that name no tokenizer) keeps nothing."""
    folder = Path(folder)
    if tok is None:
        return
    if isinstance(tok, ByteTokenizer):
        (folder / BYTE_NOTE).write_text("byte\n")
        return
    if tok.path.resolve() != (folder / HF_FILE).resolve():
        shutil.copyfile(tok.path, folder / HF_FILE)
    source_config = tok.path.parent / HF_CONFIG
    config = json.loads(source_config.read_text()) if source_config.is_file() else {}
    config["eos_token"] = None if tok.eos_id is None else tok.rust.id_to_token(tok.eos_id)
    (folder / HF_CONFIG).write_text(json.dumps(config, indent=1))


def recorded(folder: Path) -> Tokenizer | None:
    """The tokenizer `record` kept in `folder`, or None if it holds none."""
    folder = Path(folder)
    if (folder / HF_FILE).is_file():
        return HFTokenizer(folder)
    if (folder / BYTE_NOTE).is_file():
        return load((folder / BYTE_NOTE).read_text().strip())
    return None


def for_run(run_dir: Path) -> Tokenizer:
    """The tokenizer a run (or a prepared folder) recorded, to decode its tokens."""
    tok = recorded(run_dir)
    if tok is None:
        raise UserError(f"{run_dir} records no tokenizer (no {HF_FILE} or {BYTE_NOTE}: a run from before "
                        f"tokenizers were recorded, or one trained on token files that name none); "
                        f"name it: --tokenizer byte, or --tokenizer path/to/{HF_FILE}")
    return tok


def train_bpe(files_or_texts: Iterable[str | Path], vocab_size: int, out_path: str | Path,
              eos: str = "<|endoftext|>") -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style: any text encodes, no unknown token) with `eos` as its
    one special token; write it to `out_path` and return it. Items are texts (str) or files (Path)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(f"--vocab-size {vocab_size} is below the {len(alphabet)} byte symbols + EOS; "
                        f"use at least {len(alphabet) + 1}")
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=alphabet,
                                  show_progress=False)
    rust.train_from_iterator(_texts(files_or_texts), trainer=trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rust.save(str(out_path))
    return HFTokenizer(out_path, eos=eos)


def _texts(items: Iterable[str | Path], chunk_chars: int = 1 << 20) -> Iterable[str]:
    """Texts as given; files in chunks of whole lines, so a large file is never held at once, each
    valid UTF-8 or one error naming the file and line (meshtrain/core/unicode.py)."""
    for item in items:
        if not isinstance(item, Path):
            yield item
            continue
        with open(item, "rb") as f:
            line = 1
            while chunk := f.read(chunk_chars) + f.readline():
                yield unicode.decode(chunk, str(item), "save it as valid UTF-8 text", line)
                line += chunk.count(b"\n")
