"""`prepare` throughput by engine: one host's `--workers N` against `--ray` on a local Ray cluster of
1 and then 2 nodes (raylets of --node-cpus CPUs each, on this machine), the same source and tokenizer.

    python benchmarks/prepare.py [--text FILE] [--repeat 10] [--vocab-size 4096] [--unit-mb 1]

FILE's paragraphs x --repeat are written as docs.jsonl (benchmarks/loader.py `write_sources`) and
split into --unit-mb units (sources.UNIT_BYTES, 8 MiB by default: smaller here, so a small source
still has units for every worker). Each engine prepares it with a BPE of --vocab-size ids trained on
FILE; the table gives tokens/s (the cluster's start-up not counted) and checks that every engine
wrote the same manifest (content hash included).
"""
import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loader.py, beside this file

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    from loader import write_sources

    from meshtrain.data import cluster, prepare, sources, tokenizer
    from meshtrain.testing import benchmark_text

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=benchmark_text() or None, required=not benchmark_text(),
                   help="a text file, split into paragraphs (default: ../shared/data/tinyshakespeare.txt)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--unit-mb", type=float, default=1.0, help="MiB of jsonl per unit (one task or worker job)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="one-host worker counts")
    p.add_argument("--node-cpus", type=int, default=1, help="CPUs each Ray node offers")
    args = p.parse_args()

    sources.UNIT_BYTES = int(args.unit_mb * (1 << 20))
    folder = Path(tempfile.mkdtemp(prefix="meshtrain-prepare-engines-"))
    src, size = write_sources(args.text, args.repeat, folder)["jsonl"]
    bpe = tokenizer.train_bpe([Path(args.text)], args.vocab_size, folder / "bpe" / "tokenizer.json")
    n_units = len(sources.units("jsonl", str(src)))
    print(f"{src}: {size / 1e6:.1f} MB of text ({args.text} x {args.repeat}) in {n_units} units; BPE "
          f"{args.vocab_size}; {os.cpu_count()} cores\n| engine | tokens | seconds | tokens/s | MB/s of text |\n"
          f"|---|---|---|---|---|", flush=True)
    manifests = []

    def row(name: str, run) -> None:
        started = time.perf_counter()
        manifests.append(run(folder / name.replace(" ", "-").replace(",", "")))
        s = time.perf_counter() - started
        print(f"| {name} | {manifests[-1]['tokens']:,} | {s:.2f} | {manifests[-1]['tokens'] / s:,.0f} | "
              f"{size / s / 1e6:.2f} |", flush=True)

    for w in args.workers:
        row(f"one host, --workers {w}", lambda out, w=w: prepare(str(src), bpe, out, workers=w))
    import ray
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": args.node_cpus, "include_dashboard": False})
    try:
        ray.init(address=nodes.address, logging_level=logging.WARNING)
        for n in (1, 2):
            if n == 2:
                nodes.add_node(num_cpus=args.node_cpus)
                nodes.wait_for_nodes()
            row(f"--ray, {n} node(s) x {args.node_cpus} CPU", lambda out: cluster.prepare_on_ray(str(src), bpe, out))
    finally:
        ray.shutdown()
        nodes.shutdown()
    same = all(m == manifests[0] for m in manifests)
    print(f"every engine wrote the same manifest (sha256 {manifests[0]['sha256'][:12]}...): {same}")
    if not same:
        print(json.dumps([m["sha256"] for m in manifests]))
        sys.exit(1)


if __name__ == "__main__":
    main()
