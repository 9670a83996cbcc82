"""Sources (jsonl, Parquet, datasets, text), prepare's shards and manifest, token dtypes, their errors."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshtrain import data
from meshtrain.config.loader import DataConfig, UserError
from meshtrain.data import prepare, sources, tokenizer
from meshtrain.data.__main__ import main
from meshtrain.data.prepare import tokenize, tokenized

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)

DOCS = [f"Document {i}: " + "all the world's a stage, " * (i % 5) + "é✓" for i in range(40)]
BYTE = tokenizer.ByteTokenizer()


def expected(tok, docs=DOCS) -> list[int]:
    return [int(t) for d in docs for t in [*tok.encode(d), *tokenizer.document_end(tok)]]


def write_jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_spark_parquet(folder, docs=DOCS, column="body"):
    """Spark's layout: part files of several row groups, beside _SUCCESS and .crc files."""
    folder.mkdir()
    half = len(docs) // 2
    for i, part in enumerate([docs[:half], docs[half:]]):
        name = f"part-{i:05d}-x.snappy.parquet"
        pq.write_table(pa.table({"id": range(len(part)), column: part}), folder / name, row_group_size=7)
        (folder / f".{name}.crc").write_bytes(b"crc")
    (folder / "_SUCCESS").write_text("")
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return tokenizer.train_bpe(DOCS, 300, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def corpus_ids(path, **kw):
    return np.asarray(data.load_corpus(DataConfig(path=str(path), **kw), 512).tokens).tolist()


def test_each_source_kind_gives_its_documents_tokens(tmp_path):
    datasets = pytest.importorskip("datasets")
    write_jsonl(tmp_path / "docs.jsonl")
    write_spark_parquet(tmp_path / "spark")
    datasets.Dataset.from_dict({"content": DOCS}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "texts").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "texts" / f"{i:03d}.txt").write_text(d)
    for name, kind, field in [("docs.jsonl", "jsonl", "text"), ("spark", "parquet", "body"),
                              ("saved", "hf_datasets", "content"), ("texts", "text", "text")]:
        assert sources.detect(str(tmp_path / name)) == kind
        assert corpus_ids(tmp_path / name, text_field=field) == expected(BYTE), name
    assert sources.detect(str(tmp_path / "spark" / "part-00000-x.snappy.parquet")) == "parquet"


def test_prepare_writes_shards_a_manifest_and_eos_after_every_document(bpe, tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl")
    manifest = prepare(str(src), bpe, tmp_path / "out", shard_tokens=200)
    ids = expected(bpe)
    assert ids.count(bpe.eos_id) == len(DOCS) and ids[-1] == bpe.eos_id
    assert (manifest["tokens"], manifest["documents"], manifest["dtype"]) == (len(ids), len(DOCS), "uint16")
    assert manifest["vocab_size"] == 300 and manifest["eos_id"] == bpe.eos_id
    assert manifest["source"] == {"path": str(src), "kind": "jsonl", "text_field": "text"}
    shards = manifest["shards"]
    assert [s["file"] for s in shards] == [f"shard-{i:05d}.bin" for i in range(len(shards))]
    assert [s["tokens"] for s in shards] == [200] * (len(shards) - 1) + [len(ids) - 200 * (len(shards) - 1)]
    assert sum(s["documents"] for s in shards) == len(DOCS)
    on_disk = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], np.uint16) for s in shards])
    assert on_disk.tolist() == ids
    sidecar = json.loads((tmp_path / "out" / "shard-00001.bin.json").read_text())
    assert sidecar == {**sidecar, "dtype": "uint16", "tokens": 200, "documents": shards[1]["documents"]}
    corpus = data.load_corpus(DataConfig(path=str(tmp_path / "out")), 300)  # the folder's own tokenizer
    assert np.asarray(corpus.tokens).tolist() == ids and corpus.tokenizer.eos_id == bpe.eos_id
    assert all(isinstance(p, np.memmap) for p in corpus.tokens.parts)
    one_shard = data.load_corpus(DataConfig(path=str(tmp_path / "out" / "shard-00000.bin")), 300)
    assert np.asarray(one_shard.tokens).tolist() == ids[:200] and one_shard.tokenizer.vocab_size == 300


def test_parallel_prepare_writes_what_serial_prepare_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "UNIT_BYTES", 700)  # jsonl byte ranges end mid-line
    write_spark_parquet(tmp_path / "spark")
    write_jsonl(tmp_path / "docs.jsonl")
    for src, field in [(tmp_path / "spark", "body"), (tmp_path / "docs.jsonl", "text")]:
        assert len(sources.units(sources.detect(str(src)), str(src))) > 3
        one, two = tmp_path / f"{src.name}1", tmp_path / f"{src.name}2"
        serial = prepare(str(src), BYTE, one, workers=1, text_field=field, shard_tokens=500)
        parallel = prepare(str(src), BYTE, two, workers=2, text_field=field, shard_tokens=500)
        assert serial == parallel and len(serial["shards"]) > 1
        for s in serial["shards"]:
            assert (one / s["file"]).read_bytes() == (two / s["file"]).read_bytes()
        assert corpus_ids(two) == expected(BYTE)


def test_a_failing_unit_stops_the_workers_and_leaves_none_behind(tmp_path):
    """Every unit of the source lacks the text field: the first error surfaces from the workers, the
    queued units are cancelled, and no worker process is left (multiprocessing.Pool's terminate could
    hang here: meshtrain/data/prepare.py)."""
    import multiprocessing

    src = write_spark_parquet(tmp_path / "spark")
    parts = sources.units(sources.detect(str(src)), str(src))
    assert len(parts) > 3
    with pytest.raises(UserError, match="has no column 'text'"):
        list(tokenized(parts, BYTE, "text", workers=2))
    assert multiprocessing.active_children() == []


def test_token_dtype_follows_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert data.token_dtype(256) == data.token_dtype(65536) == np.uint16
    assert data.token_dtype(65537) == np.uint32
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    tok = tokenizer.HFTokenizer(tmp_path / "big.json", eos=69999)
    (tmp_path / "a.txt").write_text("w1 w65536 w69998")
    manifest = prepare(str(tmp_path / "a.txt"), tok, tmp_path / "out")
    assert manifest["dtype"] == "uint32"
    shard = tmp_path / "out" / "shard-00000.bin"
    assert np.fromfile(shard, np.uint32).tolist() == [1, 65536, 69998, 69999]
    corpus = data.load_corpus(DataConfig(path=str(shard)), 70000)  # read as uint32, as its sidecar says
    assert np.asarray(corpus.tokens).tolist() == [1, 65536, 69998, 69999]


def test_cli_prepares_and_trains_a_tokenizer(tmp_path, capsys):
    write_jsonl(tmp_path / "docs.jsonl")
    assert main(["train-tokenizer", str(tmp_path / "docs.jsonl"), "--vocab-size", "280",
                 "--out", str(tmp_path / "tok" / "tokenizer.json")]) == 0
    assert main(["prepare", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "byte-level BPE, 280 ids, EOS '<|endoftext|>' = 0" in out
    assert "from 40 documents in 1 shard(s)" in out
    ids = np.fromfile(tmp_path / "out" / "shard-00000.bin", np.uint16)
    assert tokenizer.for_run(tmp_path / "out").decode(ids) == "".join(d + "<|endoftext|>" for d in DOCS)


def test_bad_sources_are_one_line_errors(bpe, tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "ok", \n')
    write_jsonl(tmp_path / "other.jsonl", field="content")
    write_spark_parquet(tmp_path / "spark")
    saved = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"train": saved, "test": saved}).save_to_disk(str(tmp_path / "dict"))
    prepare(str(tmp_path / "other.jsonl"), BYTE, tmp_path / "prepared", text_field="content")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    capsys.readouterr()  # datasets' progress bars
    cases = [  # (source and flags, --out, message)
        (["bad.jsonl"], "new", "bad.jsonl, line at byte 15: not JSON"),
        (["other.jsonl"], "new", "line at byte 0: no field 'text' (has: id, content); set data.text_field"),
        (["spark"], "new", "x.snappy.parquet has no column 'text' (has: id, body); set data.text_field"),
        (["dict"], "new", "is a DatasetDict with splits train, test; pass one split's folder, e.g. --data"),
        (["spark", "--kind", "jsonl"], "new", "no .jsonl files under"),
        (["prepared"], "new", "holds prepared, not documents"),
        (["other.jsonl", "--text-field", "content"], "busy", "busy already exists and is not empty"),
        (["missing.txt"], "new", "missing.txt' does not exist; pass an existing file or folder"),
    ]
    for (src, *flags), out, message in cases:
        assert main(["prepare", str(tmp_path / src), *flags, "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (src, err)
        assert not any((tmp_path / "new").glob("*"))  # a failure leaves nothing behind
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"

    with pytest.raises(UserError, match=r"is not the tokenizer .*prepared was written with "
                                        r"\(byte, 256 ids\); set data.tokenizer=auto"):
        data.load_corpus(DataConfig(path=str(tmp_path / "prepared"), tokenizer=str(bpe.path)), 300)
    with pytest.raises(UserError, match="model.vocab_size=200 is smaller than the vocabulary of .*ed's"):
        data.load_corpus(DataConfig(path=str(tmp_path / "prepared")), 200)
    monkeypatch.setattr(data.corpus, "RAW_LIMIT_BYTES", 100)
    with pytest.raises(UserError, match=r"more than training tokenizes on load .*; run python -m meshtrain"
                                        r".data prepare .*other.jsonl --tokenizer byte --out DIR once"):
        data.load_corpus(DataConfig(path=str(tmp_path / "other.jsonl"), text_field="content"), 256)


def test_a_run_checks_every_prepared_byte_once_and_refuses_a_changed_shard_by_name(tmp_path, monkeypatch):
    """prepare hashes what it writes (each shard in its sidecar and manifest row, the stream in the
    manifest); a run checks the shards' bytes against the manifest before it trains, reading them once
    per version of the files (digest.py's cache), and refuses a shard changed since by its name; a
    manifest of an earlier version without hashes vouches for nothing: the stream is hashed."""
    import hashlib

    from meshtrain.data import digest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "RACY_NS", 0)  # the files were written a moment ago: cache them all the same
    src, out = write_jsonl(tmp_path / "docs.jsonl"), tmp_path / "out"
    manifest = prepare(str(src), BYTE, out, shard_tokens=700)
    shards = [out / s["file"] for s in manifest["shards"]]
    assert len(shards) > 2
    whole = hashlib.sha256(b"".join(f.read_bytes() for f in shards)).hexdigest()
    assert manifest["sha256"] == whole
    for s, f in zip(manifest["shards"], shards):
        assert s["sha256"] == json.loads(data.tokens.sidecar(f).read_text())["sha256"] == digest.read_sha256([f])
    reads = []
    monkeypatch.setattr(digest, "read_sha256", lambda paths: reads.append(paths) or hashlib.sha256(
        b"".join(open(p, "rb").read() for p in paths)).hexdigest())
    stream = lambda path: data.load_corpus(DataConfig(path=str(path)), 512).tokens
    assert stream(out).sha256() == whole and reads == [shards]  # every byte read once, before training
    assert stream(out).sha256() == whole and reads == [shards]  # then known from the cache
    assert stream(shards[1]).sha256() == manifest["shards"][1]["sha256"]  # a token file: its sidecar's
    raw = stream(src)  # tokenized on load: the same tokens, the same hash
    assert raw.sha256() == whole and reads == [shards]

    prepared = shards[1].read_bytes()
    shards[1].write_bytes(b"x\0" * 3 + prepared[6:])  # the same size, other bytes
    with pytest.raises(UserError, match=f"{out}: the bytes of shard-00001.bin are not the ones prepare wrote"):
        stream(out)
    assert reads[1:] == [shards, [shards[0]], [shards[1]]]  # the stream, then each shard to the changed one
    shards[1].write_bytes(prepared)  # as it was prepared
    del manifest["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))  # an earlier version's manifest
    assert stream(out).sha256() == whole


def test_a_tokenizer_without_an_unknown_token_that_drops_text_is_an_error_or_a_counted_warning(tmp_path, capsys,
                                                                                               caplog):
    """A BPE with no unknown token and no byte fallback maps every character outside its vocabulary to
    nothing: most of a corpus could vanish at prepare without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz<>|")}
    rust = Tokenizer(models.BPE(vocab, [], unk_token=None))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces split words: never counted as dropped
    rust.add_special_tokens(["<|endoftext|>"])
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("plain words here\nÜber 123 straße\n")
    argv = ["prepare", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--workers", "1"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    # Ü, 1, 2, 3 and ß: 5 of the 27 characters that are not whitespace
    assert err == (f"error: tokenizer {tmp_path / 'tokenizer.json'} has no unknown token: it maps 5 characters of "
                   f"{tmp_path / 'corpus.txt'} to no token (18.52%; most often 'Ü' x 1, '1' x 1, '2' x 1) of what "
                   f"was read so far; use a tokenizer that covers this text (a byte-level BPE: python -m "
                   f"meshtrain.data train-tokenizer), or pass --allow-dropped-text to prepare it without them\n")
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--out", str(tmp_path / "out"), "--allow-dropped-text"]) == 0
    assert "warning: tokenizer" in capsys.readouterr().err and "maps 5 characters" in caplog.text
    assert (tmp_path / "out" / "manifest.json").exists()
    # A tokenizer that covers the text (bytes) drops nothing and says nothing.
    part = tokenize(sources.units("text", str(tmp_path / "corpus.txt"))[0], BYTE, "text")
    assert part.dropped == {} and len(part.ids)


def test_prepares_workers_never_start_jax():
    """The modules a prepare worker (a process of `--workers`, a Ray task) imports leave JAX out:
    each would spend seconds starting it, and with the GPU plugin installed print its probe lines."""
    import subprocess
    import sys

    code = "import sys, meshtrain.data.prepare, meshtrain.data.cluster; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr[-2000:]
