"""Data: tokenized sources, token files and deterministic batches.

- sources.py: raw sources (text, jsonl, Parquet, datasets folders, the standard library), detected
  from the path and read in units.
- tokens.py: token files (dtype from the vocabulary, sidecars), prepared folders, the `Tokens` stream.
- digest.py: the sha256 of a token stream's bytes, cached by file (path, size, times).
- prepare.py: `python -m meshtrain.data prepare`: tokenize once, in parallel, into shards.
- chat.py: `prepare --chat`: conversations rendered with a chat template, a loss mask on the
  assistant turns.
- cluster.py: `prepare --ray`: the same shards, the units tokenized by Ray tasks on a cluster, resumable.
- store.py: prepared folders in object stores (s3://, gs://, ...): `prepare --out URI` stages and
  uploads one, manifest last; `data.path: URI` copies one into the local cache, checked.
- corpus.py: `load_corpus(data config)` -> the token stream and its tokenizer, for training.
- batches.py: `Batches`: the batch of step k depends only on (seed, split, k).
- tokenizer.py: byte-level and Hugging Face tokenizers, training one, recording it in a run.
- prefetch.py: the next batches built on a background thread while the step runs.
- mixture.py: `data.sources`: weighted sources, each row from one (Grain's `MapDataset.mix`), each
  source's share and eval loss; one source is a plain `Batches`.
"""
from meshtrain.data.cluster import prepare_on_ray
from meshtrain.data.corpus import RAW_LIMIT_BYTES, Corpus, load_corpus
from meshtrain.data.prepare import prepare
from meshtrain.data.sources import KINDS, detect, stdlib_files
from meshtrain.data.tokens import Tokens, read_prepared, read_token_file, token_dtype

__all__ = ["Batches", "split_tokens", "synthetic_rows", "RAW_LIMIT_BYTES", "Corpus", "load_corpus", "prepare",
           "prepare_on_ray", "KINDS", "detect", "stdlib_files", "Tokens", "read_prepared", "read_token_file",
           "token_dtype"]


def __getattr__(name):
    """batches.py (it imports JAX) on first use: prepare and its worker processes never start JAX."""
    if name not in ("Batches", "split_tokens", "synthetic_rows"):
        raise AttributeError(f"module 'meshtrain.data' has no attribute {name!r}")
    from meshtrain.data import batches

    return getattr(batches, name)
