"""No silent wrong training (issue 57, classes 1 and 2): data that trains nothing or the wrong thing is
refused before a step runs (prepare's checks of chat rows and preference pairs, an objective that does
not read the folder's kind, a loss mask with no trained token, a step whose batch trains none), and a
prepared folder's bytes are the ones prepare hashed."""
import hashlib
import json
import os
import re
from collections import Counter

import jax
import numpy as np
import pytest
from conftest import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.core.errors import UserError
from meshtrain.data import chat, degenerate, tokenizer
from meshtrain.data.prepare import prepare, tokenize
from meshtrain.data.sources import units
from meshtrain.data.tokens import DATA_KINDS, read_prepared
from meshtrain.objectives import OBJECTIVES, check_data
from meshtrain.run.trainer import Trainer

BYTE = tokenizer.ByteTokenizer()
CHATML = chat.load_format("chatml", BYTE)
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write_rows(path, rows) -> list[str]:
    """`rows` as jsonl; each row's location as prepare names it."""
    wheres, at = [], 0
    with open(path, "w") as f:
        for row in rows:
            line = json.dumps(row) + "\n"
            wheres.append(f"{path}, line at byte {at}")
            f.write(line)
            at += len(line.encode())
    return wheres


roles = st.sampled_from(["user", "assistant", "system", "Assistant", "bot"])
contents = st.sampled_from(["", "hi", "the answer is 42", "ok"])
conversations = st.lists(st.lists(st.tuples(roles, contents), min_size=1, max_size=4), min_size=1, max_size=6)


def chat_expected(rows) -> Counter:
    """The reasons prepare must give, counted by row, from the rows alone (chatml renders every
    non-empty content as tokens)."""
    expected = Counter()
    for messages in rows:
        found = {r for r, _ in messages}
        for role in found - set(degenerate.KNOWN_ROLES):
            expected[f"role {role!r} is not one of {', '.join(degenerate.KNOWN_ROLES)}"] += 1
        if "assistant" not in found:
            expected["no assistant turn"] += 1
    return expected


@pytest.mark.fast
@PROPERTY
@given(rows=conversations)
def test_prepare_refuses_chat_rows_that_train_nothing_or_keeps_them_with_their_counts(tmp_path_factory, rows):
    """Any chat rows: prepare succeeds exactly when every row has only known roles and an assistant
    turn; otherwise its one error names a fault of the first row holding one. Allowed, the counts
    it warns of are the rows', and only data whose mask trains no token is still refused."""
    tmp = tmp_path_factory.mktemp("chat")
    src = tmp / "rows.jsonl"
    wheres = write_rows(src, [{"messages": [{"role": r, "content": c} for r, c in m]} for m in rows])
    expected = chat_expected(rows)
    # chatml's assistant turn ends with <|im_end|>: every assistant turn renders tokens, so none is untrained
    first_bad = next((i for i, m in enumerate(rows) if chat_expected([m])), None)
    args = dict(text_field="messages", chat=CHATML)
    if first_bad is None:
        manifest = prepare(str(src), BYTE, tmp / "strict", **args)
        assert manifest["trained_tokens"] > 0
    else:
        with pytest.raises(UserError, match="holds rows that train nothing or the wrong thing") as e:
            prepare(str(src), BYTE, tmp / "strict", **args)
        assert f"the first at {wheres[first_bad]}" in str(e.value) and "--allow-degenerate-rows" in str(e.value)
        assert not (tmp / "strict").exists()  # nothing written
    allowed = degenerate.Degenerate(str(src), True)
    trains = any("assistant" in {r for r, _ in m} for m in rows)
    if not trains:
        with pytest.raises(UserError, match="no token of its assistant turns is trained"):
            prepare(str(src), BYTE, tmp / "allowed", allow_degenerate=True, **args)
        return
    for unit in units("jsonl", str(src)):
        allowed.add(tokenize(unit, BYTE, "messages", CHATML).faults)
    assert {reason: n for reason, (n, _) in allowed.faults.items()} == dict(expected)
    manifest = prepare(str(src), BYTE, tmp / "allowed", allow_degenerate=True, **args)
    assert manifest["trained_tokens"] > 0


pairs = st.lists(st.tuples(st.sampled_from(["q ", "why? "]), st.sampled_from(["", " ", "yes", "no"]),
                           st.sampled_from(["", "yes", "no"])), min_size=1, max_size=6)


@pytest.mark.fast
@PROPERTY
@given(rows=pairs)
def test_prepare_refuses_identical_and_empty_preference_pairs(tmp_path_factory, rows):
    tmp = tmp_path_factory.mktemp("pairs")
    src = tmp / "pairs.jsonl"
    wheres = write_rows(src, [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows])
    faults = [(c == r, not (c.strip() and r.strip())) for _, c, r in rows]
    first_bad = next((i for i, f in enumerate(faults) if any(f)), None)
    if first_bad is None:
        assert prepare(str(src), BYTE, tmp / "out", preference=True)["pairs"] == len(rows)
        return
    with pytest.raises(UserError) as e:
        prepare(str(src), BYTE, tmp / "out", preference=True)
    said = str(e.value)
    assert f"the first at {wheres[first_bad]}" in said
    assert ("chosen and rejected are identical" in said) == any(same for same, _ in faults)
    assert ("a response (chosen or rejected) is blank or has no token" in said) == any(empty for _, empty in faults)
    if any(c or r for _, c, r in rows):  # some response has tokens: allowed, it is prepared
        assert prepare(str(src), BYTE, tmp / "kept", preference=True, allow_degenerate=True)["pairs"] == len(rows)


@pytest.mark.fast
def test_a_response_holding_another_turn_is_one_error_naming_it(tmp_path):
    src = tmp_path / "hh.jsonl"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    write_rows(src, [{"prompt": "hi", "chosen": conversation, "rejected": "go away"}])
    with pytest.raises(UserError, match=r"hh.jsonl, line at byte 0: chosen holds a 'user' turn; a response is the "
                                        r"assistant's answer alone: put the turns before it in prompt"):
        prepare(str(src), BYTE, tmp_path / "out", preference=True, chat=CHATML)


class Source:
    def __init__(self, path):
        self.path = path


class Mix:
    def __init__(self, kinds):
        self.kinds, self.sources = kinds, [Source(f"/data/{k}") for k in kinds]


@pytest.mark.fast
@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("kind", list(DATA_KINDS))
def test_an_objective_refuses_data_of_a_kind_it_does_not_train_on(name, kind):
    """Every registered objective against every kind of data: refused exactly where the objective does
    not read that kind, in one line naming the data, what it holds, and the objective that reads it."""
    reads = OBJECTIVES[name].reads
    if kind in reads:
        check_data(name, Mix([kind]))
        return
    with pytest.raises(UserError) as e:
        check_data(name, Mix([kind]))
    said = str(e.value)
    assert said.startswith(f"data.path /data/{kind} holds {DATA_KINDS[kind]}; train.objective={name} trains on")
    readers = [o for o, cls in OBJECTIVES.items() if kind in cls.reads]
    assert (f"set train.objective={readers[0]}" in said) == bool(readers) and "\n" not in said
    with pytest.raises(UserError, match=rf"data.sources\[1\] \(/data/{kind}\) holds"):
        check_data(name, Mix([reads[0], kind]))  # a mixture names the source


def zero_the_mask(folder):
    """The folder as a version before prepare refused it wrote it: a loss mask that trains no token."""
    manifest = json.loads((folder / "manifest.json").read_text())
    masks = sorted(folder.glob("*.mask"))
    for m in masks:
        m.write_bytes(bytes(m.stat().st_size))
    manifest["mask_sha256"] = hashlib.sha256(b"".join(m.read_bytes() for m in masks)).hexdigest()
    manifest["trained_tokens"] = 0
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_runs_that_would_train_nothing_stop_with_one_line(tmp_path):
    """A folder whose mask trains no token is refused before any step; a batch with no trained token
    (answers short beside long questions, one short window a step) stops the run at that step, before
    its record: no `loss 0.0000` is logged as if it converged."""
    src = tmp_path / "long.jsonl"
    write_rows(src, [{"messages": [{"role": "user", "content": f"a long question number {i} " * 12},
                                   {"role": "assistant", "content": "ok"}]} for i in range(12)])
    folder = tmp_path / "long"
    prepare(str(src), BYTE, folder, text_field="messages", chat=CHATML)
    overrides = (f"data.path={folder}", "data.kind=prepared", "train.batch_size=1", "train.seq_len=16",
                 "parallel.mesh=1", "train.log_every=1", "train.steps=20", "data.val_fraction=0")
    trainer = Trainer(tiny_config(*overrides, out=str(tmp_path / "run")), devices=jax.devices()[:1])
    with pytest.raises(UserError, match=r"step \d+'s batch holds no trained token: the loss mask \(data.train_on="
                                        r"assistant\) marks none of its 1 x 16 tokens"):
        trainer.fit()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] > 0 for r in logged if "loss" in r)

    zero_the_mask(folder)
    with pytest.raises(UserError, match=f"{folder}: its loss mask trains no token"):
        Trainer(tiny_config(*overrides, out=str(tmp_path / "run2")), devices=jax.devices()[:1])
    assert not (tmp_path / "run2").exists()


@pytest.mark.fast
@PROPERTY
@given(data=st.data())
def test_any_changed_byte_of_a_prepared_folder_is_refused_naming_its_file(tmp_path_factory, data):
    """Flip any byte of any shard or loss mask of a prepared chat folder: reading it is one error
    naming the shard (a mask: the mask files), and the folder as prepared reads."""
    tmp = tmp_path_factory.mktemp("bytes")
    src = tmp / "chat.jsonl"
    write_rows(src, [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                     for i in range(20)])
    folder = tmp / "out"
    prepare(str(src), BYTE, folder, text_field="messages", chat=CHATML, shard_tokens=100)
    files = sorted(folder.glob("shard-*.bin")) + sorted(folder.glob("shard-*.mask"))
    victim = data.draw(st.sampled_from(files))
    at = data.draw(st.integers(0, victim.stat().st_size - 1))
    original = victim.read_bytes()
    changed = bytearray(original)
    changed[at] ^= 1 << data.draw(st.integers(0, 7))
    victim.write_bytes(bytes(changed))
    os.utime(victim, ns=(0, 0))  # its times set back: the cache must not vouch for it
    named = victim.name if victim.suffix == ".bin" else "the .mask files"
    with pytest.raises(UserError, match=f"the bytes of {named} are not the ones prepare wrote"):
        read_prepared(folder)
    victim.write_bytes(original)
    tokens, _ = read_prepared(folder)
    assert np.asarray(tokens.unmasked()).size == sum(f.stat().st_size for f in folder.glob("shard-*.mask"))


@pytest.mark.fast
@PROPERTY
@given(st.lists(st.sampled_from(["", "", "a", " ", "text"]), min_size=1, max_size=5), st.booleans())
def test_plain_documents_that_are_all_empty_are_refused_on_prepare_and_on_load(tmp_path_factory, texts, as_file):
    """A source whose documents are all empty would train their end tokens alone: refused as prepare
    writes it and as a run tokenizes it on load; one with any text (a space counts) is taken."""
    from meshtrain.config.loader import load_config
    from meshtrain.data.corpus import load_corpus

    folder = tmp_path_factory.mktemp("plain")
    src = folder / ("doc.txt" if as_file else "rows.jsonl")
    if as_file:
        src.write_text(texts[0])
        texts = texts[:1]
    else:
        write_rows(src, [{"text": t} for t in texts])
    refused = f"{src} holds {len(texts):,} document(s), all empty: only their end tokens would be trained"
    attempts = [lambda: prepare(str(src), BYTE, folder / "out", 1),
                lambda: load_corpus(load_config(None, [f"data.path={src}", "model.vocab_size=256"]).data, 256)]
    for attempt in attempts:
        if any(texts):
            attempt()
        else:
            with pytest.raises(UserError, match=f"^{re.escape(refused)}"):
                attempt()


class StartToken(tokenizer.ByteTokenizer):
    """The byte tokenizer with a start token before every text, as Llama's tokenizers add one."""

    def encode_batch(self, texts):
        return [np.concatenate([[1], ids]).astype(ids.dtype) for ids in super().encode_batch(texts)]


@pytest.mark.fast
def test_empty_documents_are_refused_where_the_tokenizer_adds_a_start_token(tmp_path):
    write_rows(tmp_path / "empty.jsonl", [{"text": ""}] * 3)
    with pytest.raises(UserError, match="holds 3 document.s., all empty"):
        prepare(str(tmp_path / "empty.jsonl"), StartToken(), tmp_path / "out", 1)
    write_rows(tmp_path / "one.jsonl", [{"text": ""}, {"text": "a"}])
    prepare(str(tmp_path / "one.jsonl"), StartToken(), tmp_path / "out", 1)
