"""`python -m meshtrain.data prepare | train-tokenizer`: tokenize a corpus once; train a BPE tokenizer.

    python -m meshtrain.data prepare SRC --tokenizer byte|PATH --out DIR|URI [--stage DIR]
                                     [--workers N | --ray ADDRESS]
                                     [--text-field text] [--chat | --preference | --prompts]
                                     [--chat-template auto|chatml|FILE]
    python -m meshtrain.data train-tokenizer SRC --vocab-size N --out tokenizer.json
"""
from __future__ import annotations

import itertools
import os
import sys
import time

from meshtrain.core.cli import Parser, arguments, command, number
from meshtrain.core.errors import UserError
from meshtrain.core.folders import writing_file
from meshtrain.data import chat as chat_lib
from meshtrain.data import store
from meshtrain.data import tokenizer as tokenizer_lib
from meshtrain.data.cluster import prepare_on_ray
from meshtrain.data.prepare import SHARD_TOKENS, prepare
from meshtrain.data.prompts import prepare_prompts
from meshtrain.data.sources import RAW_KINDS, detect, read, units


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.data", description=__doc__.splitlines()[0])
    commands = p.add_subparsers(dest="command", required=True)
    source = Parser(add_help=False)
    source.add_argument("src", help="text file or folder, .jsonl file or folder, Parquet file or folder "
                                    "(part-*.parquet), or a datasets save_to_disk folder")
    kinds = ("auto",) + tuple(k for k in RAW_KINDS if k != "stdlib")
    source.add_argument("--kind", default="auto", choices=kinds, help="the source's kind (default: detected)")
    source.add_argument("--text-field", default="text", help="jsonl field / column holding the text")
    prep = commands.add_parser("prepare", parents=[source], help="tokenize SRC into shards + manifest.json")
    prep.add_argument("--tokenizer", default="byte", help="byte, or a tokenizer.json (or its folder)")
    prep.add_argument("--out", required=True, help="new (or empty) folder for the shards, or an object-store URI "
                                                   "(s3://bucket/prefix, gs://, ...: written under --stage, then "
                                                   "uploaded; docs/data.md)")
    prep.add_argument("--stage", help="with a URI --out: the local folder the shards are written in before the "
                                      "upload (default ~/.cache/meshtrain/staging); on a shared filesystem with --ray")
    prep.add_argument("--workers", type=number(int, min=1, max=1024),
                      help="tokenizing processes on this machine (default: one per core)")
    prep.add_argument("--ray", metavar="ADDRESS",
                      help="tokenize on a Ray cluster instead: auto (the running one), local (start one here) or "
                           "its address; the same shards, resumable (docs/data.md)")
    prep.add_argument("--shard-tokens", type=number(int, min=1), default=SHARD_TOKENS, help="tokens per shard file")
    prep.add_argument("--chat", action="store_true",
                      help="rows are conversations ({\"messages\": [{\"role\", \"content\"}, ...]}; set "
                           "--text-field for another column): rendered with a chat template, with a loss mask on "
                           "the assistant turns (docs/fine-tuning.md)")
    prep.add_argument("--preference", action="store_true",
                      help="jsonl rows are preference pairs {\"prompt\", \"chosen\", \"rejected\"} (text, or "
                           "messages rendered with --chat-template) for train.objective=dpo: two sequences an "
                           "example, a loss mask on the responses (docs/fine-tuning.md)")
    prep.add_argument("--prompts", action="store_true",
                      help="jsonl rows of prompts for train.objective=grpo: {\"prompt\": text} or {\"messages\": "
                           "[...]} (rendered with --chat-template and its generation prompt), any other field (e.g. "
                           "\"answer\") kept for the rewards (docs/fine-tuning.md)")
    prep.add_argument("--chat-template",
                      help=f"with --chat (default auto), --preference or --prompts (default none: rows of text): "
                           f"auto (the tokenizer's own chat_template), a built-in ({', '.join(chat_lib.BUILTIN)}) "
                           f"or a .jinja file")
    prep.add_argument("--allow-dropped-text", action="store_true",
                      help="prepare although the tokenizer (one without an unknown token) maps some characters to "
                           "no token: a warning with their counts instead of an error")
    prep.add_argument("--allow-degenerate-rows", action="store_true",
                      help="with --chat or --preference: keep rows that train nothing or the wrong thing (unknown "
                           "roles, no assistant turn, identical or empty responses, a response holding another "
                           "turn) with a warning of their counts, instead of an error")
    train = commands.add_parser("train-tokenizer", parents=[source], help="train a byte-level BPE on SRC")
    train.add_argument("--vocab-size", type=number(int, min=1), required=True,
                       help="ids in the vocabulary, EOS included")
    train.add_argument("--out", required=True, help="the tokenizer.json to write")
    train.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    train.add_argument("--eos", default="<|endoftext|>", help="the end-of-document special token")
    return p


@command
def main(argv=None) -> int:
    args = arguments(parser(), argv)
    kind = detect(args.src, args.kind, "SRC")
    started = time.perf_counter()
    if args.command == "prepare":
        tok = tokenizer_lib.load(args.tokenizer)
        if args.prompts:
            return _prepare_prompts(args, kind, tok, started)
        if args.chat and args.preference:
            raise UserError("--chat prepares conversations, --preference preference pairs: pass one")
        if args.chat_template is not None and not (args.chat or args.preference):
            raise UserError("--chat-template renders chat data: pass --chat (or --preference, or --prompts) too")
        if args.allow_degenerate_rows and not (args.chat or args.preference):
            raise UserError("--allow-degenerate-rows keeps chat or preference rows that train nothing; plain text "
                            "has none: pass --chat or --preference, or leave it out")
        field = chat_lib.MESSAGES if args.chat and args.text_field == "text" else args.text_field
        templated = args.chat or args.chat_template is not None  # preference pairs: where one is named
        chat = chat_lib.load_format(args.chat_template or "auto", tok) if templated else None
        if args.stage is not None and not store.is_uri(args.out):
            raise UserError(f"--stage is where a URI --out is written before its upload; --out {args.out} is a "
                            f"local folder, written in place: leave --stage out")
        if args.ray is None:
            m = prepare(args.src, tok, args.out, args.workers or os.cpu_count(), field, args.shard_tokens,
                        kind, args.allow_dropped_text, chat, args.preference, args.stage,
                        allow_degenerate=args.allow_degenerate_rows)
        elif args.workers is not None:
            raise UserError("--workers is for one machine; with --ray each unit is a Ray task on a CPU of the "
                            "cluster: leave --workers out")
        else:
            m = prepare_on_ray(args.src, tok, args.out, args.ray, field, args.shard_tokens, kind,
                               args.allow_dropped_text, chat, args.preference, args.stage,
                               allow_degenerate=args.allow_degenerate_rows)
        seconds = time.perf_counter() - started
        trained = f"; {m['trained_tokens']:,} tokens in assistant turns (the loss mask)" if args.chat else ""
        if args.preference:
            trained = f"; {m['pairs']:,} preference pairs, {m['trained_tokens']:,} response tokens (the loss mask)"
        print(f"{args.out}: {m['tokens']:,} tokens ({m['dtype']}) from {m['documents']:,} documents in "
              f"{len(m['shards'])} shard(s), {seconds:.1f} s ({m['tokens'] / seconds:,.0f} tokens/s){trained}")
    else:
        texts = itertools.chain.from_iterable(read(u, args.text_field) for u in units(kind, args.src))
        with writing_file(args.out, "--out", args.force, (".json",)) as tmp:  # checked before training
            tokenizer_lib.train_bpe(texts, args.vocab_size, tmp, eos=args.eos)
        tok = tokenizer_lib.HFTokenizer(args.out, eos=args.eos)
        print(f"{args.out}: byte-level BPE, {tok.vocab_size:,} ids, EOS {args.eos!r} = {tok.eos_id}, "
              f"{time.perf_counter() - started:.1f} s")
    return 0


def _prepare_prompts(args, kind: str, tok, started: float) -> int:
    """prepare --prompts (meshtrain/data/prompts.py): one process, a local --out."""
    others = [flag for flag, given in (("--chat", args.chat), ("--preference", args.preference), ("--ray", args.ray),
                                       ("--workers", args.workers), ("--stage", args.stage),
                                       ("--allow-degenerate-rows", args.allow_degenerate_rows),
                                       ("--text-field", args.text_field != "text")) if given]
    if others:
        raise UserError(f"--prompts prepares prompt rows (their prompt or messages field) on this machine; leave "
                        f"out {', '.join(others)}")
    if kind != "jsonl":
        raise UserError(f"--prompts reads jsonl rows; {args.src} is {kind}: write one JSON object a line")
    if store.is_uri(args.out):
        raise UserError(f"--prompts writes a local folder; --out {args.out} is a URI: prepare locally, then copy it")
    fmt = chat_lib.load_format(args.chat_template, tok) if args.chat_template else None
    m = prepare_prompts(args.src, tok, args.out, fmt, args.allow_dropped_text)
    ends = "EOS" if m["end_of_turn"] is None else f"EOS or {tok.decode([m['end_of_turn']])}"
    print(f"{args.out}: {m['prompts']:,} prompts, {m['tokens']:,} tokens (completions end at {ends}), "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
