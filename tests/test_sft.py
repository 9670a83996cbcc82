"""Supervised fine-tuning on chat data (issue 43, section 1): conversations rendered as transformers
renders them, a loss mask on exactly the assistant turns, prepared beside the tokens, the loss the
mean over trained tokens on every layout, and a tiny model that learns the answers only."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_tiny, tiny_config

from meshtrain.core.errors import UserError
from meshtrain.data import chat, tokenizer
from meshtrain.data.__main__ import main
from meshtrain.data.corpus import load_corpus
from meshtrain.data.prepare import prepare
from meshtrain.data.tokens import read_prepared, token_ids

TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
            "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
            "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": " The answer is 42. "}, {"role": "user", "content": "how are you?"},
                {"role": "assistant", "content": "fine"}, {"role": "user", "content": "é and ünï"},
                {"role": "assistant", "content": "ok 😀"}]
ANSWER = "Fine."


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny byte-level BPE saved by transformers with a chat template of its own (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    rust.train_from_iterator(["hello there, how are you? The answer is 42."] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="<|im_end|>", chat_template=TEMPLATE)
    folder = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(folder)
    return folder, hf


def assistant_runs(tok, ids, mask) -> list[str]:
    """The text of each run of trained tokens."""
    runs = np.split(np.arange(len(mask)), np.flatnonzero(np.diff(mask)) + 1)
    return [tok.decode(ids[r]) for r in runs if mask[r[0]]]


@pytest.mark.fast
def test_a_conversation_renders_and_tokenizes_as_transformers_apply_chat_template(hf_folder):
    folder, hf = hf_folder
    tok = tokenizer.load(str(folder))
    fmt = chat.load_format("auto", tok)  # the tokenizer's own template, read from its folder
    (_, ids, mask), = chat.encode(fmt, tok, [CONVERSATION])
    assert fmt.render(CONVERSATION) == hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids.tolist() == list(hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    # exactly the assistant turns (the template trims them) with their end-of-turn marker, nothing else
    assert assistant_runs(tok, ids, mask) == ["The answer is 42.<|im_end|>\n", "fine<|im_end|>\n",
                                              "ok 😀<|im_end|>\n"]
    byte = tokenizer.ByteTokenizer()  # a built-in template for a tokenizer without one; bytes of é, 😀 kept whole
    (_, ids, mask), = chat.encode(chat.load_format("chatml", byte), byte, [CONVERSATION])
    assert assistant_runs(byte, ids, mask) == [" The answer is 42. <|im_end|>\n", "fine<|im_end|>\n",
                                               "ok 😀<|im_end|>\n"]


def write_chat(path, n: int, seed: int = 0):
    """Conversations whose prompts are random letters and whose answer is always ANSWER."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    with open(path, "w") as f:
        for _ in range(n):
            q = "".join(rng.choice(letters, rng.integers(8, 25)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": ANSWER}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """400 fixed-answer conversations prepared as bytes with chatml."""
    tmp = tmp_path_factory.mktemp("chat")
    out = tmp / "prepared"
    assert main(["prepare", str(write_chat(tmp / "chat.jsonl", 400)), "--chat", "--chat-template", "chatml",
                 "--tokenizer", "byte", "--out", str(out), "--workers", "1"]) == 0
    return out


@pytest.mark.fast
def test_prepare_stores_the_mask_beside_the_tokens_and_hashes_it(chat_folder, tmp_path):
    tokens, manifest = read_prepared(chat_folder)
    turn = len(f"{ANSWER}<|im_end|>\n")
    assert manifest["documents"] == 400 and manifest["trained_tokens"] == 400 * turn
    assert int(np.asarray(tokens.masks).sum()) == manifest["trained_tokens"]
    rows = tokens.windows(np.array([0]), 200)[0]  # untrained tokens are carried as ~id
    text = bytes(token_ids(rows).astype(np.uint8)).decode()
    assert bytes(rows[rows >= 0].astype(np.uint8)).decode().startswith(f"{ANSWER}<|im_end|>\n")
    assert text.startswith("<|im_start|>user\n")
    # the data's identity covers the mask; train_on=all reads the same tokens without it
    dcfg = tiny_config(f"data.path={chat_folder}", "data.kind=auto").data
    masked = load_corpus(dcfg, 256).tokens
    dcfg.train_on = "all"
    plain = load_corpus(dcfg, 256).tokens
    assert plain.masks is None and plain.sha256() == manifest["sha256"] != masked.sha256()
    assert (plain.windows(np.array([0]), 200) >= 0).all()
    # the same mask from Parquet rows of messages, any number of workers
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (chat_folder.parent / "chat.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"messages": [r["messages"] for r in rows]}), tmp_path / "chat.parquet", row_group_size=100)
    other = prepare(str(tmp_path / "chat.parquet"), tokenizer.ByteTokenizer(), tmp_path / "pq", workers=2,
                            text_field="messages", chat=chat.load_format("chatml", tokenizer.ByteTokenizer()))
    assert (other["sha256"], other["mask_sha256"]) == (manifest["sha256"], manifest["mask_sha256"])


@pytest.mark.fast
def test_bad_chat_input_is_one_error_and_writes_nothing(hf_folder, tmp_path):
    byte = tokenizer.ByteTokenizer()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(UserError, match="is not a conversation"):
        prepare(str(bad), byte, tmp_path / "out", text_field="messages", chat=chat.load_format("chatml", byte))
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="ships no chat template"):
        chat.load_format("auto", byte)
    unknown = [{"role": "tool", "content": "x"}]
    with pytest.raises(UserError, match="unknown role tool"):  # the template's raise_exception
        chat.load_format("auto", tokenizer.load(str(hf_folder[0]))).render(unknown)
    reordered = chat.ChatFormat("{% for m in messages | reverse %}{{ m['content'] }}|{% endfor %}", "reversed")
    with pytest.raises(UserError, match="turn by turn"):
        reordered.spans(CONVERSATION[1:3])
    assert main(["prepare", str(bad), "--chat-template", "chatml", "--out", str(tmp_path / "o2")]) == 2
    assert main(["prepare", str(bad), "--chat", "--out", str(tmp_path / "o2")]) == 2  # bytes: no template of its own
    assert not (tmp_path / "o2").exists()


def masked_reference_loss(trainer) -> float:
    """Step 1's loss by the definition: the initial model's cross-entropy summed over the batch's
    trained targets, divided by their number (numpy, from the logits of `apply`)."""
    program = trainer.program
    params = jax.device_get(program.init_state(jax.random.key(trainer.cfg.train.seed))["params"])
    rows = np.asarray(trainer.train_batches(0))
    ids = token_ids(rows)
    logits = np.asarray(program.model.apply(params, ids[:, :-1]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    trained = rows[:, 1:] >= 0
    return float(nll[trained].sum() / trained.sum())


LAYOUTS = {"fsdp=2,tensor=2": 4, "pipeline=2": 2, "data=2": 2}  # mesh: its devices (data=2: the manual data executor)


def test_the_masked_loss_is_the_trained_tokens_mean_on_every_layout(chat_folder):
    data = (f"data.path={chat_folder}", "data.kind=auto", "parallel.precision=fp32", "train.seq_len=32")
    trainer, reference, _ = run_tiny(*data, "parallel.mesh=1", devices=jax.devices()[:1])
    np.testing.assert_allclose(reference[0], masked_reference_loss(trainer), rtol=1e-5)
    record = trainer.history[0]
    trained = (np.asarray(trainer.train_batches(0))[:, 1:] >= 0).sum()
    assert 0 < record["trained_tokens"] == trained < 16 * 32 and record["trained_tokens_per_sec"] > 0
    for mesh, n in LAYOUTS.items():  # each with microbatches of unequal trained counts (the pipeline's 4)
        micro = ("parallel.microbatches=2",) if "fsdp" in mesh else ()
        _, losses, _ = run_tiny(*data, f"parallel.mesh={mesh}", *micro, devices=jax.devices()[:n])
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5, err_msg=mesh)


def test_a_model_learns_the_answers_and_not_the_prompts(chat_folder):
    """Every answer is ANSWER: its tokens' loss goes to ~0, while the prompts (random letters, which a
    model trained on them learns to ~ln 27) stay near their loss at the start."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    cfg = tiny_config(f"data.path={chat_folder}", "data.kind=auto", "parallel.mesh=1", "train.steps=60",
                      "train.seq_len=64", "optim.lr=1e-2")
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    start = jax.device_get(trainer.state["params"])
    trainer.fit(log=MetricsLog(trainer.out, primary=False))
    rows = np.asarray(next(iter(trainer.val_sets.values()))(0))
    ids, trained = token_ids(rows), rows[:, 1:] >= 0
    prompt = ~trained & (ids[:, 1:] >= ord("a")) & (ids[:, 1:] <= ord("z"))  # the prompts' letters

    def losses(params):
        logits = np.asarray(trainer.program.model.apply(params, ids[:, :-1]), np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return nll[trained].mean(), nll[prompt].mean()

    (answer_0, prompt_0), (answer, prompt_end) = losses(start), losses(jax.device_get(trainer.state["params"]))
    assert answer_0 > 4 and answer < 0.05
    assert prompt_end > 0.8 * prompt_0 > 3.5  # never pulled towards ln 27 = 3.3
    trainer.close()


def direct_nll(model, params, rows):
    """Per-target cross-entropy [B, L] of `params` on masked rows by the definition (jnp, from the
    logits of `apply`), and which targets are trained."""
    ids = jnp.asarray(token_ids(rows))
    logp = jax.nn.log_softmax(model.apply(params, ids[:, :-1]).astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0], np.asarray(rows)[:, 1:] >= 0


MOE = ("model.router_aux_loss=0.1", "model.router_z_loss=0.01")  # weights large enough to matter below


def test_a_masked_moe_run_trains_the_router_losses_as_means_over_all_tokens(chat_folder):
    """The objective is the trained tokens' mean cross-entropy plus the router losses (means over
    every token, as without a mask): the first step's gradient norm is that objective's, not one
    with the router losses divided by the trained share; and data=2,expert=2 in 2 microbatches
    (the trained share travels in StepInputs) trains the run of 1 device."""
    from conftest import MOE_TINY

    from meshtrain.objectives.next_token import make_loss_fn

    data = (f"data.path={chat_folder}", "data.kind=auto", "parallel.precision=fp32", "train.seq_len=32", *MOE)
    trainer, reference, _ = run_tiny(*data, "parallel.mesh=1", devices=jax.devices()[:1], config=MOE_TINY)
    model, rows = trainer.program.model, trainer.train_batches(0)
    params = jax.device_get(trainer.program.init_state(jax.random.key(trainer.cfg.train.seed))["params"])
    share = float((np.asarray(rows)[:, 1:] >= 0).mean())
    unmasked = make_loss_fn(model, "fp32")

    def objective(p, router_weight):
        nll, trained = direct_nll(model, p, rows)
        value, metrics = unmasked(p, jnp.asarray(token_ids(rows)))  # the router losses over every token
        return jnp.sum(jnp.where(trained, nll, 0)) / trained.sum() + router_weight * (value - metrics["loss"])

    grad = jax.jit(jax.grad(objective))  # one program for both weights
    norm = lambda weight: float(optax.tree.norm(grad(params, weight)))
    assert 0 < share < 0.5 and abs(norm(1 / share) / norm(1.0) - 1) > 1e-3  # the test tells them apart
    np.testing.assert_allclose(trainer.grad_norms[0], norm(1.0), rtol=1e-5)
    for mesh, n in (("data=2,expert=2", 4), ("pipeline=2", 2)):  # the manual data executor; the pipeline's stages
        _, losses, _ = run_tiny(*data, f"parallel.mesh={mesh}", "parallel.microbatches=2",
                                devices=jax.devices()[:n], config=MOE_TINY)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5, err_msg=mesh)


def test_the_masked_eval_loss_is_the_mean_over_the_eval_sets_trained_tokens(chat_folder):
    """eval_loss = the eval batches' summed trained-token losses over their trained tokens, not the
    mean of the batches' means (which differ here: the batches train different numbers of tokens)."""
    data = (f"data.path={chat_folder}", "data.kind=auto", "parallel.precision=fp32", "train.seq_len=32")
    trainer, _, _ = run_tiny(*data, "parallel.mesh=1", devices=jax.devices()[:1])
    val, batches = next(iter(trainer.val_sets.values())), trainer.cfg.train.eval_batches
    params = jax.device_get(trainer.state["params"])
    sums, counts = zip(*((np.where(t, np.asarray(nll, np.float64), 0).sum(), int(t.sum()))
                         for nll, t in (direct_nll(trainer.program.model, params, val(i)) for i in range(batches))))
    assert len(set(counts)) > 1
    direct, mean_of_means = sum(sums) / sum(counts), np.mean(np.array(sums) / np.array(counts))
    assert abs(mean_of_means / direct - 1) > 1e-4
    np.testing.assert_allclose(trainer.evaluate(), direct, rtol=1e-5)
