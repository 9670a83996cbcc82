"""`prepare --ray` (meshtrain/data/cluster.py) on a local Ray cluster of two nodes (two raylets of one
CPU each, started and stopped here, shared by every test): the shards, manifest and content hash of
text, jsonl (BPE and bytes), a Spark Parquet folder, chat data and preference pairs (their loss masks
and pairs) equal the one-host prepare's byte for byte; a
bad file is one `error:` line naming it, and the rerun after fixing it, or after a Ctrl-C, tokenizes
only the units not done yet; training runs on the result. To an s3:// --out (a moto server), a rerun
after a Ctrl-C reuses the results kept beside the staging folder and uploads the one-host bytes."""
import json
import logging
import os

import jax
import pytest
from test_dpo import write_pairs
from test_prepare import BYTE, DOCS, write_jsonl, write_spark_parquet
from test_prepare_store import s3, uploaded  # noqa: F401 (s3: the moto server fixture)
from test_sft import write_chat

from meshtrain.core.errors import UserError
from meshtrain.data import chat, cluster, prepare, sources, tokenizer
from meshtrain.data.__main__ import main
from meshtrain.data.prepare import tokenize
from meshtrain.run.trainer import Trainer
from meshtrain.testing import tiny_config

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

# ray starts its processes (fork + exec) from this process, where JAX's threads already run.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
UNIT_BYTES = 700  # jsonl ranges end mid-line: several units per file


@pytest.mark.parametrize("address", ["not an address", ":80"])
def test_an_address_ray_cannot_parse_is_one_line(address, tmp_path, capsys, monkeypatch):
    """--ray ADDRESS that Ray's own parser refuses (ray.init parses before it connects, with
    canonicalize_bootstrap_address): one line naming the flag and the forms, not a traceback."""
    from ray._private.services import canonicalize_bootstrap_address

    from meshtrain.data.__main__ import main

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever another test left: a new connection
    monkeypatch.setattr(ray, "init", lambda address, **_: canonicalize_bootstrap_address(address))
    assert main(["prepare", str(write_jsonl(tmp_path / "d.jsonl")), "--out", str(tmp_path / "out"),
                 "--ray", address]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --ray {address!r} is not a Ray address (") and err[-1].endswith(
        "pass auto, local, HOST:PORT or ray://HOST:PORT")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def two_nodes():
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, logging_level=logging.WARNING)
    yield
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def prepared(two_nodes, tmp_path_factory):
    """{source: (one-host folder, Ray folder)} for text, jsonl (bytes, BPE), Parquet, chat data
    (conversations rendered with chatml, their loss mask) and preference pairs (masks and pairs.npy)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "UNIT_BYTES", UNIT_BYTES)
        root = tmp_path_factory.mktemp("sources")
        (root / "texts").mkdir()
        for i, d in enumerate(DOCS[:6]):
            (root / "texts" / f"{i}.txt").write_text(d)
        bpe = tokenizer.train_bpe(DOCS, 300, root / "bpe" / "tokenizer.json")
        cases = {"text": (root / "texts", BYTE, "text"), "jsonl": (write_jsonl(root / "docs.jsonl"), BYTE, "text"),
                 "jsonl-bpe": (root / "docs.jsonl", bpe, "text"),
                 "parquet": (write_spark_parquet(root / "spark"), BYTE, "body"),
                 "chat": (write_chat(root / "chat.jsonl", 40), BYTE, "messages",
                          {"chat": chat.load_format("chatml", BYTE)}),
                 "preference": (write_pairs(root / "pairs.jsonl", 60), BYTE, "text", {"preference": True})}
        out = {}
        for name, (src, tok, field, *how) in cases.items():
            how = how[0] if how else {}
            assert len(sources.units(sources.detect(str(src)), str(src))) > 3, name
            one, on_ray = root / f"{name}-one", root / f"{name}-ray"
            prepare(str(src), tok, one, workers=1, text_field=field, shard_tokens=500, **how)
            cluster.prepare_on_ray(str(src), tok, on_ray, text_field=field, shard_tokens=500, **how)
            out[name] = one, on_ray
        return out


def files(folder) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("source", ["text", "jsonl", "jsonl-bpe", "parquet", "chat", "preference"])
def test_ray_prepare_writes_the_one_host_bytes(prepared, source):
    one, on_ray = prepared[source]
    manifest = json.loads((on_ray / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1 or source == "text"
    assert ("mask_sha256" in manifest) == (source in ("chat", "preference"))
    assert ("pairs" in manifest) == (source == "preference")
    assert files(one) == files(on_ray)  # shards, sidecars, tokenizer and manifest (its content hash)
    assert not cluster.work_folder(on_ray).exists()


def test_a_bad_file_is_one_error_and_the_rerun_redoes_only_unfinished_units(two_nodes, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setattr(sources, "UNIT_BYTES", UNIT_BYTES)
    src, out = tmp_path / "docs", tmp_path / "out"
    src.mkdir()
    for i in range(3):
        write_jsonl(src / f"{i}.jsonl", DOCS[i * 10:(i + 1) * 10])
    good = (src / "2.jsonl").read_text()
    (src / "2.jsonl").write_text(good + '{"text": "cut off\n')
    parts = sources.units("jsonl", str(src))
    before = sum(u.file != str(src / "2.jsonl") for u in parts)
    argv = ["prepare", str(src), "--tokenizer", "byte", "--ray", "auto", "--shard-tokens", "500", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src / '2.jsonl'}, line at byte {len(good)}: not JSON") and err.count("\n") == 1
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))  # no half-written DIR
    kept = sorted(cluster.work_folder(out).iterdir())
    assert len(kept) >= before and not [f for f in kept if ".tmp-" in f.name]  # results of whole units only

    (src / "2.jsonl").write_text(good)  # fixed: its units are redone, the other files' are not
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert f"resuming {out}: {before} of {len(parts)} units were tokenized by an earlier run" in said
    tokens = sum(len(d.encode()) + 1 for d in DOCS[:30])
    assert said.splitlines()[-1].startswith(f"{out}: {tokens:,} tokens (uint16) from 30 documents in 5 shard(s)")
    prepare(str(src), BYTE, tmp_path / "one", workers=1, shard_tokens=500)
    assert files(tmp_path / "one") == files(out)
    assert not cluster.work_folder(out).exists()

    (tmp_path / "cols").mkdir()
    write_spark_parquet(tmp_path / "cols" / "spark")  # no column 'text': a task's UserError, unwrapped
    assert main(["prepare", str(tmp_path / "cols" / "spark"), "--ray", "auto", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "x.snappy.parquet has no column 'text' (has: id, body)" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cols", "docs", "one", "out"]  # no work folder left
    assert main([*argv[:-2], "--workers", "2", "--out", str(tmp_path / "w")]) == 2
    assert "--workers is for one machine" in capsys.readouterr().err
    with pytest.raises(UserError, match=f"{tmp_path / 'gone.txt'} cannot be read \\(No such file"):
        tokenize(sources.Unit("text", str(tmp_path / "gone.txt")), BYTE, "text")  # a file gone since it was listed


def test_a_killed_prepare_resumes_without_redoing_finished_units(two_nodes, tmp_path, monkeypatch):
    """Ctrl-C in the driver after 3 units (its `_load` of the 4th raises): no --out, the finished
    results kept; the rerun loads those very files (same inode, never rewritten) and ends with the
    one-host bytes."""
    monkeypatch.setattr(sources, "UNIT_BYTES", UNIT_BYTES)
    src, out = write_jsonl(tmp_path / "docs.jsonl"), tmp_path / "out"
    load, loaded = cluster._load, []

    def interrupted(path):
        if len(loaded) == 3:
            raise KeyboardInterrupt
        loaded.append(path)
        return load(path)
    monkeypatch.setattr(cluster, "_load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cluster.prepare_on_ray(str(src), BYTE, out, shard_tokens=500)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    # results only: a task still out may be in writing_file, whose probe folder comes and goes
    kept = {f.name: f.stat().st_ino for f in cluster.work_folder(out).glob("unit-*.npz")}
    assert len(kept) >= 3 and {f.name for f in loaded} <= kept.keys()

    seen = {}

    def watched(path):  # the inode of each result as the rerun loads it: a redone unit's is new (os.replace)
        seen[path.name] = path.stat().st_ino
        return load(path)
    monkeypatch.setattr(cluster, "_load", watched)
    cluster.prepare_on_ray(str(src), BYTE, out, shard_tokens=500)
    assert len(seen) == len(sources.units("jsonl", str(src))) and {n: seen[n] for n in kept} == kept
    prepare(str(src), BYTE, tmp_path / "one", workers=1, shard_tokens=500)
    assert files(tmp_path / "one") == files(out)


def test_ray_prepare_to_s3_resumes_from_its_staging_folder_and_uploads_the_one_host_bytes(
        two_nodes, s3, tmp_path, monkeypatch):  # noqa: F811 (s3: the fixture imported above)
    """--out s3://...: the units' results wait beside the staging folder (under --stage), so a rerun after
    a Ctrl-C tokenizes only the rest; the store ends with the one-host prepare's files."""
    uri, fs = s3
    monkeypatch.setattr(sources, "UNIT_BYTES", UNIT_BYTES)
    src, stage = write_jsonl(tmp_path / "docs.jsonl"), tmp_path / "stage"
    load, loaded = cluster._load, []

    def interrupted(path):
        if len(loaded) == 3:
            raise KeyboardInterrupt
        loaded.append(path.name)
        return load(path)
    monkeypatch.setattr(cluster, "_load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cluster.prepare_on_ray(str(src), BYTE, uri("ray"), shard_tokens=500, stage=stage)
    assert not uploaded(fs, "ray")
    (work,) = stage.glob("*/.prepared.units")
    kept = {f.name: f.stat().st_ino for f in work.glob("unit-*.npz")}  # results only (a task's probe comes and goes)
    assert len(kept) >= 3 and set(loaded) <= kept.keys()

    seen = {}

    def watched(path):  # a redone unit's result is a new file (os.replace): a new inode
        seen[path.name] = path.stat().st_ino
        return load(path)
    monkeypatch.setattr(cluster, "_load", watched)
    cluster.prepare_on_ray(str(src), BYTE, uri("ray"), shard_tokens=500, stage=stage)
    assert {n: seen[n] for n in kept} == kept
    prepare(str(src), BYTE, tmp_path / "one", workers=1, shard_tokens=500)
    assert uploaded(fs, "ray") == files(tmp_path / "one")
    assert not work.exists()


def test_training_runs_on_a_ray_prepared_folder(prepared):
    folder = prepared["jsonl"][1]
    trainer = Trainer(tiny_config("data.kind=auto", f"data.path={folder}", "train.steps=2", "parallel.mesh=1"),
                      devices=jax.devices()[:1])
    history = trainer.fit()
    assert [r["step"] for r in history if "loss" in r] == [1, 2]
    sha256 = json.loads((folder / "manifest.json").read_text())["sha256"]
    assert sha256 in (trainer.out / "run.json").read_text()  # its data identity: the manifest's content hash


def test_a_second_prepare_of_the_same_out_is_refused_while_the_first_runs(tmp_path):
    """The work folder is locked by its driver: another driver for the same --out stops with one line."""
    out = tmp_path / "data"
    work = cluster.work_folder(out)
    first = cluster._claim(work, set(), out)
    try:
        with pytest.raises(UserError, match="another prepare is writing"):
            cluster._claim(work, set(), out)
    finally:
        os.close(first)
