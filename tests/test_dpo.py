"""DPO (issue 43, section 3): preference pairs prepared with a mask on the responses, the loss and
its gradients against the direct formula, the same steps on every layout, and a tiny model that
learns to prefer the chosen answer on prompts it never saw."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_tiny, tiny_config

from meshtrain.core.errors import UserError
from meshtrain.data import chat, preference, tokenizer
from meshtrain.data.__main__ import main
from meshtrain.data.prepare import prepare
from meshtrain.data.tokens import read_prepared, token_ids
from meshtrain.engine.program import TrainProgram
from meshtrain.objectives.dpo import dpo_loss
from meshtrain.ops.trainable import select
from meshtrain.run.loggers import format_record

LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
CHOSEN, REJECTED = "yes", "no"


def write_pairs(path, n: int, seed: int = 0):
    """Prompts of random letters; the chosen answer is always CHOSEN, the rejected one REJECTED."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(LETTERS, rng.integers(4, 12))) + "? "
            f.write(json.dumps({"prompt": prompt, "chosen": CHOSEN, "rejected": REJECTED}) + "\n")
    return path


@pytest.fixture(scope="module")
def pairs_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs")
    assert main(["prepare", str(write_pairs(tmp / "pairs.jsonl", 200)), "--preference", "--out",
                 str(tmp / "prepared"), "--workers", "1"]) == 0
    return tmp / "prepared"


def texts(folder):
    """Each pair's (chosen, rejected) as (whole text, masked-in text)."""
    tokens, _ = read_prepared(folder)
    decode = lambda ids: bytes(np.asarray(ids, np.uint8)).decode()
    out = []
    for c, r, end in preference.read_pairs(folder):
        rows = [tokens.windows(np.array([lo]), hi - lo)[0] for lo, hi in ((c, r), (r, end))]
        out.append([(decode(token_ids(row)), decode(row[row >= 0])) for row in rows])
    return out


@pytest.mark.fast
def test_prepare_stores_each_pair_with_its_responses_masked_in(pairs_folder, tmp_path):
    _, manifest = read_prepared(pairs_folder)
    assert manifest["pairs"] == 200 and manifest["documents"] == 400
    assert manifest["trained_tokens"] == 200 * (len(CHOSEN) + len(REJECTED))
    for (chosen, chosen_in), (rejected, rejected_in) in texts(pairs_folder):
        assert (chosen_in, rejected_in) == (CHOSEN, REJECTED)  # the response only; its end (a newline) not
        assert chosen == chosen[:-len(CHOSEN) - 1] + CHOSEN + "\n" and rejected.endswith(REJECTED + "\n")
        assert chosen[:-len(CHOSEN) - 1] == rejected[:-len(REJECTED) - 1]  # one prompt
    # messages, rendered with a chat template: a string prompt is a user turn, a string answer an assistant one
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "chosen": "4", "rejected": [{"role": "assistant", "content": "5"}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["prepare", str(tmp_path / "chat.jsonl"), "--preference", "--chat-template", "chatml", "--out",
                 str(tmp_path / "chat"), "--workers", "1"]) == 0
    (chosen, chosen_in), (rejected, rejected_in) = texts(tmp_path / "chat")[0]
    assert (chosen_in, rejected_in) == ("4<|im_end|>\n", "5<|im_end|>\n")
    fmt = chat.load_format("chatml", tokenizer.ByteTokenizer())
    assert chosen == fmt.render(rows[0]["prompt"] + [{"role": "assistant", "content": "4"}]) + "\n"


def test_parquet_and_datasets_rows_prepare_as_jsonl_does(tmp_path, capsys):
    """The same pairs as Parquet rows (a message list in one column) and as a datasets save_to_disk
    folder give jsonl's tokens, masks and pairs; a table without a column is one error naming it."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in write_pairs(tmp_path / "pairs.jsonl", 30).read_text().splitlines()]
    rows = [{**r, "chosen": [{"role": "assistant", "content": r["chosen"]}]} for r in rows]  # messages, and text
    (tmp_path / "msgs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.Table.from_pylist(rows)
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "part-0.parquet", row_group_size=8)
    datasets.Dataset(table).save_to_disk(str(tmp_path / "hf"))
    made = {}
    for name in ("msgs.jsonl", "pq", "hf"):
        assert main(["prepare", str(tmp_path / name), "--preference", "--chat-template", "chatml", "--out",
                     str(tmp_path / f"out-{name}"), "--workers", "1"]) == 0
        made[name] = {f.name: f.read_bytes() for f in (tmp_path / f"out-{name}").iterdir() if f.name != "manifest.json"}
    assert made["pq"] == made["msgs.jsonl"] == made["hf"] and "pairs.npy" in made["pq"]
    pq.write_table(table.drop_columns(["rejected"]), tmp_path / "pq" / "part-0.parquet")
    assert main(["prepare", str(tmp_path / "pq"), "--preference", "--chat-template", "chatml", "--out",
                 str(tmp_path / "bad"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "part-0.parquet has no column 'rejected' (has: prompt, chosen); a row needs the columns prompt, " \
           "chosen, rejected" in err and err.count("error:") == 1 and not (tmp_path / "bad").exists()


@pytest.mark.fast
def test_bad_preference_rows_are_one_error_naming_the_line_and_write_nothing(tmp_path, capsys):
    good = json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
    for row, message in ((json.dumps({"prompt": "a", "chosen": "b"}), "needs the fields prompt, chosen and"),
                         (json.dumps({"prompt": "a", "chosen": "b", "rejected": 3}), "'rejected' is not a convers"),
                         (json.dumps({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}),
                          "the row holds messages: pass --chat-template")):
        (tmp_path / "bad.jsonl").write_text(good + row + "\n")
        assert main(["prepare", str(tmp_path / "bad.jsonl"), "--preference", "--out", str(tmp_path / "out"),
                     "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'bad.jsonl'}, line at byte {len(good)}: ") and message in err
        assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="is a text file; preference data is rows of prompt, chosen and rejected"):
        (tmp_path / "t.txt").write_text("text")
        prepare(str(tmp_path / "t.txt"), tokenizer.ByteTokenizer(), tmp_path / "out", preference=True)
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "--preference", "--chat", "--out", str(tmp_path / "o")]) == 2


def direct_log_probs(model, params, pairs):
    """[B, 2] summed response log-probs from the model's full logits (`apply`), the definition."""
    rows = pairs.reshape(2 * pairs.shape[0], -1)
    ids = token_ids(rows)
    logp = jax.nn.log_softmax(model.apply(params, ids[:, :-1]), -1)
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    return jnp.sum(jnp.where(rows[:, 1:] >= 0, picked, 0.0), -1).reshape(-1, 2)


def test_the_loss_and_its_gradients_are_the_direct_formulas(pairs_folder):
    import torch

    beta, smoothing = 0.5, 0.1
    cfg = tiny_config("parallel.mesh=1", "parallel.precision=fp32", "train.objective=dpo",
                      f"data.path={pairs_folder}", "data.kind=auto", "train.batch_size=4", f"train.dpo.beta={beta}",
                      f"train.dpo.label_smoothing={smoothing}")
    program = TrainProgram(cfg.model, cfg.parallel, cfg.optim, cfg.train, devices=jax.devices()[:1])
    model, params = program.model, program.model.init(jax.random.key(0))
    noise = jax.tree.map(lambda p: 0.3 * jax.random.normal(jax.random.key(1), p.shape), params)
    reference = jax.tree.map(jnp.add, params, noise)  # a reference other than the policy: margins not 0
    tokens, _ = read_prepared(pairs_folder)
    pairs = preference.PairBatches(tokens, preference.read_pairs(pairs_folder), 4, 16, 0, 0,
                                   program.batch_sharding, 256).local_rows(0)
    assert (pairs[:, 17:] != ~0).any(axis=1).all()  # each row holds a rejected sequence in its second half
    with program.context():
        ref_Bx2 = jax.jit(program.objective.scores)(reference, {"tokens": pairs})
        direct_Bx2 = jax.jit(lambda p: direct_log_probs(model, p, pairs))
        np.testing.assert_allclose(ref_Bx2, direct_Bx2(reference), rtol=1e-5)
        loss_fn = lambda p: program.objective.loss(p, {"tokens": pairs, "reference": ref_Bx2}, {})
        (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
        direct = lambda p: dpo_loss(direct_log_probs(model, p, pairs), ref_Bx2, beta, smoothing)[0]
        direct_grads = jax.jit(jax.grad(direct))(params)
        policy = torch.tensor(np.asarray(direct_Bx2(params), np.float64))
    ref = torch.tensor(np.asarray(ref_Bx2, np.float64))
    m = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
    logsigmoid = torch.nn.functional.logsigmoid
    expected = (-(1 - smoothing) * logsigmoid(beta * m) - smoothing * logsigmoid(-beta * m)).mean()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    assert float(metrics["reward_accuracy"]) == (m > 0).double().mean().item()
    np.testing.assert_allclose(metrics["reward_margin"], (beta * m).mean().item(), rtol=1e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(direct_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def dpo_run(folder, mesh: str, n: int, *extra):
    return run_tiny(f"data.path={folder}", "data.kind=auto", "train.objective=dpo", "parallel.precision=fp32",
                    "train.steps=8", "optim.lr=1e-2", "train.batch_size=8", f"parallel.mesh={mesh}", *extra,
                    devices=jax.devices()[:n])


# The objective on the flat executors (XLA's accumulation; data=2: the manual data executor) and once on a
# pipeline, where the reference log-probs come from a forward-only pass through the stages and each
# microbatch's DPO loss from the last one. The executors with data shards and interleaved stages run an
# objective they do not know in tests/test_objectives.py, every schedule the parity of tests/test_pipeline.py.
LAYOUTS = {"fsdp=2,tensor=2": ("fsdp=2,tensor=2", 4, "parallel.microbatches=2"),
           "data=2": ("data=2", 2, "parallel.microbatches=2"),
           "pipeline=2 1f1b": ("pipeline=2", 2, "parallel.schedule=1f1b", "parallel.microbatches=4")}
DPO_KEYS = ("reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected", "reward_chosen", "reward_rejected")


def assert_same_steps(trainer, losses, other, other_losses, name):
    """Per-step losses and every DPO metric equal (fp32, 1e-5), and the evaluation of the final state."""
    np.testing.assert_allclose(other_losses, losses, rtol=1e-5, atol=1e-5, err_msg=name)
    for k in DPO_KEYS:
        want, got = ([r[k] for r in t.history if "loss" in r] for t in (trainer, other))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {k}")
    want, got = trainer.evaluation(), other.evaluation()
    for k in ("eval_loss", "eval_reward_accuracy", "eval_reward_margin"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=f"{name} {k}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpo_steps_are_the_same_on_every_layout(pairs_folder, layout):
    mesh, n, *extra = LAYOUTS[layout]
    assert_same_steps(*dpo_run(pairs_folder, "1", 1)[:2], *dpo_run(pairs_folder, mesh, n, *extra)[:2], layout)


def test_dpo_with_lora_on_a_pipeline_takes_the_base_as_reference(pairs_folder):
    """LoRA on pipeline=2: the forward-only reference pass runs the base (adapters off) through the stages."""
    lora = ("model.lora.rank=4", "optim.lr=3e-2")
    assert_same_steps(*dpo_run(pairs_folder, "1", 1, *lora)[:2],
                      *dpo_run(pairs_folder, "pipeline=2", 2, *lora, "parallel.microbatches=2")[:2], "lora pipeline=2")


def test_a_model_learns_to_prefer_the_chosen_answer_on_new_prompts(pairs_folder, tmp_path):
    """After 8 steps the rewards order new pairs (prompts never trained on) as the data does."""
    trainer, _, params = dpo_run(pairs_folder, "1", 1)
    assert trainer.history[0]["reward_accuracy"] == 0  # the policy starts as the reference: every margin 0
    assert prepare(str(write_pairs(tmp_path / "new.jsonl", 64, seed=1)), tokenizer.ByteTokenizer(), tmp_path / "new",
                   preference=True)
    tokens, _ = read_prepared(tmp_path / "new")
    pairs = preference.PairBatches(tokens, preference.read_pairs(tmp_path / "new"), 64, 16, 0, 0,
                                   trainer.program.batch_sharding, 256).local_rows(0)
    start = trainer.program.init_state(jax.random.key(trainer.cfg.train.seed))["params"]
    with trainer.program.context():
        log_probs = lambda p, pairs: trainer.program.objective.scores(p, {"tokens": pairs})
        trained, reference = log_probs(params, pairs), log_probs(start, pairs)
    _, metrics = dpo_loss(trained, reference, trainer.cfg.train.dpo.beta, 0.0)
    assert metrics["reward_accuracy"] > 0.9 and metrics["reward_margin"] > 0.5


def test_the_evaluation_scores_the_held_out_pairs(pairs_folder):
    """data.val_fraction's tail of the pairs (10 of 200) is never trained on; the run's evaluation
    (train.eval_every's record) is the DPO loss, reward accuracy and margin over train.eval_batches
    batches of them, as computed here from the log-probs of the trained and the initial parameters."""
    trainer, _, params = dpo_run(pairs_folder, "1", 1)
    train, held = preference.split_pairs(preference.read_pairs(pairs_folder), trainer.cfg.data.val_fraction)
    assert len(held) == 10 and np.array_equal(trainer.train_batches.pairs, train)
    record = trainer.evaluation()
    start = trainer.program.init_state(jax.random.key(trainer.cfg.train.seed))["params"]
    with trainer.program.context():
        log_probs = lambda p, pairs: trainer.program.objective.scores(p, {"tokens": pairs})
        batches = [trainer.val_sets[""](i) for i in range(trainer.cfg.train.eval_batches)]
        each = [dpo_loss(log_probs(params, b), log_probs(start, b), trainer.cfg.train.dpo.beta, 0.0)[1]
                for b in batches]
    for key in ("loss", "reward_accuracy", "reward_margin"):
        np.testing.assert_allclose(record[f"eval_{key}"], np.mean([m[key] for m in each]), rtol=1e-5, atol=1e-6)
    assert record["eval_reward_accuracy"] > 0.9 and record["eval_loss"] < np.log(2)
    assert "reward accuracy" in format_record({"step": 8, **record})


@pytest.mark.fast
def test_dpo_settings_that_cannot_work_are_refused(pairs_folder):
    from meshtrain.data.preference import read_pairs

    with pytest.raises(UserError, match="leaving none for training with data.val_fraction=0.9"):
        preference.split_pairs(read_pairs(pairs_folder)[:2], 0.9)
    assert preference.split_pairs(read_pairs(pairs_folder), 0.0)[1] is None
    with pytest.raises(UserError, match="one folder from python -m meshtrain.data prepare --preference"):
        tiny_config("train.objective=dpo")  # synthetic data
    with pytest.raises(UserError, match="holds none: prepare"):
        read_pairs(pairs_folder.parent)


def test_the_plan_of_a_dpo_run_holds_the_reference_and_its_eval_step(pairs_folder, capsys):
    from conftest import TINY

    from meshtrain.plan import main as plan

    assert plan(["--config", TINY, "--set", "train.objective=dpo", "--set", f"data.path={pairs_folder}", "--set",
                 "data.kind=auto", "--devices", "8", "--mesh", "fsdp=4,tensor=2", "--compiler", "cpu",
                 "--search-budget", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory"]["reference"] == report["memory"]["parameters"] > 0  # one more copy, laid out as them
    assert set(report["steps"]) == {"train", "eval", "generation"}
    ev, mem = report["eval_step"], report["memory"]  # the eval step takes the reference as an argument
    assert ev["resident_state"] == mem["optimizer_state"] + mem["grad_error"]
    assert report["steps"]["eval"] == ev["total"] + ev["resident_state"] >= mem["parameters"] + mem["reference"]
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):  # the formulas count both sequences and the reference
        assert abs(report["collectives"][kind]["ratio"] - 1) < 0.1, (kind, report["collectives"][kind])


def test_the_plan_of_a_dpo_pipeline_counts_the_reference_pass(pairs_folder, capsys):
    """On data=4,pipeline=2 the compiled step holds the reference copy and runs its forward-only pass
    through the stages: the planner's sends are the training timetable's (9 over 6 ticks at M=4)
    plus that pass's (5 over 5), equal to the compiled program's collective-permutes, and its
    gathers (ZeRO-1 and the reference's) and reductions match the compiled ones."""
    from conftest import TINY

    from meshtrain.plan import main as plan

    assert plan(["--config", TINY, "--set", "train.objective=dpo", "--set", f"data.path={pairs_folder}", "--set",
                 "data.kind=auto", "--set", "parallel.microbatches=4", "--devices", "8", "--mesh", "data=4,pipeline=2",
                 "--compiler", "cpu", "--search-budget", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory"]["reference"] == report["memory"]["parameters"] > 0
    assert set(report["steps"]) == {"train", "eval", "generation"}
    permutes = report["collectives"]["collective-permute"]
    assert permutes["count"] == 14 and permutes["ratio"] == 1, permutes
    assert "the reference's forward-only pass: 5 over 5" in permutes["formula"][0]
    for kind in ("all-reduce", "all-gather"):
        assert abs(report["collectives"][kind]["ratio"] - 1) < 0.01, (kind, report["collectives"][kind])


def test_dpo_with_lora_takes_the_base_as_its_reference_without_a_copy(pairs_folder):
    """Under model.lora the reference is the frozen base (the adapters off): the state holds no
    reference copy, the first step's policy is the reference (loss ln 2, every margin 0), the base
    stays bitwise, and the adapters alone learn the preference."""
    trainer, losses, params = dpo_run(pairs_folder, "1", 1, "model.lora.rank=4", "optim.lr=3e-2")
    assert "reference" not in trainer.state
    np.testing.assert_allclose(losses[0], np.log(2), rtol=1e-6)
    assert trainer.history[0]["reward_margin"] == 0
    start = jax.device_get(jax.jit(trainer.program.init_state)(jax.random.key(trainer.cfg.train.seed))["params"])
    frozen = lambda tree: select(tree, lambda path: not trainer.program.model.cfg.trainable(path))
    for got, want in zip(jax.tree.leaves(frozen(params)), jax.tree.leaves(frozen(start))):
        np.testing.assert_array_equal(got, want)
    last = [r for r in trainer.history if "loss" in r][-1]
    assert last["reward_accuracy"] > 0.9 and last["loss"] < losses[0]


@pytest.mark.parametrize("lora", [(), ("model.lora.rank=4", "optim.lr=3e-2")], ids=["reference", "lora"])
def test_the_eval_command_scores_a_dpo_run_as_its_loop_does(pairs_folder, tmp_path, capsys, lora):
    """`python -m meshtrain.eval --run` on a DPO run, on other meshes: the held-out pairs' DPO loss,
    reward accuracy and margin of its last checkpoint, against the reference that checkpoint holds
    (under LoRA: its base), equal to the run's own evaluation of its final state."""
    from meshtrain.eval import main as evaluate

    trainer, _, _ = dpo_run(pairs_folder, "1", 1, *lora)
    loop = trainer.evaluation()
    out = tmp_path / "eval.json"
    for mesh in ("fsdp=4,tensor=2", "tensor=4,pipeline=2"):  # a pipeline: forward-only through its stages
        assert evaluate(["--run", str(trainer.out), "--mesh", mesh, "--json", str(out)]) == 0
        assert "reward accuracy" in capsys.readouterr().out
        got = json.loads(out.read_text())
        for key in ("eval_loss", "eval_reward_accuracy", "eval_reward_margin"):
            np.testing.assert_allclose(got[key], loop[key], rtol=1e-5, atol=1e-6, err_msg=f"{mesh} {key}")


def test_dpo_with_lora_dropout_drops_the_policys_inputs_alike_on_every_layout(pairs_folder):
    """LoRA dropout acts on the policy's pass only (each pair's key folded with chosen / rejected,
    meshtrain/objectives/dpo.py `sequence_keys`): the run departs from the one without dropout, and
    manual data shards with accumulation and a pipeline (the keys in its microbatches' pair order)
    draw the same masks as one device."""
    lora = ("model.lora.rank=4", "optim.lr=3e-2")
    _, plain, _ = dpo_run(pairs_folder, "1", 1, *lora)
    trainer, losses, _ = dpo_run(pairs_folder, "1", 1, *lora, "model.lora.dropout=0.1")
    np.testing.assert_allclose(losses[0], np.log(2), rtol=1e-6)  # B = 0: the policy is the reference
    assert np.abs(losses - plain)[2:].min() > 1e-5, (losses, plain)
    # the losses and rewards as `test_dpo_steps_are_the_same_on_every_layout` compares them (the adapters
    # after 8 steps at lr 3e-2 differ by 3.1e-5 here, 7.9e-5 without dropout: Adam amplifies the sums' order)
    for mesh, more in (("data=2", ("parallel.microbatches=2",)), ("pipeline=2", ())):
        other, other_losses, _ = dpo_run(pairs_folder, mesh, 2, *lora, "model.lora.dropout=0.1", *more)
        np.testing.assert_allclose(other_losses, losses, rtol=1e-5, atol=1e-5, err_msg=mesh)
        for k in ("reward_margin", "logp_chosen", "logp_rejected"):
            got, want = ([r[k] for r in t.history if "loss" in r] for t in (other, trainer))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{mesh} {k}")
