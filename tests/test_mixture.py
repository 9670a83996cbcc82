"""Mixtures (data.sources): rows follow the weights, depend only on (seed, split, step) whatever the
mesh or the process, resume exactly, log each source's share and eval loss, refuse bad entries in
one line, and define the run's data (a weight change is a data change)."""
import json
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.config.loader import DataConfig, UserError, load_config
from meshtrain.data import Batches, mixture, prepare
from meshtrain.data.tokenizer import HFTokenizer, train_bpe
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.run import run_dir
from meshtrain.run.dashboards import tag
from meshtrain.run.loggers import MetricsLog, format_record
from meshtrain.run.trainer import Trainer
from meshtrain.testing import tiny_config

BASES = (0, 100, 200)  # source s holds ids BASES[s] .. BASES[s] + 49: a row's ids tell its source


def token_files(folder, lengths=(5000, 3000, 4000)) -> list[str]:
    paths = []
    for base, n, name in zip(BASES, lengths, ("web", "code", "books")):
        path = folder / name / "train.bin"  # the same file name in each folder: names from the folders
        path.parent.mkdir()
        (base + np.arange(n) % 50).astype(np.uint16).tofile(path)
        paths.append(str(path))
    return paths


def sources_set(paths, weights) -> str:
    return "data.sources=[" + ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(paths, weights)) + "]"


def mixed(paths, weights, sharding, batch_size=16, seq_len=5, seed=0, split=0):
    cfg = load_config(None, [sources_set(paths, weights)])
    mix = mixture.load(cfg.data, 256)
    parts = [t for t in mix.tokens]
    return mixture.MixedBatches(parts, mix.sources, batch_size, seq_len, seed, split, sharding, 256)


def one_device():
    return NamedSharding(build_mesh(parse_mesh("1", 1), jax.devices()[:1]), P())


def source_of_rows(rows):
    return np.searchsorted(np.array(BASES), rows[:, 0], side="right") - 1


@pytest.mark.fast
def test_rows_follow_the_weights_and_the_logged_shares(tmp_path):
    paths, weights = token_files(tmp_path), [5, 3, 2]
    b = mixed(paths, weights, one_device())
    assert [s.name for s in b.sources] == ["web", "code", "books"]
    steps = 200
    counts = np.zeros(3)
    for k in range(steps):
        rows = np.asarray(b(k))
        src = source_of_rows(rows)
        np.testing.assert_array_equal(np.diff(rows, axis=1) % 50, 1)  # contiguous windows of one source
        assert (rows // 100 == np.array(BASES)[src][:, None] // 100).all()
        shares = b.shares(k)
        assert shares == {f"share_{n}": np.mean(src == s) for s, n in enumerate(["web", "code", "books"])}
        counts += np.bincount(src, minlength=3)
    np.testing.assert_allclose(counts / counts.sum(), np.array(weights) / sum(weights), atol=0.02)
    # Grain's interleaving keeps every batch's share within a few rows: here 16 x share +- 1.
    assert all(abs(v * 16 - 16 * w / 10) <= 1 for k in range(20) for v, w in zip(b.shares(k).values(), weights))


@pytest.mark.fast
def test_interleaving_holds_shares_in_every_window_of_rows():
    """What mixture.py's docstring claims of Grain's mix: any run of consecutive positions holds each
    source's share to within 2.3 rows (2 to 5 random weights)."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(10):
        weights = list(rng.uniform(0.05, 5, rng.integers(2, 6)))
        order = mixture.interleaving(weights)
        src = np.array([order[g] for g in range(1500)])
        for n in (7, 32, 100):
            for start in range(0, 1500 - n, 17):
                counts = np.bincount(src[start:start + n], minlength=len(weights))
                worst = max(worst, np.abs(counts - n * np.array(weights) / sum(weights)).max())
    assert worst <= 2.3


@pytest.mark.fast
def test_rows_depend_only_on_seed_and_step_not_on_mesh_or_process(tmp_path):
    paths, weights = token_files(tmp_path), [5, 3, 2]
    eight = NamedSharding(build_mesh(parse_mesh("data=4,fsdp=2", 8)), P(("data", "fsdp")))
    one, spread = mixed(paths, weights, one_device()), mixed(paths, weights, eight)
    for k in (0, 7, 123):
        a, b = np.asarray(one(k)), np.asarray(spread(k))
        np.testing.assert_array_equal(a, b)
        assert spread(k).sharding == eight
    # A process holding rows 4-7 only (its devices' rows) builds just those, equal to the whole batch's.
    part = mixed(paths, weights, eight)
    part.rows = np.arange(4, 8)
    np.testing.assert_array_equal(part.local_rows(7), np.asarray(one(7))[4:8])
    assert not np.array_equal(np.asarray(one(8)), np.asarray(one(7)))
    assert not np.array_equal(np.asarray(mixed(paths, weights, one_device(), seed=1)(7)), np.asarray(one(7)))
    assert not np.array_equal(np.asarray(mixed(paths, weights, one_device(), split=1)(7)), np.asarray(one(7)))


@pytest.mark.fast
def test_one_source_mixture_is_the_single_source(tmp_path):
    path = token_files(tmp_path)[0]
    single, listed = DataConfig(path=path), load_config(None, [f"data.sources=[{{path: {path}}}]"]).data
    sharding = one_device()
    (a, a_val), (b, b_val) = [mixture.batches(mixture.load(d, 256), 0.05, 8, 5, 0, sharding, 256)
                              for d in (single, listed)]
    assert type(a) is type(b) is Batches
    for k in (0, 5):
        np.testing.assert_array_equal(np.asarray(a(k)), np.asarray(b(k)))
        np.testing.assert_array_equal(np.asarray(next(iter(a_val.values()))(k)),
                                      np.asarray(next(iter(b_val.values()))(k)))
    tokens = mixture.load(single, 256).tokens[0]
    assert run_dir.mixture_fingerprint(mixture.load(listed, 256)) == run_dir.data_fingerprint(tokens)


@pytest.mark.fast
def test_names_are_derived_from_paths_and_unique():
    assert mixture.names(["a/web.bin", "b/code.jsonl"]) == ["web", "code"]
    assert mixture.names(["x/web/train.bin", "x/code/train.bin"]) == ["web", "code"]
    assert mixture.names(["a/web/train.bin", "b/web/train.bin", "c/train.bin"]) == ["a", "b", "c"]
    assert mixture.names(["d/c.jsonl", "d/c.parquet"]) == ["d_c_jsonl", "d_c_parquet"]
    assert mixture.names(["", "data/my corpus.txt"]) == ["stdlib", "my_corpus"]


# ---- training: resume equals a straight run; shares and per-source eval in metrics.jsonl ----
def mixture_run(out, paths, *overrides):
    return Trainer(tiny_config("data.kind=auto", sources_set(paths[:2], [3, 1]), "train.steps=4", "parallel.mesh=1",
                               "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2", *overrides,
                               out=str(out)), devices=jax.devices()[:1])


def test_resume_equals_a_straight_run_and_shares_and_eval_are_logged(tmp_path):
    paths = token_files(tmp_path)
    straight = mixture_run(tmp_path / "straight", paths)
    history = straight.fit(log=MetricsLog(tmp_path / "straight", primary=True))
    resumed = mixture_run(tmp_path / "resumed", paths,
                          f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / '2'}")
    assert int(resumed.state["step"]) == 2
    losses = lambda h: {r["step"]: r["loss"] for r in h if "loss" in r}
    assert losses(resumed.fit(log=MetricsLog(primary=False))) == {s: v for s, v in losses(history).items() if s > 2}

    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert len(train) == 4 and all(r["share_web"] == 0.75 and r["share_code"] == 0.25 for r in train)  # 12 + 4 of 16
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["eval_loss"] == pytest.approx(0.75 * r["eval_loss_web"] + 0.25 * r["eval_loss_code"], rel=1e-12)
    assert straight.evaluate() == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    assert re.fullmatch(r"step +4  eval_loss \d\.\d{4} \(web \d\.\d{4}, code \d\.\d{4}\)", format_record(evals[-1]))
    assert (tag("share_web"), tag("eval_loss_web"), tag("memory_bytes_in_use")) == \
        ("data/share_web", "eval/loss_web", "memory/bytes_in_use")
    # The run folder's config.yaml (the sources as YAML) loads again as the same config.
    assert run_dir.run_config(tmp_path / "straight").data.sources == straight.cfg.data.sources


# ---- the run's identity ----
@pytest.mark.fast
def test_a_weight_or_order_change_is_a_data_change(tmp_path):
    paths = token_files(tmp_path)
    out = tmp_path / "run"
    out.mkdir()

    def start(weights, order=(0, 1), allow_change=False):
        cfg = tiny_config("data.kind=auto", sources_set([paths[i] for i in order], weights), out=str(out))
        return run_dir.continued(out, cfg, run_dir.mixture_fingerprint(mixture.load(cfg.data, 256)), allow_change)

    mine, _ = start([3, 1])
    run_dir.record_start(out, mine, tiny_config("data.kind=auto", sources_set(paths[:2], [3, 1]), out=str(out)), 0, [])
    assert start([3, 1])[1] == [] and start([0.75, 0.25])[1] == []  # the same shares
    for weights, order in (([1, 1], (0, 1)), ([1, 3], (1, 0)), ([3, 1], (0, 2))):
        with pytest.raises(UserError, match=rf"^the run in {out} trained on other data \(fingerprint mixture 0.75 x "
                                            rf".* from data.sources .*web/train.bin \(share 0.75\), .*; use a new "
                                            rf"--out for a new run, or pass --allow-change"):
            start(weights, order)
    assert start([1, 1], allow_change=True)[1]  # allowed: a new phase, recorded by record_start


@pytest.mark.fast
def test_a_runs_sources_are_found_from_any_folder_and_the_changed_one_is_named(tmp_path, monkeypatch):
    """run.json's data_files: each source's absolute path, else its path relative to the run folder;
    a source whose content changed is named (meshtrain/run/run_dir.py `resolve_data`, `check_run_data`)."""
    import yaml

    from meshtrain.config.loader import to_dict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = tmp_path / "project"
    project.mkdir()
    token_files(project)
    monkeypatch.chdir(project)
    cfg = tiny_config("data.kind=auto", sources_set(["web/train.bin", "code/train.bin"], [3, 1]), out="runs/x")
    mix = mixture.load(cfg.data, 256)
    (project / "runs/x").mkdir(parents=True)
    (project / "runs/x/config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    run_dir.record_start(project / "runs/x", run_dir.identity(cfg, run_dir.mixture_fingerprint(mix)), cfg, 0, [],
                         run_dir.data_files(project / "runs/x", mix))
    monkeypatch.chdir(tmp_path)
    found = lambda run: [s["path"] for s in run_dir.run_config(run).data.sources]
    assert found(project / "runs/x") == [str(project / "web/train.bin"), str(project / "code/train.bin")]
    project.rename(tmp_path / "moved")  # run and data together: found relative to the run
    run = tmp_path / "moved/runs/x"
    assert found(run) == [str(tmp_path / "moved/web/train.bin"), str(tmp_path / "moved/code/train.bin")]
    run_dir.check_run_data(run, mixture.load(run_dir.run_config(run).data, 256))
    (np.arange(3000) % 50 + 100).astype(np.uint16)[::-1].tofile(tmp_path / "moved/code/train.bin")
    with pytest.raises(UserError, match=f"^{tmp_path / 'moved/code/train.bin'} holds other data than the run in "
                                        f"{run} trained on \\(fingerprint mixture 0.75 x 5000:uint16:sha256:"):
        run_dir.check_run_data(run, mixture.load(run_dir.run_config(run).data, 256))


# ---- mistakes: one line each, naming the entry and the fix ----
BAD = [
    ("data.sources=[{weight: 1}]", r"data.sources\[0\] has no path; give each source one"),
    ("data.sources=[{path: a.bin, weight: 1}, {path: b.bin, weight: 0}]",
     r"data.sources\[1\].weight=0 must be a finite"),
    ("data.sources=[{path: a.bin, weight: -2}]", r"data.sources\[0\].weight=-2 must be a finite number > 0"),
    ("data.sources=[{path: a.bin, weight: .inf}]", r"data.sources\[0\].weight=inf must be a finite"),
    ("data.sources=[{path: a.bin, weight: .nan}]", r"data.sources\[0\].weight=nan must be a finite"),
    ("data.sources=[{path: a.bin, weight: true}]", r"data.sources\[0\].weight=True must be a finite"),
    ("data.sources=[{path: a.bin, weight: 1" + "0" * 400 + "}]", r"data.sources\[0\].weight=10+ must be a finite"),
    ("data.sources=[{path: a.bin, wieght: 1}]",
     r"data.sources\[0\] has unknown key 'wieght'; its keys are path, weight"),
    ("data.sources=[a.bin]", r"data.sources\[0\]='a.bin' is not a mapping; write each source as \{path: ..., weight"),
    ("data.sources={path: a.bin}", r"data.sources must be a list \(YAML \[a, b, ...\]\)"),
    ("data.sources=", r"data.sources must be a list"),
    ("data.sources=[{path: a.bin}, {path: ./a.bin}]", r"data.sources\[1\] repeats data.sources\[0\]'s path"),
    ("data.sources=[{path: a.bin, weight: 1e-7}, {path: b.bin}]", r"weights range from 1e-07 to 1; keep the largest"),
    ("data.sources=[{path: a.bin, kind: synthetic}]", r"data.sources\[0\].kind='synthetic' is not one of auto"),
    ("data.sources=[{path: a.bin, kind: csv}]", r"data.sources\[0\].kind='csv' is not one of"),
    ("data.sources=[{path: [a.bin]}]", r"data.sources\[0\].path=\['a.bin'\] is not text"),
]


@pytest.mark.fast
@pytest.mark.parametrize("item,error", BAD, ids=[b[0] for b in BAD])
def test_bad_entries_are_one_line_errors(item, error):
    with pytest.raises(UserError, match=error) as e:
        load_config(None, [item])
    assert "\n" not in str(e.value)


@pytest.mark.fast
def test_sources_exclude_a_path_and_synthetic_data(tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text("data:\n  path: x.bin\n  sources:\n    - {path: a.bin, weight: 2}\n")
    with pytest.raises(UserError, match=r"^data.path='x.bin' and data.sources are both set; put the path into "):
        load_config(str(config))
    with pytest.raises(UserError, match=r"^data.kind=synthetic has no tokens to mix"):
        load_config(None, ["data.kind=synthetic", "data.sources=[{path: a.bin}]"])
    config.write_text("data:\n  kind: jsonl\n  text_field: body\n  sources:\n    - {path: a.jsonl, weight: 2}\n"
                      "    - {path: b, weight: 1, kind: parquet, text_field: content}\n")
    found = mixture.sources(load_config(str(config)).data)  # entries inherit data.kind and data.text_field
    assert [(s.kind, s.text_field, s.share) for s in found] == [("jsonl", "body", 2 / 3), ("parquet", "content", 1 / 3)]


@pytest.mark.fast
def test_sources_must_share_one_tokenizer_and_hold_validation(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    train_bpe([str(text)], 300, tmp_path / "tokenizer.json")
    prepare(str(text), HFTokenizer(tmp_path / "tokenizer.json"), tmp_path / "bpe")
    cfg = load_config(None, [f"data.sources=[{{path: {text}}}, {{path: {tmp_path / 'bpe'}}}]", "model.vocab_size=300"])
    with pytest.raises(UserError, match=r"^data.sources\[1\] \(.*bpe\) was tokenized by .*tokenizer.json \(\d+ ids\), "
                                        r"data.sources\[0\] \(.*a.txt\) by byte \(256 ids\); "
                                        r"a model reads one vocabulary"):
        mixture.load(cfg.data, 300)
    short = tmp_path / "short.bin"
    np.arange(40, dtype=np.uint16).tofile(short)
    cfg = load_config(None, [f"data.sources=[{{path: {text}}}, {{path: {short}}}]"])
    with pytest.raises(UserError, match=r"^data.sources\[1\] \(.*short.bin\): the data holds 40 tokens, leaving 2 for "
                                        r"validation"):
        mixture.batches(mixture.load(cfg.data, 256), 0.05, 8, 5, 0, one_device(), 256)
