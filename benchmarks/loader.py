"""Input-pipeline rates: how fast the loader builds batches against how fast training consumes them,
and how fast `prepare` tokenizes.

    python benchmarks/loader.py rate --data DIR_OR_FILE [--batch-size 32] [--seq-len 1024]
           [--metrics RUN/metrics.jsonl | --step-config configs/shakespeare_char.yaml]
    python benchmarks/loader.py prepare --text FILE [--repeat 20] [--vocab-size 4096] [--workers 1 2]

`rate` builds batches of one device (rows drawn at random from the memory-mapped stream, then placed
on the device as a jax.Array) and prints the loader's tokens/s beside the tokens/s of a training
step: the median `tokens_per_sec` of a run's metrics.jsonl, or of a short run of --step-config at
the same batch and sequence length. `prepare` splits FILE into paragraphs (documents), repeats them
--repeat times, writes them as jsonl and as a Spark-style folder of Parquet part files, trains a BPE
tokenizer, and prints prepare's tokens/s and MB/s for each source, tokenizer and worker count.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def loader_rate(path: str, batch_size: int, seq_len: int, batches: int) -> dict:
    """Tokens/s of host rows (numpy) and of whole batches (rows + device array), after one warm-up."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from meshtrain.config.loader import DataConfig
    from meshtrain.data import Batches, load_corpus

    started = time.perf_counter()
    corpus = load_corpus(DataConfig(path=path), 1 << 20)
    load_s = time.perf_counter() - started
    b = Batches(corpus.tokens, batch_size, seq_len, 0, 0, SingleDeviceSharding(jax.devices()[0]), 1 << 20)
    b(0).block_until_ready()
    rates = {}
    for name, build in (("host rows", b.local_rows), ("device batch", lambda k: b(k).block_until_ready())):
        started = time.perf_counter()
        for k in range(1, batches + 1):
            build(k)
        rates[name] = batches * batch_size * seq_len / (time.perf_counter() - started)
    return {"load_s": load_s, "tokens": len(corpus.tokens), **rates}


def step_rate(metrics: str | None, config: str | None, batch_size: int, seq_len: int) -> tuple[float, str]:
    """(tokens/s a training step consumes, where the figure comes from)."""
    if metrics:
        records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
        rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
        if not rates:
            raise SystemExit(f"{metrics} logs no tokens_per_sec; pass a training run's metrics.jsonl")
        rates = rates[1:] or rates  # the first record's interval holds the compile
        return statistics.median(rates), f"median of {metrics}, at that run's batch and seq_len"
    from meshtrain.config.loader import load_config
    from meshtrain.run.trainer import Trainer

    cfg = load_config(config, ["parallel.mesh=1", "data.kind=synthetic", f"train.batch_size={batch_size}",
                               f"train.seq_len={seq_len}", "train.steps=12", "train.log_every=4",
                               "train.eval_every=0", "checkpoint.resume=never", f"out={tempfile.mkdtemp()}"])
    history = Trainer(cfg, devices=__import__("jax").devices()[:1]).fit()
    rates = [r["tokens_per_sec"] for r in history if "tokens_per_sec" in r][1:]
    return statistics.median(rates), f"{config} on 1 device, steps 5-12"


def rate(args) -> None:
    r = loader_rate(args.data, args.batch_size, args.seq_len, args.batches)
    consumed, source = step_rate(args.metrics, args.step_config, args.batch_size, args.seq_len)
    print(f"{args.data}: {r['tokens']:,} tokens, loaded in {r['load_s']:.2f} s; batch {args.batch_size} x "
          f"{args.seq_len}\n| | tokens/s | vs the step |\n|---|---|---|")
    for name in ("host rows", "device batch"):
        print(f"| loader, {name} | {r[name]:,.0f} | {r[name] / consumed:,.1f}x |")
    print(f"| training step ({source}) | {consumed:,.0f} | 1x |")


def write_sources(text_file: str, repeat: int, folder: Path) -> dict[str, tuple[Path, int]]:
    """Paragraphs of `text_file` x `repeat` as docs.jsonl and a folder of Parquet part files:
    {kind: (path, bytes of text)}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d for d in Path(text_file).read_text().split("\n\n") if d.strip()] * repeat
    size = sum(len(d.encode()) for d in docs)
    with open(folder / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    (folder / "parquet").mkdir()
    parts = 4
    for i in range(parts):
        part = docs[i * len(docs) // parts:(i + 1) * len(docs) // parts]
        pq.write_table(pa.table({"text": part}), folder / "parquet" / f"part-{i:05d}.parquet", row_group_size=8192)
    return {"jsonl": (folder / "docs.jsonl", size), "parquet": (folder / "parquet", size)}


def prepare_rates(args) -> None:
    from meshtrain.data import prepare, tokenizer

    folder = Path(tempfile.mkdtemp(prefix="meshtrain-prepare-bench-"))
    sources = write_sources(args.text, args.repeat, folder)
    started = time.perf_counter()
    bpe = tokenizer.train_bpe([Path(args.text)], args.vocab_size, folder / "bpe" / "tokenizer.json")
    print(f"{len(sources)} sources of {sources['jsonl'][1] / 1e6:.1f} MB of text ({args.text} x {args.repeat}); "
          f"BPE ({args.vocab_size} ids) trained in {time.perf_counter() - started:.1f} s on {os.cpu_count()} cores")
    print("| source | tokenizer | workers | tokens | seconds | tokens/s | MB/s of text |\n"
          "|---|---|---|---|---|---|---|")
    for kind, (src, size) in sources.items():
        for name, tok in (("byte", tokenizer.ByteTokenizer()), (f"BPE {args.vocab_size}", bpe)):
            for workers in args.workers:
                out = folder / f"out-{kind}-{name}-{workers}".replace(" ", "")
                started = time.perf_counter()
                m = prepare(str(src), tok, out, workers=workers)
                s = time.perf_counter() - started
                print(f"| {kind} | {name} | {workers} | {m['tokens']:,} | {s:.2f} | {m['tokens'] / s:,.0f} | "
                      f"{size / s / 1e6:.1f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = p.add_subparsers(dest="command", required=True)
    r = commands.add_parser("rate", help="loader tokens/s vs a training step's")
    r.add_argument("--data", required=True, help="a prepared folder, token file or raw text")
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--seq-len", type=int, default=1024)
    r.add_argument("--batches", type=int, default=50)
    r.add_argument("--metrics", help="a run's metrics.jsonl: its median tokens_per_sec is the step's rate")
    r.add_argument("--step-config", default="configs/shakespeare_char.yaml",
                   help="without --metrics: time a short run of this config (synthetic data, one device)")
    q = commands.add_parser("prepare", help="prepare's throughput on jsonl and Parquet")
    q.add_argument("--text", required=True, help="a text file, split into paragraphs")
    q.add_argument("--repeat", type=int, default=20)
    q.add_argument("--vocab-size", type=int, default=4096)
    q.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    rate(args) if args.command == "rate" else prepare_rates(args)


if __name__ == "__main__":
    main()
