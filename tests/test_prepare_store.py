"""Prepared data in an object store (meshtrain/data/store.py) on a local S3 (moto's server): `prepare
--out s3://...` uploads the one-host prepare's bytes, manifest last; an upload killed midway leaves no
manifest, the reader refuses that prefix, and the rerun uploads only what is missing; training on
`data.path: s3://...` copies it into data.cache_dir once and trains as on the local folder."""
import copy
import json
import logging
import shutil
import socket

import jax
import pytest
from test_prepare import BYTE, write_jsonl
from test_sft import write_chat

from meshtrain.config.loader import DataConfig
from meshtrain.core.errors import UserError
from meshtrain.data import chat, load_corpus, prepare, store
from meshtrain.data.__main__ import main
from meshtrain.data.mixture import names, trains_on_mask
from meshtrain.data.tokens import read_prepared
from meshtrain.run.run_dir import resolve_data, run_mixture
from meshtrain.testing import run_tiny

moto_server = pytest.importorskip("moto.server")
pyarrow_fs = pytest.importorskip("pyarrow.fs")
SHARD_TOKENS = 600  # the source's 2,562 tokens in 5 shards


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(a URI maker: name -> s3://bucket/name?endpoint..., the bucket's filesystem) on a moto server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                           ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")]:
            patch.setenv(key, value)
        fs = pyarrow_fs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                                     allow_bucket_creation=True)
        fs.create_dir("bucket")
        yield (lambda name: f"s3://bucket/{name}?endpoint_override=127.0.0.1:{port}&scheme=http"), fs
    server.stop()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """(the jsonl source, its one-host prepared folder)."""
    root = tmp_path_factory.mktemp("local")
    src = write_jsonl(root / "docs.jsonl")
    prepare(str(src), BYTE, root / "prepared", shard_tokens=SHARD_TOKENS)
    return src, root / "prepared"


def uploaded(fs, name) -> dict:
    found = fs.get_file_info(pyarrow_fs.FileSelector(f"bucket/{name}", allow_not_found=True))
    return {f.base_name: fs.open_input_stream(f.path).read() for f in sorted(found, key=lambda f: f.path)}


def files(folder) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def prepare_to(uri, src, stage):
    return main(["prepare", str(src), "--tokenizer", "byte", "--out", uri, "--stage", str(stage),
                 "--shard-tokens", str(SHARD_TOKENS), "--workers", "1"])


def test_prepare_to_s3_uploads_the_one_host_bytes_and_refuses_a_second(s3, local, tmp_path, capsys):
    uri, fs = s3
    src, folder = local
    assert prepare_to(uri("web"), src, tmp_path / "stage") == 0
    assert uploaded(fs, "web") == files(folder)  # shards, sidecars, tokenizer, manifest: byte for byte
    assert len(json.loads((folder / "manifest.json").read_text())["shards"]) == 5
    assert [list(home.iterdir()) for home in (tmp_path / "stage").iterdir()] == [[]]  # the staged copy removed
    capsys.readouterr()
    assert prepare_to(uri("web"), src, tmp_path / "stage") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds prepared data (manifest.json)" in err and "s3://bucket/web" in err
    assert prepare_to(uri("web").replace("bucket/", "nobucket/"), src, tmp_path / "stage") == 2  # before any work
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out s3://nobucket/web: the bucket nobucket does not exist; create it" in err


def test_a_killed_upload_leaves_no_manifest_and_the_rerun_uploads_only_the_rest(s3, local, tmp_path, monkeypatch,
                                                                                 capsys):
    uri, fs = s3
    src, folder = local
    put, sent = store.Prefix.put, []

    def dies_at_the_fourth(self, path):
        if len(sent) == 3:
            raise KeyboardInterrupt  # Ctrl-C midway: shard 0 (data, sidecar) and shard 1's data are up
        sent.append(path.name)
        put(self, path)

    monkeypatch.setattr(store.Prefix, "put", dies_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), BYTE, uri("killed"), shard_tokens=SHARD_TOKENS, stage=tmp_path / "stage")
    assert sent == ["shard-00000.bin", "shard-00000.bin.json", "shard-00001.bin"]
    assert sorted(uploaded(fs, "killed")) == sent  # no manifest: not prepared data
    with pytest.raises(UserError, match=r"holds no manifest.json: not prepared data, or a prepare still uploading"):
        store.cached(uri("killed"), tmp_path / "cache")

    sent.clear()
    monkeypatch.setattr(store.Prefix, "put", lambda self, path: (sent.append(path.name), put(self, path)))
    prepare(str(src), BYTE, uri("killed"), shard_tokens=SHARD_TOKENS, stage=tmp_path / "stage")
    assert "shard-00000.bin" not in sent and "shard-00001.bin" in sent  # shard 1 had no sidecar up: sent again
    assert sent[-1] == "manifest.json"
    assert uploaded(fs, "killed") == files(folder)


def test_training_on_s3_data_copies_it_once_and_trains_as_on_the_local_folder(s3, local, tmp_path, monkeypatch):
    uri, fs = s3
    src, folder = local
    prepare(str(src), BYTE, uri("train"), shard_tokens=SHARD_TOKENS, stage=tmp_path / "stage")
    cache = tmp_path / "cache"
    steps = ("data.kind=auto", "train.steps=2", "parallel.mesh=1")
    on_s3, losses_s3, _ = run_tiny(f"data.path={uri('train')}", f"data.cache_dir={cache}", *steps,
                                   devices=jax.devices()[:1])
    _, losses_local, _ = run_tiny(f"data.path={folder}", *steps, devices=jax.devices()[:1])
    assert losses_s3.tolist() == losses_local.tolist()
    manifest = json.loads((folder / "manifest.json").read_text())
    record = json.loads((on_s3.out / "run.json").read_text())
    assert record["identity"]["data"].endswith(f"sha256:{manifest['sha256']}")  # the local folder's identity
    assert record["data_files"][0]["path"] == uri("train")
    assert files(cache / manifest["sha256"]) == files(folder)
    monkeypatch.setattr(store.Prefix, "get", lambda *a: pytest.fail("downloaded again"))
    assert store.cached(uri("train"), cache) == cache / manifest["sha256"]  # the cached copy, not the store
    cfg = copy.deepcopy(on_s3.cfg)  # what eval --run and a resume do: the run's data, found and checked
    resolve_data(on_s3.out, cfg)
    assert cfg.data.path == uri("train") and run_mixture(on_s3.out, cfg).tokens[0].sha256() == manifest["sha256"]


def test_processes_sharing_a_cache_share_one_copy(s3, local, tmp_path, monkeypatch):
    """Another process renames its copy into place first: this one's is dropped and theirs used."""
    uri, fs = s3
    src, folder = local
    prepare(str(src), BYTE, uri("shared"), shard_tokens=SHARD_TOKENS, stage=tmp_path / "stage")
    check, cache = store.check_sha256, tmp_path / "cache"
    key = json.loads((folder / "manifest.json").read_text())["sha256"]

    def finished_elsewhere(*args):
        check(*args)
        shutil.copytree(folder, cache / key)  # the other process's copy, whole
    monkeypatch.setattr(store, "check_sha256", finished_elsewhere)
    assert store.cached(uri("shared"), cache) == cache / key
    assert [p.name for p in cache.iterdir()] == [key] and files(cache / key) == files(folder)


def test_a_shard_changed_in_the_store_is_refused_by_its_hash(s3, local, tmp_path):
    uri, fs = s3
    src, folder = local
    prepare(str(src), BYTE, uri("changed"), shard_tokens=SHARD_TOKENS, stage=tmp_path / "stage")
    shard = (folder / "shard-00002.bin").read_bytes()
    with fs.open_output_stream("bucket/changed/shard-00002.bin") as f:
        f.write(shard[::-1])  # same size, other bytes
    with pytest.raises(UserError, match=r"s3://bucket/changed: the bytes of shard-00002.bin are not the ones prepare"):
        store.cached(uri("changed"), tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # nothing half-copied left as cached data
    with fs.open_output_stream("bucket/changed/manifest.json") as f:
        f.write(b'{"dtype": "uint16"}')
    with pytest.raises(UserError, match=r"data.path s3://bucket/changed: manifest.json.*prepare the data again"):
        store.cached(uri("changed"), tmp_path / "cache")


def test_chat_data_keeps_its_loss_mask_through_the_store(s3, tmp_path):
    """The .mask files go up and come back, checked against the manifest's mask_sha256; training
    sees from the manifest alone that the data has a loss mask."""
    uri, fs = s3
    src, how = write_chat(tmp_path / "chat.jsonl", 40), {"chat": chat.load_format("chatml", BYTE)}
    prepare(str(src), BYTE, tmp_path / "local", text_field="messages", shard_tokens=SHARD_TOKENS, **how)
    prepare(str(src), BYTE, uri("chat"), text_field="messages", shard_tokens=SHARD_TOKENS, stage=tmp_path / "s", **how)
    assert uploaded(fs, "chat") == files(tmp_path / "local") and "shard-00000.mask" in files(tmp_path / "local")
    assert trains_on_mask(DataConfig(path=uri("chat")))
    tokens, _ = read_prepared(store.cached(uri("chat"), tmp_path / "cache"))
    assert tokens.sha256() == read_prepared(tmp_path / "local")[0].sha256()  # tokens and mask
    mask = (tmp_path / "local" / "shard-00001.mask").read_bytes()
    with fs.open_output_stream("bucket/chat/shard-00001.mask") as f:
        f.write(bytes(1 - b for b in mask))
    with pytest.raises(UserError, match=r"the bytes of the .mask files are not the ones prepare wrote \(their "
                                        r"sha256 is not the one manifest.json records"):
        store.cached(uri("chat"), tmp_path / "other-cache")


def test_bad_uris_are_one_error_naming_the_uri(tmp_path, capsys):
    assert main(["prepare", "x.txt", "--out", "nosuch://bucket/x"]) == 2  # SRC checked first: a real one
    src = write_jsonl(tmp_path / "docs.jsonl")
    for out, says in [("nosuch://bucket/x", "--out nosuch://bucket/x: "),
                      (str(tmp_path / "local"), "--stage is where a URI --out is written")]:
        capsys.readouterr()
        assert main(["prepare", str(src), "--out", out, "--stage", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert names(["s3://b/web?endpoint_override=h:1&scheme=http", "gs://c/data/code"]) == ["web", "code"]  # metrics
    with pytest.raises(UserError, match="data.kind=jsonl with data.path s3://b/x: an object store holds prepared"):
        load_corpus(DataConfig(path="s3://b/x?endpoint_override=h:1", kind="jsonl"), 256)


@pytest.mark.fast
def test_an_unreachable_gcs_endpoint_ends_within_its_retry_bound(monkeypatch, capsys):
    """pyarrow's GCS client retries an unreachable endpoint for 15 minutes; meshtrain bounds it
    (store.bounded: retry_limit_seconds, here 2 s) and it ends in one line naming the URI."""
    import time

    assert store.bounded("gs://b/x") == "gs://b/x?retry_limit_seconds=60"
    assert store.bounded("gs://b/x?scheme=http") == "gs://b/x?scheme=http&retry_limit_seconds=60"
    assert store.bounded("gs://b/x?retry_limit_seconds=5") == "gs://b/x?retry_limit_seconds=5"
    assert store.bounded("s3://b/x") == "s3://b/x"
    monkeypatch.setattr(store, "GCS_RETRY_S", 2)
    started = time.monotonic()
    with pytest.raises(UserError, match=r"^data.path gs://b/x: .*Retry policy exhausted"):
        store.Prefix("gs://b/x?endpoint_override=127.0.0.1:9&scheme=http", "data.path").files()
    assert time.monotonic() - started < 30
