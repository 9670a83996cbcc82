"""GRPO (issue 60): the rewards, the group advantages and the clipped loss against their formulas,
and the sampler's log-probabilities against the trainer's recomputation."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_param_diff, run_tiny, tiny_config

from meshtrain.core.errors import UserError
from meshtrain.data import chat, prompts, tokenizer
from meshtrain.data.__main__ import main
from meshtrain.data.tokens import token_ids
from meshtrain.engine.decode import generate, sample_rows
from meshtrain.engine.program import TrainProgram
from meshtrain.objectives import grpo, rewards
from meshtrain.ops.loss import position_log_probs
from meshtrain.ops.precision import cast_for_compute
from meshtrain.ops.trainable import select
from meshtrain.run.loggers import MetricsLog, format_record
from meshtrain.run.trainer import Trainer

fast = pytest.mark.fast


@fast
@pytest.mark.parametrize("text,answer", [
    ("so 12 + 30 = 42", "42"), ("The answer is \\boxed{1,000}.", "1000"), ("x\n#### 7.0", "7"),
    ("\\boxed{\\frac{1}{2}} then 3", "\\frac{1}{2}"), ("-5", "-5"), ("answer: yes", "answer: yes")])
def test_exact_answer_reads_the_final_answer(text, answer):
    assert rewards.exact_answer([""], [text], [{"answer": answer}]) == [1.0]
    assert rewards.exact_answer([""], [text], [{"answer": "41"}]) == [0.0]


@fast
def test_weighted_terms_and_a_users_function_score_a_batch(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, rows):\n"
        "    return [len(c) + rows[i]['bonus'] for i, c in enumerate(completions)]\n"
        "def picky(prompts, completions, rows):\n    return [1 / (len(c) - 2) for c in completions]\n"
        "def short(prompts, completions, rows):\n    return [0.0]\n"
        "def nan(prompts, completions, rows):\n    return [float('nan')] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    terms = rewards.parse("exact_answer, 0.5*format, -2*my_rewards:length", format_pattern=r"\d+")
    assert [(t.name, t.weight) for t in terms] == [("exact_answer", 1.0), ("format", 0.5), ("my_rewards:length", -2.0)]
    rows = [{"answer": "12", "bonus": 1}, {"answer": "3", "bonus": 0}]
    got = rewards.score(terms, ["p", "q"], ["12", "no 4"], rows, ["row 0", "row 1"])
    np.testing.assert_array_equal(got["reward_exact_answer"], [1, 0])
    np.testing.assert_array_equal(got["reward_format"], [1, 0])
    np.testing.assert_array_equal(got["reward"], [1 + 0.5 - 2 * 3, -2 * 4])
    with pytest.raises(UserError, match=r"my_rewards:picky on row 1 raised ZeroDivisionError"):
        rewards.score(rewards.parse("my_rewards:picky"), ["p", "q"], ["abc", "no"], rows, ["row 0", "row 1"])
    with pytest.raises(UserError, match="returned 1 values for 2 completions"):
        rewards.score(rewards.parse("my_rewards:short"), ["p", "q"], ["a", "b"], rows, ["row 0", "row 1"])
    with pytest.raises(UserError, match="on row 0 returned nan; return a finite number"):
        rewards.score(rewards.parse("my_rewards:nan"), ["p", "q"], ["a", "b"], rows, ["row 0", "row 1"])
    (tmp_path / "broken.py").write_text("def score(prompts, completions, rows):\n    return 0\nx = 1 / 0\n")
    with pytest.raises(UserError, match="importing broken raised ZeroDivisionError"):
        rewards.parse("broken:score")
    with pytest.raises(UserError, match="rl.format_pattern is set, and rl.reward=exact_answer has no format term"):
        rewards.parse("exact_answer", format_pattern=r"\d+")
    for spec, message in (("format", "set rl.format_pattern"), ("2*", "is not \\[weight\\*\\]name"),
                          ("x*exact_answer", "is not"), ("nothing", "neither exact_answer"),
                          ("no_such_module:f", "cannot import no_such_module"), ("my_rewards:gone", "has no gone")):
        with pytest.raises(UserError, match=message):
            rewards.parse(spec)


@fast
def test_group_advantages_and_the_clipped_token_loss_are_their_formulas():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = grpo.group_advantages(r)
    np.testing.assert_allclose(a[0], (r[0] - 0.5) / (np.std(r[0], ddof=1) + 1e-4))
    np.testing.assert_array_equal(a[1], 0)  # a group that agrees teaches nothing
    np.testing.assert_array_equal(grpo.group_advantages(r, scale=False)[0], r[0] - 0.5)

    rng = np.random.default_rng(0)
    logp, old, ref = (-rng.uniform(0.1, 3, size=(3, 5)) for _ in range(3))
    old[0, :2] = logp[0, :2] + [0.5, -0.5]  # ratios 0.61 and 1.65, outside the clip range both ways
    adv, trained = np.array([1.5, -0.7, 0.0]), rng.uniform(size=(3, 5)) < 0.7
    out = grpo.token_losses(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(trained),
                            0.2, 0.28, kl_coef=0.05, ref_BxL=jnp.asarray(ref))
    for b in range(3):
        for t in range(5):
            rho = np.exp(logp[b, t] - old[b, t])
            surrogate = min(rho * adv[b], np.clip(rho, 0.8, 1.28) * adv[b])
            k3 = np.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
            want = (-surrogate + 0.05 * k3) if trained[b, t] else 0.0
            np.testing.assert_allclose(out["loss"][b, t], want, rtol=1e-5, atol=1e-7)
            assert out["clipped"][b, t] == (trained[b, t] and np.clip(rho, 0.8, 1.28) * adv[b] < rho * adv[b])
    assert out["clipped"][0, :2].tolist() == [0.0, trained[0, 1]]  # A > 0: the high side clips, the low side not


@pytest.mark.parametrize("sampler", ["cache", "exact"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_samplers_log_probs_are_the_trainers_recomputation(precision, sampler):
    """Each drawn token's log-probability from the sampler against the trainer's forward over the
    whole sequence (`position_log_probs`), one device: the same expression of logits. The KV-cache
    sampler's logits differ by the two forwards' arithmetic (one position's matmuls and the cached
    attention against the full sequence's), measured at 9.5e-7 in fp32 and 4.8e-7 in bf16 on XLA:CPU;
    the exact sampler runs the trainer's forward and head shapes, so they are equal bit for bit."""
    program = TrainProgram.from_config(tiny_config("parallel.mesh=1", f"parallel.precision={precision}"),
                                       jax.devices()[:1])
    model = program.model
    compute = cast_for_compute(model.init(jax.random.key(0)), precision)
    prompts = [np.array([1, 5, 7, 9], np.int32), np.array([3, 4], np.int32), np.array([2, 8, 8], np.int32)]
    new, temperature = 12, 0.7
    tokens, logp = sample_rows(model, compute, prompts, new, temperature=temperature, seed=3,
                               exact=sampler == "exact")
    if sampler == "cache":
        assert [t.tolist() for t in tokens] == [t.tolist() for t in generate(model, compute, prompts, new,
                                                                             temperature=temperature, seed=3)]
    seq_BxL1 = np.zeros((len(prompts), 4 + new), np.int32)
    targets_BxL = np.full((len(prompts), 3 + new), -1, np.int32)
    for b, p in enumerate(prompts):
        seq_BxL1[b, :len(p) + new] = np.concatenate([p, tokens[b]])
        targets_BxL[b, len(p) - 1:len(p) - 1 + new] = tokens[b]

    @jax.jit
    def trainer(params, inputs, targets):
        x, _ = model.trunk(params, inputs)
        return position_log_probs(model.final_norm(params, x), model.unembedding(params), targets, temperature)

    again = np.asarray(trainer(compute, seq_BxL1[:, :-1], targets_BxL))
    diff = max(np.abs(again[b, len(p) - 1:len(p) - 1 + new] - logp[b]).max() for b, p in enumerate(prompts))
    assert diff <= (0.0 if sampler == "exact" else 2e-6), diff
    assert np.all(logp < 0) and np.all(again[targets_BxL < 0] == 0)


def write_sums(path, n: int, seed: int = 0):
    """Two-digit additions: {"prompt": "12+34=", "answer": "46", "id": i}."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.integers(10, 50, size=2)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "id": i}) + "\n")
    return path


@pytest.fixture(scope="module")
def prompts_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompts")
    assert main(["prepare", str(write_sums(tmp / "sums.jsonl", 200)), "--prompts", "--out", str(tmp / "prepared")]) == 0
    return tmp / "prepared"


DIGIT_FIRST = ("rl.reward=format", "rl.format_pattern=[0-9].*")  # a reward a random tiny model meets 4% of the time
# Met by about half of a random model's 6-byte completions: every step's groups disagree, so its gradient is
# the objective's. (A batch whose groups all agree has advantages 0 and a gradient of rounding noise, which
# Adam scales to full-size steps that differ by layout.)
A_LETTER = ("rl.reward=format", "rl.format_pattern=.*[a-z].*")


GRPO = ("data.kind=auto", "train.objective=grpo", "parallel.precision=fp32", "train.batch_size=16",
        "rl.group_size=4", "rl.max_new_tokens=6", "train.seq_len=16", "optim.lr=1e-2")


def grpo_config(folder, mesh: str = "1", *extra, out=None):
    return tiny_config(f"data.path={folder}", *GRPO, "train.eval_every=0", f"parallel.mesh={mesh}", *A_LETTER, *extra,
                       out=out)


def grpo_run(folder, mesh: str, n: int, *extra):
    return run_tiny(f"data.path={folder}", *GRPO, "train.steps=6", f"parallel.mesh={mesh}", *A_LETTER, *extra,
                    devices=jax.devices()[:n])


@fast
def test_prepare_keeps_each_prompt_its_fields_and_where_it_was_read(prompts_folder, tmp_path):
    p = prompts.read_prompts(prompts_folder)
    assert len(p) == 200 and p.rows[0] == {"answer": str(eval(p.texts[0][:-1])), "id": 0}
    assert bytes(p.ids[0].astype(np.uint8)).decode() == p.texts[0] and p.texts[0].endswith("=")  # no document end
    assert p.where[0].endswith("sums.jsonl, line at byte 0")
    rows = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2"}], "answer": 4},
            {"prompt": "3+3", "answer": 6}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["prepare", str(tmp_path / "chat.jsonl"), "--prompts", "--chat-template", "chatml", "--out",
                 str(tmp_path / "chat")]) == 0
    fmt = chat.load_format("chatml", tokenizer.ByteTokenizer())
    got = prompts.read_prompts(tmp_path / "chat")
    assert got.texts == [fmt.render(rows[0]["messages"], add_generation_prompt=True),
                         fmt.render([{"role": "user", "content": "3+3"}], add_generation_prompt=True)]
    assert got.rows == [{"answer": 4}, {"answer": 6}]
    assert got.end_of_turn is None  # chatml's <|im_end|> is ten bytes here, not a token: completions end at EOS


@fast
def test_a_chat_templates_end_of_turn_token_ends_the_completions(tmp_path, capsys):
    """Prompts prepared with a chat template whose end-of-turn marker is one special token of the
    tokenizer (not its EOS) record it, and the sampler (either) ends a row there, keeping it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    rust.train_from_iterator(["what is 2+2? it is 4."] * 20, trainer=trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "what is 2+2?", "answer": "4"}) + "\n")
    assert main(["prepare", str(tmp_path / "p.jsonl"), "--prompts", "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--chat-template", "chatml", "--out", str(tmp_path / "chat")]) == 0
    assert "completions end at EOS or <|im_end|>" in capsys.readouterr().out
    assert prompts.read_prompts(tmp_path / "chat").end_of_turn == rust.token_to_id("<|im_end|>")

    model = TrainProgram.from_config(tiny_config("parallel.mesh=1"), jax.devices()[:1]).model
    params, rows = model.init(jax.random.key(0)), [np.array([1, 5, 7], np.int32), np.array([3, 4], np.int32)]
    for exact in (False, True):
        free, _ = sample_rows(model, params, rows, 6, eos_id=0, exact=exact)
        stop = next(t for t in free[0] if t not in free[0][:2] and t != 0)  # a token row 0 draws third or later
        at = free[0].tolist().index(stop)
        assert free[0, at + 1] != 0  # the free row goes on past it: the stop is what ends the row below
        out, logp = sample_rows(model, params, rows, 6, eos_id=0, exact=exact, end_of_turn=int(stop))
        assert out[0, :at + 1].tolist() == free[0, :at + 1].tolist() and np.all(out[0, at + 1:] == 0)
        assert np.all(logp[0, at + 1:] == 0) and np.all(logp[0, :at + 1] < 0)


@fast
def test_bad_prompt_data_is_one_error_naming_the_row_and_writes_nothing(prompts_folder, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\n{"question": "2+2="}\n')
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "--prompts", "--out", str(tmp_path / "out")]) == 2
    assert "bad.jsonl, line at byte 19: a prompt row needs one of the fields prompt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "msgs.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["prepare", str(tmp_path / "msgs.jsonl"), "--prompts", "--out", str(tmp_path / "out")]) == 2
    assert "pass --chat-template" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "msgs.jsonl"), "--prompts", "--chat", "--out", str(tmp_path / "o")]) == 2
    assert "leave out --chat" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"line at byte 0: the prompt is 6 tokens, longer than train.seq_len \+ 1 - "
                                        r"rl.max_new_tokens = 5"):
        prompts.batches(prompts_folder, 0.05, 4, 0, 5, 256)
    with pytest.raises(UserError, match="leaving none for training"):
        prompts.split_prompts(prompts.read_prompts(prompts_folder).subset([0, 1]), 0.9)
    with pytest.raises(UserError, match="holds none: prepare"):
        prompts.read_prompts(tmp_path)


@fast
def test_grpo_settings_that_cannot_work_are_refused(prompts_folder):
    with pytest.raises(UserError, match="train.batch_size=18 is not a multiple of rl.group_size=4"):
        grpo_config(prompts_folder, "1", "train.batch_size=18")
    with pytest.raises(UserError, match="rl.max_new_tokens=17 leaves no room for a prompt"):
        grpo_config(prompts_folder, "1", "rl.max_new_tokens=17")
    with pytest.raises(UserError, match="one folder from python -m meshtrain.data prepare --prompts"):
        tiny_config("train.objective=grpo")
    with pytest.raises(UserError, match="the sampler runs no pipeline axis"):
        TrainProgram.from_config(grpo_config(prompts_folder, "pipeline=2"), jax.devices()[:2])
    with pytest.raises(UserError, match="holds prompts .* train.objective=sft trains on"):
        Trainer(tiny_config(f"data.path={prompts_folder}", "data.kind=auto", "parallel.mesh=1"),
                devices=jax.devices()[:1])
    with pytest.raises(UserError, match="rl.reward names format"):
        Trainer(grpo_config(prompts_folder, "1", "rl.format_pattern="), devices=jax.devices()[:1])
    with pytest.raises(UserError, match="set model.lora.dropout=0"):
        grpo_config(prompts_folder, "1", "model.lora.rank=4", "model.lora.dropout=0.1")
    with pytest.raises(UserError, match="set data.document_mask=false"):
        grpo_config(prompts_folder, "1", "data.document_mask=true")


@fast
def test_exact_answer_on_rows_without_an_answer_is_one_error_before_any_compile(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n' * 20)
    assert main(["prepare", str(tmp_path / "q.jsonl"), "--prompts", "--out", str(tmp_path / "q")]) == 0
    with pytest.raises(UserError, match=r"q.jsonl, line at byte \d+: rl.reward exact_answer reads each row's "
                                        r"'answer', and this row has none"):
        Trainer(tiny_config(f"data.path={tmp_path / 'q'}", *GRPO, "rl.reward=exact_answer"), devices=jax.devices()[:1])


def test_the_loss_and_its_gradients_are_the_direct_formulas(prompts_folder):
    """A rollout of the tiny model, through the step's objective (the scored log-probs, the clipped
    token losses, their mean over the completion tokens), against the formula written out from the
    model's full logits: equal, gradients too; the sampler's log-probs are the recomputation's."""
    trainer = Trainer(grpo_config(prompts_folder, "1", "rl.kl_coef=0.1"), devices=jax.devices()[:1])
    try:
        program, objective, rl = trainer.program, trainer.program.objective, trainer.cfg.rl
        with program.context():
            batch, rollout = trainer.rollouts(trainer.state, trainer.train_batches(0), 0)
            params = jax.device_get(trainer.state["params"])
            moved = jax.tree.map(lambda p: p + 0.01 * np.sign(np.sin(np.arange(p.size))).reshape(p.shape), params)
            state = {**trainer.state, "params": moved, "reference": params}
            score = lambda p, rows: objective.scores(jax.lax.stop_gradient(p), rows)
            rows, shared = objective.step_inputs({**state, "params": params}, batch, score)
            assert float(shared["logp_diff_max"]) <= 2e-6
            loss_fn = lambda p: objective.finish(objective.loss(p, rows, shared)[1], rows, shared)[0]["loss"]
            got, grads = jax.jit(jax.value_and_grad(loss_fn))(moved)

        tokens = np.asarray(batch["tokens"])
        targets = np.where(tokens[:, 1:] >= 0, tokens[:, 1:], -1)
        adv = np.asarray(batch["advantages"])

        def direct(p):
            logits = program.model.apply(p, token_ids(tokens[:, :-1])).astype(jnp.float32) / rl.temperature
            logp_all = jax.nn.log_softmax(logits, axis=-1)
            pick = lambda lp: jnp.take_along_axis(lp, np.maximum(targets, 0)[..., None], axis=-1)[..., 0]
            logp = pick(logp_all)
            old = pick(jax.nn.log_softmax(program.model.apply(params, token_ids(tokens[:, :-1])) / rl.temperature))
            ref = old  # the reference is the rollout's policy here
            ratio = jnp.exp(logp - old)
            surrogate = jnp.minimum(ratio * adv[:, None], jnp.clip(ratio, 1 - 0.2, 1 + 0.2) * adv[:, None])
            k3 = jnp.exp(ref - logp) - (ref - logp) - 1
            per_token = -surrogate + 0.1 * k3
            trained = targets >= 0
            return jnp.sum(jnp.where(trained, per_token, 0)) / trained.sum()

        want, want_grads = jax.jit(jax.value_and_grad(direct))(moved)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
        assert rollout["response_length"] == 6.0 and 0 <= rollout["reward"] <= 1
    finally:
        trainer.close()


# The step on the flat executors: XLA's accumulation over fsdp and tensor, and the manual data-parallel
# executor (data=2), against one device: the same rollouts (the sampler's key is the step's), the same
# losses, the same parameters; two updates a rollout and a KL reference, so the kept rollout and the
# scored reference are laid out over the batch axes too.
LAYOUTS = {"fsdp=2,tensor=2": ("fsdp=2,tensor=2", 4), "data=2": ("data=2", 2, "parallel.microbatches=2")}
UPDATES = ("rl.updates_per_batch=2", "rl.kl_coef=0.05")
KEYS = ("loss", "kl", "clip_fraction", "entropy", "reward", "response_length", "grad_norm")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_exact_sampler_logs_a_logp_diff_of_zero_at_every_step(prompts_folder, precision):
    """rl.sampler=exact on one device: every step's logp_diff_max, the sampler's log-probs against the
    step's own scoring pass, is 0."""
    trainer = grpo_run(prompts_folder, "1", 1, "rl.sampler=exact", f"parallel.precision={precision}")[0]
    assert [r["logp_diff_max"] for r in trainer.history if "loss" in r] == [0.0] * 6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_steps_are_the_same_on_every_layout(prompts_folder, layout):
    mesh, n, *extra = LAYOUTS[layout]
    one = grpo_run(prompts_folder, "1", 1, *UPDATES)[0]
    other = grpo_run(prompts_folder, mesh, n, *UPDATES, *extra)[0]
    for k in KEYS:
        want, got = ([r.get(k, np.nan) for r in t.history if "loss" in r] for t in (one, other))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{layout} {k}")
    same = lambda t: np.asarray(jax.device_get(t.state["rollout"]["tokens"]))  # the last rollout's, as kept
    assert np.array_equal(same(one), same(other))
    diffs = [r["logp_diff_max"] for r in other.history if "loss" in r]
    assert max(diffs) <= 2e-6, diffs  # the sampler against the trainer, on this layout


def test_two_updates_a_rollout_clip_the_second_and_a_resume_between_them_continues_exactly(prompts_folder, tmp_path):
    """rl.updates_per_batch=2: the first update of a rollout has ratio 1 (nothing clipped, no KL), the
    second trains on the same rollout (no new reward figures) against its kept log-probs, in a step
    compiled without the scoring passes; a run stopped after step 3 (mid-rollout) and resumed ends where
    the straight run does, bitwise."""
    straight, _, params = grpo_run(prompts_folder, "1", 1, *UPDATES)
    flops = lambda compiled: (lambda c: (c[0] if isinstance(c, list) else c)["flops"])(compiled.cost_analysis())
    # the policy's and the reference's forward passes left out: about 2 of the first step's 5 forward-equivalents
    assert 0.5 < flops(straight.reuse_step) / flops(straight.compiled_step) < 0.75
    records = [r for r in straight.history if "loss" in r]
    assert all(r["clip_fraction"] == 0 and r["kl"] == 0 for r in records[:1])
    assert [r["rollout_s"] > 0 for r in records if "rollout_s" in r] == [True] * 3  # a rollout every 2 steps
    assert [r["reward"] for r in records[1::2]] == [r["reward"] for r in records[::2]]  # its figures, reported again
    assert any(r["clip_fraction"] > 0 for r in records[1::2])  # lr 1e-2 moves the policy past the clip range
    out = tmp_path / "run"
    first = Trainer(grpo_config(prompts_folder, "1", *UPDATES, "train.steps=6", out=str(out)),
                    devices=jax.devices()[:1])
    first.fit(3, log=MetricsLog(first.out, primary=False))
    first.checkpointer.wait()
    again = Trainer(grpo_config(prompts_folder, "1", *UPDATES, "train.steps=6", "checkpoint.resume=auto", out=str(out)),
                    devices=jax.devices()[:1])
    again.fit(log=MetricsLog(again.out, primary=False))
    assert max_param_diff(params, jax.device_get(again.state["params"])) == 0


def test_the_policy_learns_the_reward_on_held_out_prompts(prompts_folder, tmp_path, capsys):
    """The digit-first reward (4% of a random model's completions meet it): 30 steps raise the
    training reward and the greedy completions of the held-out prompts (data.val_fraction's 10)
    from none meeting it to all of them; `python -m meshtrain.eval --run` on another mesh scores
    the run's checkpoint as its loop did."""
    from meshtrain.eval import main as evaluate

    trainer = Trainer(grpo_config(prompts_folder, "1", "train.steps=30", "train.batch_size=32", "rl.group_size=8",
                                  "train.eval_batches=8", "rl.max_new_tokens=4", "train.eval_every=30", *DIGIT_FIRST),
                      devices=jax.devices()[:1])
    records = trainer.fit(log=MetricsLog(trainer.out, primary=False))
    history = [r for r in records if "loss" in r]
    before, after = ({k: r[k] for k in r if k.startswith("eval")} for r in records if "eval_reward" in r)
    assert [r["step"] for r in records if "eval_reward" in r] == [0, 30]  # the starting policy's, and the last
    assert after == trainer.evaluation()
    assert before["eval_reward"] == 0 and after["eval_reward"] == 1
    assert np.mean([r["reward"] for r in history[-5:]]) > 3 * np.mean([r["reward"] for r in history[:5]])
    assert "eval_reward 1.0000" in format_record({"step": 30, **after})
    assert evaluate(["--run", str(trainer.out), "--mesh", "data=2,tensor=4", "--json", str(tmp_path / "e.json")]) == 0
    assert "eval_reward 1.0000" in capsys.readouterr().out
    assert json.loads((tmp_path / "e.json").read_text())["eval_reward"] == after["eval_reward"]


def test_a_reward_that_raises_stops_the_run_with_its_row(prompts_folder, tmp_path, monkeypatch):
    (tmp_path / "picky.py").write_text("def score(prompts, completions, rows):\n"
                                       "    return [1 / (r['id'] != 7) for r in rows]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = Trainer(grpo_config(prompts_folder, "1", "rl.reward=picky:score", "rl.format_pattern=",
                                  "train.batch_size=400", "rl.group_size=2"), devices=jax.devices()[:1])
    try:
        with trainer.program.context(), pytest.raises(UserError) as e:
            trainer.rollouts(trainer.state, trainer.train_batches(0), 0)
        assert "rl.reward picky:score on " in str(e.value) and "sums.jsonl, line at byte" in str(e.value)
        assert "raised ZeroDivisionError" in str(e.value)
    finally:
        trainer.close()


def test_grpo_with_lora_samples_with_the_adapters_and_takes_the_base_as_reference(prompts_folder):
    """model.lora: the rollouts sample the adapted policy (its log-probs are still the trainer's), the
    KL reference is the frozen base (no copy in the state), and only the adapters train."""
    trainer, _, params = grpo_run(prompts_folder, "1", 1, "model.lora.rank=4", "rl.kl_coef=0.1", "optim.lr=3e-2")
    assert "reference" not in trainer.state
    records = [r for r in trainer.history if "loss" in r]
    assert records[0]["kl"] == 0 and records[-1]["kl"] > 1e-4  # the adapters moved the policy off the base
    assert max(r["logp_diff_max"] for r in records) <= 2e-6
    start = jax.device_get(trainer.program.init_state(jax.random.key(trainer.cfg.train.seed))["params"])
    base = lambda path: not trainer.cfg.model.trainable(path)
    assert max_param_diff(select(params, base), select(start, base)) < 1e-7  # eager init's rounding; a step: 3e-2


def test_the_plan_of_a_grpo_run_compiles_its_rollout_and_prices_its_forward_passes(prompts_folder, capsys):
    """The planner's GRPO run: the rollout compiled on the training mesh (its rows, its KV cache by
    formula in the compute dtype) beside the rest of the train state, no eval step, the reference and
    the kept rollout counted, and the collectives of the policy's and the reference's forward-only
    passes in the formulas."""
    from conftest import TINY

    from meshtrain.plan import main as plan

    assert plan(["--config", TINY, *[a for s in GRPO for a in ("--set", s)], "--set", f"data.path={prompts_folder}",
                 "--set", "rl.kl_coef=0.1", "--set", "rl.updates_per_batch=2", "--set", "parallel.precision=bf16",
                 "--devices", "8", "--mesh", "fsdp=4,tensor=2", "--compiler", "cpu", "--search-budget", "0",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mem, rollout = report["memory"], report["rollout"]
    assert set(report["steps"]) == {"train", "rollout", "generation"} and report["eval_step"] is None
    assert mem["reference"] == mem["parameters"] > 0 and mem["objective_state"] > 0
    assert rollout["rows"] == 16 and rollout["prompt_len"] == 11 and rollout["max_new_tokens"] == 6
    # keys and values [layers, rows, positions, kv heads, head dim] in bf16, over fsdp (a batch axis) and tensor
    assert rollout["kv_cache_formula"] == 4 * 16 * 16 * 2 * 4 * 8 * 2 / (4 * 2)
    assert rollout["resident_state"] == mem["optimizer_state"] + mem["reference"] + mem["objective_state"]
    assert report["steps"]["rollout"] == rollout["total"] + rollout["resident_state"]
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        assert abs(report["collectives"][kind]["ratio"] - 1) < 0.1, (kind, report["collectives"][kind])


def test_the_plan_of_an_exact_sampler_compiles_it_without_a_kv_cache(prompts_folder, capsys):
    """rl.sampler=exact: the planner compiles the cache-free sampler (the training forward over the
    whole sequence) and counts no KV cache."""
    from conftest import TINY

    from meshtrain.plan import main as plan

    assert plan(["--config", TINY, *[a for s in GRPO for a in ("--set", s)], "--set", f"data.path={prompts_folder}",
                 "--set", "rl.sampler=exact", "--devices", "8", "--mesh", "fsdp=8", "--compiler", "cpu",
                 "--search-budget", "0"]) == 0
    out = capsys.readouterr().out
    assert "16 completion rows, prompts padded to 11 tokens + 6 new" in out and "no KV cache: rl.sampler=exact" in out


def test_two_processes_roll_out_and_train_as_one(prompts_folder, tmp_path):
    """2 processes x 4 CPU devices (jax.distributed on 127.0.0.1): each samples its share of the rows
    and gathers the whole rollout, process 0 scores it and sends the rewards, and the run logs the
    rewards, losses and gradient norms of one process with 8 devices."""
    from test_multihost import free_port, launch

    layout = ("parallel.mesh=data=2,fsdp=2,tensor=2", "train.steps=3", "train.log_every=1")
    settings = (f"data.path={prompts_folder}", *GRPO, "train.eval_every=0", *A_LETTER, *layout)
    out = tmp_path / "run"
    procs = launch(tmp_path, out, free_port(), *[a for s in settings for a in ("--set", s)])
    for p in procs:
        assert p.wait(timeout=300) == 0, (tmp_path / f"p{procs.index(p)}.err").read_text()[-3000:]
    two = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    one = run_tiny(*settings)[0].history
    for k in ("reward", "loss", "grad_norm", "logp_diff_max"):
        want, got = ([r[k] for r in records if "loss" in r] for records in (one, two))
        assert len(got) == len(want) == 3
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=k)
