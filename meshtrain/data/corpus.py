"""What training reads: the configured data as one token stream, and the tokenizer that made it.

Token files and prepared folders are memory-mapped, never read into memory; a prepared folder in
an object store (data.path: s3://...) is copied into the local cache first (meshtrain/data/store.py).
Raw sources (text, jsonl, Parquet, datasets folders, the standard library) are tokenized on load, by
every process, exactly as `prepare` would; that is for small data only (RAW_LIMIT_BYTES): `prepare`
is the path for anything larger.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.data import prompts, store
from meshtrain.data import tokenizer as tokenizer_lib
from meshtrain.data.prepare import DroppedText, check_documents, tokenize
from meshtrain.data.sources import RAW_KINDS, detect, source_bytes, units
from meshtrain.data.tokens import Tokens, prepared_kind, read_prepared, token_stream

RAW_LIMIT_BYTES = 256 << 20


class Corpus(NamedTuple):
    tokens: Tokens | None  # None: synthetic data; a prompt folder's `prompts.Identity`
    tokenizer: object | None  # None: synthetic data, or token files that name no tokenizer
    kind: str = "plain"  # what it holds: a key of tokens.DATA_KINDS


def load_corpus(dcfg, vocab_size: int) -> Corpus:
    """`dcfg`: the DataConfig. data.tokenizer=auto means the data's own (a prepared folder's, a token
    file's sidecar's), bytes for raw text."""
    if store.is_uri(dcfg.path):
        if dcfg.kind not in ("auto", "prepared"):
            raise UserError(f"data.kind={dcfg.kind} with data.path {store.shown(dcfg.path)}: an object store holds "
                            f"prepared data only (python -m meshtrain.data prepare --out URI); set data.kind=auto")
        dcfg = dataclasses.replace(dcfg, path=str(store.cached(dcfg.path, dcfg.cache_dir)), kind="prepared")
    kind = detect(dcfg.path, dcfg.kind)
    explicit = None if dcfg.tokenizer == "auto" else tokenizer_lib.load(dcfg.tokenizer)
    if kind == "synthetic":
        return Corpus(None, None, "synthetic")
    if kind in RAW_KINDS:
        tok = explicit or tokenizer_lib.ByteTokenizer()
        tokenizer_lib.check_vocab(tok, vocab_size, "data.tokenizer")
        return Corpus(_tokenized(kind, dcfg, tok), tok)
    path = Path(dcfg.path)
    holds = "plain"
    if kind == "prepared" and prompts.is_prompts(path):  # reinforcement learning's: read by its objective
        own = tokenizer_lib.recorded(path)
        tokenizer_lib.check_vocab(own, vocab_size, f"{path}'s tokenizer")
        return Corpus(prompts.Identity(path), own, "prompts")
    if kind == "prepared":
        tokens, manifest = read_prepared(path)
        holds = prepared_kind(manifest)
        if dcfg.train_on == "all" and tokens.masks is not None:  # chat data trained on every token
            tokens = tokens.unmasked()
        elif manifest.get("trained_tokens") == 0:  # written before prepare refused it (degenerate.py)
            raise UserError(f"{path}: its loss mask trains no token (no assistant turn or response is marked); "
                            f"prepare it again (prepare names the rows at fault), or set data.train_on=all")
        own = tokenizer_lib.recorded(path)
    else:  # a token file
        tokens, meta = token_stream(path)
        beside = None if meta is None else tokenizer_lib.recorded(path.parent)  # a prepared folder's
        same = beside is not None and beside.vocab_size == meta["vocab_size"]
        own = None if meta is None else beside if same else _named(meta["tokenizer"], path)
    if explicit and own and explicit.vocab_size != own.vocab_size:
        raise UserError(f"data.tokenizer={dcfg.tokenizer} ({explicit.vocab_size} ids) is not the tokenizer "
                        f"{path} was written with ({own.name}, {own.vocab_size} ids); "
                        f"set data.tokenizer=auto")
    tok = explicit or own
    if tok is not None:
        tokenizer_lib.check_vocab(tok, vocab_size, "data.tokenizer" if explicit else f"{path}'s tokenizer")
    return Corpus(tokens, tok, holds)


def _tokenized(kind: str, dcfg, tok) -> Tokens:
    parts = units(kind, dcfg.path)
    size = source_bytes(parts)
    if kind != "stdlib" and size > RAW_LIMIT_BYTES:
        raise UserError(f"{dcfg.path} holds {size / 1e6:,.0f} MB of {kind}, more than training tokenizes "
                        f"on load ({RAW_LIMIT_BYTES / 1e6:,.0f} MB); run python -m meshtrain.data prepare "
                        f"{dcfg.path} --tokenizer {tok.name} --out DIR once, then train on --data DIR")
    dropped = DroppedText(tok, dcfg.path, False, f"prepare it with python -m meshtrain.data prepare {dcfg.path} "
                                                f"--tokenizer {tok.name} --allow-dropped-text --out DIR")
    ids, documents = [], 0
    for unit in parts:
        part = tokenize(unit, tok, dcfg.text_field)
        dropped.add(part)
        ids.append(part.ids)
        documents += len(part.ends)
    check_documents(dcfg.path or "the data", sum(len(i) for i in ids), documents, tok)
    return Tokens([np.concatenate(ids)])


def _named(name: str, path: Path):
    """The tokenizer a token file's sidecar names."""
    try:
        return tokenizer_lib.load(name)
    except UserError:
        raise UserError(f"token file {path} was written with tokenizer {name}, which is gone; set "
                        f"data.tokenizer to it (byte, or a tokenizer.json)") from None
