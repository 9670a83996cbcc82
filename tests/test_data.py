"""Batches depend only on (seed, step); token streams over shards; sources; process-local rows."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain import data
from meshtrain.config.loader import DataConfig, UserError
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.parallel.mesh import build_mesh, parse_mesh


def batches(tokens, sharding, seed=0, split=0):
    return data.Batches(tokens, batch_size=8, seq_len=5, seed=seed, split=split, sharding=sharding,
                        vocab_size=256)


@pytest.mark.fast
def test_batch_depends_only_on_seed_and_step_not_on_mesh():
    tokens = np.arange(1000, dtype=np.uint16) % 256
    one = NamedSharding(build_mesh(parse_mesh("1", 1), jax.devices()[:1]), P())
    eight = NamedSharding(build_mesh(parse_mesh("data=4,fsdp=2", 8)), P(("data", "fsdp")))
    a, b = batches(tokens, one)(7), batches(tokens, eight)(7)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding == eight and a.shape == (8, 6)
    assert not np.array_equal(np.asarray(batches(tokens, one)(8)), np.asarray(a))
    assert not np.array_equal(np.asarray(batches(tokens, one, seed=1)(7)), np.asarray(a))
    rows = np.asarray(a)
    np.testing.assert_array_equal(np.diff(rows, axis=1) % 256, 1)  # contiguous windows of the stream


@pytest.mark.fast
def test_text_folder_and_token_file_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "b.md").write_text("world")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    corpus = data.load_corpus(DataConfig(path=str(tmp_path)), 256)
    assert ByteTokenizer().decode(np.asarray(corpus.tokens)) == "hello \nworld\n"
    assert corpus.tokenizer.name == "byte"

    ids = np.arange(50000, 50100, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")  # nanoGPT's plain uint16 file: no sidecar, no known tokenizer
    corpus = data.load_corpus(DataConfig(path=str(tmp_path / "train.bin")), 50304)
    mm = corpus.tokens.parts[0]
    assert isinstance(mm, np.memmap) and mm[3] == 50003 and corpus.tokenizer is None
    sharding = NamedSharding(build_mesh(parse_mesh("1", 1), jax.devices()[:1]), P())
    small_vocab = data.Batches(mm, 4, 5, 0, 0, sharding, vocab_size=256)
    with pytest.raises(UserError, match="token id .* >= model.vocab_size=256"):
        small_vocab(0)


def test_default_corpus_is_the_stdlib_and_splits_off_validation():
    files = data.stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    tokens = data.load_corpus(DataConfig(), 256).tokens
    train, val = data.split_tokens(tokens, 0.05, seq_len=64)
    assert len(val) == len(tokens) - len(train) and 0.04 < len(val) / len(tokens) < 0.06


@pytest.mark.fast
def test_short_data_names_the_split_that_is_too_short():
    tokens = np.zeros(1000, np.uint8)
    with pytest.raises(UserError, match=r"the data holds 1,000 tokens, leaving 50 for validation "
                                        r"\(data.val_fraction=0.05\), which is not more than "
                                        r"train.seq_len \+ 1 = 65"):
        data.split_tokens(tokens, 0.05, seq_len=64)
    assert data.split_tokens(tokens, 0.0, seq_len=64)[1] is None


@pytest.mark.fast
def test_token_file_of_a_partial_token_is_an_error(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(UserError, match="has 3 bytes, not a whole number of 2-byte .uint16. tokens"):
        data.load_corpus(DataConfig(path=str(tmp_path / "odd.bin")), 256)


@pytest.mark.fast
def test_each_process_reads_only_its_rows():
    mesh = build_mesh(parse_mesh("data=8", 8))
    b = batches(np.arange(1000) % 256, NamedSharding(mesh, P("data")))
    assert b.rows.tolist() == list(range(8))  # one process holds every device here
    assert b.local_rows(0).shape == (8, 6)


@pytest.mark.fast
def test_synthetic_data_is_deterministic():
    sharding = NamedSharding(build_mesh(parse_mesh("1", 1), jax.devices()[:1]), P())
    a, b = batches(None, sharding)(3), batches(None, sharding)(3)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(np.asarray(a).max()) < 256


@pytest.mark.fast
def test_windows_cross_shard_boundaries_and_slices_stay_views(tmp_path):
    parts = np.split(np.arange(20, dtype=np.uint16), [7, 9])
    stream = data.Tokens(parts)
    assert len(stream) == 20
    np.testing.assert_array_equal(stream.windows(np.array([0, 5, 6, 13]), 5),
                                  [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [6, 7, 8, 9, 10], [13, 14, 15, 16, 17]])
    middle = stream[4:12]
    assert len(middle) == 8 and np.asarray(middle).tolist() == list(range(4, 12))
    assert all(np.shares_memory(a, b) for a, b in zip(middle.parts, parts))


@pytest.mark.fast
def test_sharded_stream_gives_the_same_batches_as_one_array_on_any_mesh():
    whole = (np.arange(1000) % 256).astype(np.uint16)
    sharded = data.Tokens(np.split(whole, [100, 101, 640]))
    one = NamedSharding(build_mesh(parse_mesh("1", 1), jax.devices()[:1]), P())
    eight = NamedSharding(build_mesh(parse_mesh("data=2,fsdp=4", 8)), P(("data", "fsdp")))
    for step in range(3):
        expected = np.asarray(batches(whole, one)(step))
        np.testing.assert_array_equal(np.asarray(batches(sharded, eight)(step)), expected)


# ---- content hashes (meshtrain/data/digest.py): the whole stream, read once per version of a file ----
@pytest.fixture
def reads(tmp_path, monkeypatch):
    """Counts the files digest.py reads, with a cache of this test's own."""
    from meshtrain.data import digest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    counted, read = [], digest.read_sha256
    monkeypatch.setattr(digest, "read_sha256", lambda paths: counted.append(list(paths)) or read(paths))
    return counted


@pytest.mark.fast
def test_a_cached_hash_is_read_once_and_a_touched_or_changed_file_again(tmp_path, monkeypatch, reads):
    import hashlib
    import os

    from meshtrain.data import digest

    path = tmp_path / "train.bin"
    (np.arange(300_000) % 50_000).astype(np.uint16).tofile(path)
    stream = lambda: data.read_token_file(path)[0]
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    assert data.Tokens([stream()], [path]).sha256() == sha256 == data.Tokens([np.asarray(stream())]).sha256()
    assert data.Tokens([stream()], [path]).sha256() == sha256 and len(reads) == 2  # just written: not cached

    monkeypatch.setattr(digest, "RACY_NS", 0)  # as if written long ago
    for _ in range(3):
        assert data.Tokens([stream()], [path]).sha256() == sha256
    assert len(reads) == 3  # one read, then the cache
    assert str(path) in (tmp_path / "cache" / "meshtrain" / "sha256.json").read_text()
    os.utime(path, ns=(1, os.stat(path).st_mtime_ns - 10**9))  # touched: read again, and still the same
    assert data.Tokens([stream()], [path]).sha256() == sha256 and len(reads) == 4
    mtime = os.stat(path).st_mtime_ns
    with open(path, "r+b") as f:  # 2 bytes changed, size and mtime kept: ctime_ns tells
        f.seek(400_000)
        f.write(b"\xff\xff")
    os.utime(path, ns=(1, mtime))
    assert data.Tokens([stream()], [path]).sha256() == hashlib.sha256(path.read_bytes()).hexdigest() != sha256
    assert len(reads) == 5
    cache = (tmp_path / "cache" / "meshtrain" / "sha256.json").read_text()
    assert sha256 not in cache  # the entry of the old version is dropped once another is written
