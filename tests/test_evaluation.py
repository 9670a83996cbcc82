"""Evaluation without and within training: the compiled log-likelihood scorer against the model's own
logits and across meshes, the task format and its metrics, the in-loop task hook, the eval command
and the lm-eval-harness adapter (meshtrain/engine/scoring.py, data/tasks.py, eval.py, interop/harness.py)."""
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from meshtrain.core.errors import UserError
from meshtrain.data import tasks
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.engine.decode import place
from meshtrain.engine.scoring import Scorer
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.testing import tiny_config

WINDOW = 32


_APPLY = {}


def logits_of(model, params, tokens, window):
    """model.apply's logits of one row, run right-padded to `window` (causal: the padding changes no
    earlier position), jitted once per model and window."""
    key = (id(model), window)
    if key not in _APPLY:
        _APPLY[key] = jax.jit(model.apply)
    padded = np.zeros((1, window), np.int32)
    padded[0, :len(tokens)] = tokens
    return _APPLY[key](params, padded)[0, :len(tokens)]


def direct(model, params, context, continuation, window=WINDOW):
    """The reference: log softmax of model.apply's logits over the left-truncated row, by hand."""
    whole = np.concatenate([context, continuation])[-(window + 1):]
    logits = np.asarray(logits_of(model, params, whole[:-1], window), np.float64)  # numpy: no compile per shape
    n, targets = len(continuation), whole[1:]
    top = logits.max(-1, keepdims=True)
    logprobs = (logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True)))[np.arange(len(targets)), targets]
    return float(logprobs[-n:].sum()), bool((np.argmax(logits, -1)[-n:] == targets[-n:]).all())


@pytest.fixture(scope="module")
def tiny():
    from meshtrain.models import FAMILIES

    cfg = tiny_config("model.num_layers=2")
    model = FAMILIES[cfg.model.family](cfg.model)
    params = jax.jit(model.init)(jax.random.key(0))
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 256, rng.integers(1, 40)), rng.integers(0, 256, rng.integers(1, 8)))
                for _ in range(9)]
    context = rng.integers(0, 256, 5)  # a continuation the model's argmax produces: greedy
    greedy = np.argmax(logits_of(model, params, context, WINDOW)[-1])
    requests.append((context, np.array([greedy])))
    scorer = Scorer(model, 4, WINDOW)
    return model, params, requests, scorer, scorer(params, requests)


def test_scores_are_the_logits_log_likelihoods(tiny):
    model, params, requests, _, (scores, greedy) = tiny
    expected = [direct(model, params, *r) for r in requests]
    assert np.max(np.abs(scores - [e[0] for e in expected])) < 1e-5
    assert list(greedy) == [e[1] for e in expected] and greedy[-1]


def test_scores_on_a_2x2_mesh_equal_one_device(tiny):
    model, params, requests, _, (scores, greedy) = tiny
    mesh = build_mesh(parse_mesh("data=2,tensor=2", 4), jax.devices()[:4])
    sharded, sharded_greedy = Scorer(model, 4, WINDOW, mesh=mesh)(place(model, mesh, params=params), requests)
    assert np.max(np.abs(sharded - scores)) < 1e-5
    assert (sharded_greedy == greedy).all()


def test_encode_pair_and_metrics():
    byte = ByteTokenizer()
    context, continuation = tasks.encode_pair(byte, "To be ", "or")  # the space moves, as lm-eval's
    text = lambda ids: bytes(ids.astype(np.uint8))
    assert text(context) == b"To be" and text(continuation) == b" or"
    context, continuation = tasks.encode_pair(byte, "", "be")  # empty context: the document end
    assert text(context) == b"\n" and text(continuation) == b"be"
    items = [tasks.Item("a", ("x", "yyyy"), 1), tasks.Item("b", ("xx", "y"), 0), tasks.Item("c", ("p", "q"), 0),
             tasks.Item("d", ("x", "yy"), 0)]
    # per item (acc's pick, acc_norm's pick: per character): a (x, yyyy), b (y, xx), c (a tie: p, p), d (x, yy)
    metrics = tasks.choice_metrics(items, [-2.0, -6.0, -2.0, -1.5, -1.0, -1.0, -1.0, -1.5])
    assert metrics == {"acc": 2 / 4, "acc_norm": 3 / 4}


def test_the_shipped_example_task_reads():
    from meshtrain.testing import ROOT

    items = tasks.read(ROOT / "examples" / "shakespeare_tasks.jsonl")
    assert len(items) == 12 and {item.label for item in items} == {0, 1, 2}


@pytest.mark.parametrize("line, error", [
    ("not json", r"line 2 is unreadable \(not JSON"),
    ('{"context": "a", "choices": ["x", "y"]}', "line 2: the key label is missing"),
    ('{"context": "a", "choices": ["x", 2], "label": 0}', r"line 2: choices\[1\] must be text, not 2"),
    ('{"context": "a", "choices": ["x"], "label": 0}', "at least 2 non-empty"),
    ('{"context": "a", "choices": ["x", "y"], "label": 2}', "label=2 is not an index"),
])
def test_bad_task_lines_are_one_line_errors(tmp_path, line, error):
    path = tmp_path / "t.jsonl"
    path.write_text('{"context": "a", "choices": ["x", "y"], "label": 0}\n' + line + "\n")
    with pytest.raises(UserError, match=error) as e:
        tasks.read(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("overrides, error", [
    (["eval.tasks=[{path: a.jsonl, size: 3}]"], r"eval.tasks\[0\] has unknown key 'size'"),
    (["eval.tasks=[{name: x}]"], r"eval.tasks\[0\] needs a path"),
    (["eval.tasks=[a/t.jsonl, b/t.jsonl]"], r"eval.tasks\[1\] repeats the task name 't'"),
    (["eval.tasks=[{path: t.jsonl, limit: -1}]"], r"limit=-1 must be an integer >= 0"),
    (["eval.tasks=[t.jsonl]", "train.eval_every=0"], "never scored"),
])
def test_bad_task_entries_are_config_errors(overrides, error):
    with pytest.raises(UserError, match=error):
        tiny_config(*overrides)


def test_a_missing_task_file_is_named(tmp_path):
    with pytest.raises(UserError, match="task file .*missing.jsonl not found"):
        tasks.load([{"name": "x", "path": str(tmp_path / "missing.jsonl")}], ByteTokenizer())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run on data=2,tensor=2 scoring a task at steps 2 and 4 (eval.task_every), eval_loss at 4."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    folder = tmp_path_factory.mktemp("eval")
    (folder / "text.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    items = [{"context": "To be, or not to", "choices": ["be", "go", "sing"], "label": 0},
             {"context": "that is the", "choices": ["answer", "question."], "label": 1},
             {"context": "", "choices": ["To be", "Not"], "label": 0}]
    (folder / "play.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    cfg = tiny_config("model.num_layers=2", f"data.path={folder / 'text.txt'}", "data.kind=auto",
                      "train.steps=4", "train.eval_every=4", "train.eval_batches=1",
                      f"eval.tasks=[{{path: {folder / 'play.jsonl'}}}]", "eval.task_every=2",
                      "parallel.mesh=data=2,tensor=2", out=str(folder / "run"))
    trainer = Trainer(cfg, devices=jax.devices()[:4])
    return folder, trainer.fit(log=MetricsLog(primary=False)), trainer


def test_tasks_are_logged_in_the_loop(run):
    from meshtrain.run.dashboards import tag
    from meshtrain.run.loggers import format_record

    _, history, _ = run
    records = [r for r in history if "eval_acc_play" in r]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert 0 <= r["eval_acc_play"] <= 1 and 0 <= r["eval_acc_norm_play"] <= 1
    assert format_record(records[-1]).startswith("step      4  tasks: play acc ")
    assert tag("eval_acc_norm_play") == "eval/acc_norm_play" and tag("eval_acc_play") == "eval/acc_play"


def test_the_planner_compiles_the_scorer_the_run_built(run):
    """The planner's task-scorer figure (meshtrain/planner/aot.py `scoring_memory`) is the memory of
    the scorer the run compiled: its rows, window (here the tasks' longest request reaches
    train.seq_len, the planner's window) and parameter layout."""
    from meshtrain.engine.scoring import pack
    from meshtrain.planner.aot import compiled_memory, scoring_memory

    _, _, trainer = run
    scorer = trainer.scorer
    assert scorer.length == trainer.cfg.train.seq_len
    batch = pack(trainer.tasks[0].requests, scorer.rows, scorer.length)[0]  # what the run fed its scorer
    with scorer.context():
        ran = compiled_memory(scorer.program.lower(trainer.state["params"], *map(scorer.put, batch)), False)
    planned = scoring_memory(trainer.program)
    assert (planned["rows"], planned["length"]) == (scorer.rows, scorer.length)
    assert planned["total"] == ran["total"] > ran["arguments"] > 0


def test_eval_command_reproduces_the_loop_on_another_mesh(run, capsys):
    from meshtrain.eval import main

    folder, history, _ = run
    out = folder / "results.json"
    assert main(["--run", str(folder / "run"), "--mesh", "fsdp=2,tensor=4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step 4 on mesh data=1,fsdp=2,tensor=4" in printed and "tasks: play acc" in printed
    results, last = json.loads(out.read_text()), {k: v for r in history if r["step"] == 4 for k, v in r.items()}
    assert abs(results["eval_loss"] - last["eval_loss"]) < 1e-5
    assert results["eval_acc_play"] == last["eval_acc_play"]
    assert results["eval_acc_norm_play"] == last["eval_acc_norm_play"]


@pytest.mark.parametrize("lost", ["identity", "starts", "data_files"])
def test_eval_of_a_run_whose_record_lacks_a_section_evaluates_and_names_it(run, lost, tmp_path, capsys, caplog):
    """A read-only command degrades: run.json without a section still evaluates (on the run's data as
    config.yaml names it) and says what it could not check; it never asks for a new run."""
    import shutil

    from meshtrain.eval import main

    folder, history, _ = run
    copy = tmp_path / "run"
    shutil.copytree(folder / "run", copy, ignore=shutil.ignore_patterns("run.lock"))
    record = json.loads((copy / "run.json").read_text())
    del record[lost]
    (copy / "run.json").write_text(json.dumps(record))
    assert main(["--run", str(copy), "--mesh", "fsdp=2,tensor=4", "--json", str(tmp_path / "r.json")]) == 0
    last = {k: v for r in history if r["step"] == 4 for k, v in r.items()}
    assert abs(json.loads((tmp_path / "r.json").read_text())["eval_loss"] - last["eval_loss"]) < 1e-5
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if lost == "identity":
        assert warned == [f"{copy}: run.json has no identity: the data is not checked against what the run "
                          f"trained on"]
    assert not any("--out" in w for w in warned)


def test_lm_eval_adapter_agrees_with_the_model(tiny, run):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM

    from meshtrain.eval import harness_lm
    from meshtrain.interop.harness import HarnessLM

    folder, _, _ = run
    from_run = harness_lm(run=str(folder / "run"), mesh="data=2,tensor=2", devices=jax.devices()[:4])
    assert isinstance(from_run, LM) and from_run.window == 16  # the run's train.seq_len
    model, params, _, scorer, _ = tiny
    lm = HarnessLM(model, params, ByteTokenizer(), scorer)
    ask = lambda kind, *args: Instance(kind, {}, args, 0)
    pairs = [("To be, or not to", " be"), ("that is the", " question.")]
    got = lm.loglikelihood([ask("loglikelihood", *p) for p in pairs])
    for (context, continuation), (score, greedy) in zip(pairs, got):
        ids = [np.frombuffer(t.encode(), np.uint8).astype(np.int32) for t in (context, continuation)]
        assert np.allclose((score, greedy), direct(model, params, *ids), atol=1e-5)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind"  # 74 bytes
    ids = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    whole = np.concatenate([[10], ids])  # windows of 32, 32 and 10 predicted bytes after a newline
    expected = sum(direct(model, params, whole[:s + 1], ids[s:s + WINDOW])[0] for s in (0, 32, 64))
    assert abs(lm.loglikelihood_rolling([ask("loglikelihood_rolling", text)])[0] - expected) < 1e-4
    greedy = list(ids[:10])  # greedy decoding by full forwards, the reference
    for _ in range(6):
        greedy.append(int(np.argmax(logits_of(model, params, greedy[-WINDOW:], WINDOW)[-1])))
    full = ByteTokenizer().decode(greedy[10:])
    until = lambda stop: lm.generate_until([ask("generate_until", text[:10], {"until": stop, "max_gen_toks": 6})])
    assert until([]) == [full]
    stop = full[2:4] or "x"
    assert until([stop]) == [full[:full.find(stop)] if stop in full else full]


def test_eval_of_a_run_on_synthetic_data_needs_no_tokenizer(tmp_path, capsys):
    """configs/tiny.yaml's data is synthetic: the run records no tokenizer, and its loss needs none."""
    from meshtrain.eval import main
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    out = tmp_path / "run"
    cfg = tiny_config("model.num_layers=1", "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                      "parallel.mesh=data=8", out=str(out))
    history = Trainer(cfg).fit(log=MetricsLog(primary=False))
    results = tmp_path / "results.json"
    assert main(["--run", str(out), "--json", str(results)]) == 0
    assert abs(json.loads(results.read_text())["eval_loss"] - history[-1]["eval_loss"]) < 1e-5
    capsys.readouterr()
    (tmp_path / "t.jsonl").write_text(json.dumps({"context": "a", "choices": ["b", "c"], "label": 0}) + "\n")
    assert main(["--run", str(out), "--task", str(tmp_path / "t.jsonl")]) == 2
    assert "trained on synthetic data and records no tokenizer, which --task needs" in capsys.readouterr().err


def test_eval_of_a_run_reads_its_own_data_from_any_folder_and_refuses_other_content(tmp_path, monkeypatch, capsys):
    """The bug: `eval --run` from another working folder read whatever file sat at the run's relative
    data path and scored it. run.json records where the data was (absolute, and relative to the run
    folder); eval reads it from there, and other content there is one error naming the file."""
    from meshtrain.eval import main
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    home, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    text = "To be, or not to be, that is the question.\n" * 100
    for folder, content in ((home, text), (elsewhere, "Something else entirely. " * 200)):  # a decoy
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "text.txt").write_text(content)
    monkeypatch.chdir(home)
    cfg = tiny_config("model.num_layers=1", "data.path=data/text.txt", "data.kind=auto", "train.steps=2",
                      "train.eval_every=2", "train.eval_batches=1", "parallel.mesh=data=8", out="runs/x")
    loss = Trainer(cfg).fit(log=MetricsLog(primary=False))[-1]["eval_loss"]
    files = json.loads((home / "runs/x/run.json").read_text())["data_files"]
    assert [(f["path"], f["from_run"]) for f in files] == [(str(home / "data/text.txt"), "../../data/text.txt")]

    monkeypatch.chdir(elsewhere)
    evaluated = lambda run: main(["--run", str(run), "--json", "r.json"]) or json.loads(Path("r.json").read_text())
    assert abs(evaluated(home / "runs/x")["eval_loss"] - loss) < 1e-5
    (home / "data/text.txt").write_text(text.replace("question", "Question"))
    capsys.readouterr()
    assert main(["--run", str(home / "runs/x")]) == 2
    shown = f"{files[0]['data'][:-52]}..."  # each sha256 in a message: its first 12 digits
    assert re.fullmatch(rf"error: {re.escape(str(home / 'data/text.txt'))} holds other data than the run in "
                        rf"{re.escape(str(home / 'runs/x'))} trained on \(fingerprint \d+:uint16:sha256:[0-9a-f]{{12}}"
                        rf"\.\.\., the run's {re.escape(shown)}\); restore the data it trained on, or pass --data PATH "
                        rf"to evaluate on other data\n", capsys.readouterr().err)
    (home / "data/text.txt").write_text(text)  # restored; then the project moved, run and data together
    home.rename(tmp_path / "moved")
    assert abs(evaluated(tmp_path / "moved/runs/x")["eval_loss"] - loss) < 1e-5  # found beside the run
    (tmp_path / "moved/data/text.txt").unlink()
    assert main(["--run", str(tmp_path / "moved/runs/x")]) == 2
    assert capsys.readouterr().err == (
        f"error: the data the run in {tmp_path / 'moved/runs/x'} trained on is not at {home / 'data/text.txt'} "
        f"(where it trained) nor at {tmp_path / 'moved/runs/x/../../data/text.txt'} (relative to the run); put it "
        f"back, or pass --data PATH to evaluate on other data\n")
