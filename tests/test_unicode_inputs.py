"""Text is valid Unicode or one error (issue 57, class 3): every text reader (plain text, jsonl text,
chat and preference rows, task files, YAML configs, --set values, train-tokenizer's files; Arrow's
writers refuse surrogates, and Parquet strings that are not UTF-8 are one error)
refuses bytes that are not UTF-8 and lone surrogates in one line naming the file and line, and reads
the same text without the fault as before."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.config.loader import UserError, load_config, split_override
from meshtrain.core import unicode
from meshtrain.data import chat, tasks, tokenizer
from meshtrain.data.prepare import prepare
from meshtrain.data.tokenizer import train_bpe

BYTE = tokenizer.ByteTokenizer()
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
words = st.text(st.characters(codec="utf-8", exclude_characters="\n\r\"\\"), min_size=1, max_size=12)
lines = st.lists(words, min_size=1, max_size=5)
bad_bytes = st.sampled_from([b"\xff", b"\xfe", b"\xc3", b"\xed\xa0\x80", b"\x80"])  # \xed\xa0\x80: UTF-8 of U+D800
surrogates = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}")


def jsonl(rows, field="text") -> str:
    return "".join(json.dumps({field: r}, ensure_ascii=False) + "\n" for r in rows)


@pytest.mark.fast
@PROPERTY
@given(rows=lines, at=st.integers(0, 10), bad=bad_bytes, data=st.data())
def test_a_byte_that_is_not_utf8_is_one_error_naming_the_line(tmp_path_factory, rows, at, bad, data):
    """The byte anywhere in a text file, a jsonl source's row or a task file's line: one error naming the
    file and line; the file without it reads."""
    tmp = tmp_path_factory.mktemp("bytes")
    line = data.draw(st.integers(0, len(rows) - 1))
    text_lines = [r.encode() for r in rows]
    cut = min(at, len(text_lines[line]))
    broken = text_lines[:line] + [text_lines[line][:cut] + bad + text_lines[line][cut:]] + text_lines[line + 1:]
    (tmp / "doc.txt").write_bytes(b"\n".join(broken) + b"\n")
    with pytest.raises(UserError, match=rf"doc.txt, line {line + 1}: byte .* is not UTF-8 .*; save the source as "
                                        r"valid UTF-8 text$"):
        prepare(str(tmp / "doc.txt"), BYTE, tmp / "out")
    rows_bytes = [json.dumps({"text": r}, ensure_ascii=False).encode() for r in rows]
    at_byte = sum(len(r) + 1 for r in rows_bytes[:line])
    rows_bytes[line] = rows_bytes[line][:10] + bad + rows_bytes[line][10:]  # inside the text's quotes
    (tmp / "doc.jsonl").write_bytes(b"\n".join(rows_bytes) + b"\n")
    with pytest.raises(UserError, match=rf"doc.jsonl, line at byte {at_byte}: byte .* into the line\) is not UTF-8"):
        prepare(str(tmp / "doc.jsonl"), BYTE, tmp / "out")
    (tmp / "doc.txt").write_bytes(b"\n".join(text_lines) + b"\n")
    assert prepare(str(tmp / "doc.txt"), BYTE, tmp / "out")["documents"] == 1


@pytest.mark.fast
@PROPERTY
@given(rows=lines, escape=surrogates, data=st.data())
def test_a_lone_surrogate_is_one_error_in_every_json_and_yaml_reader(tmp_path_factory, rows, escape, data):
    """A "\\udXXX" escape in jsonl text, a chat message, a preference response, a task
    file's choice, a YAML config or a --set value: one error naming where it is."""
    tmp = tmp_path_factory.mktemp("surrogates")
    line = data.draw(st.integers(0, len(rows) - 1))
    texts = [json.dumps(r, ensure_ascii=False) for r in rows]
    texts[line] = texts[line][:-1] + escape + '"'
    (tmp / "t.jsonl").write_text("".join('{"text": ' + t + "}\n" for t in texts))
    at = sum(len(('{"text": ' + t + "}\n").encode()) for t in texts[:line])
    lone = rf"the text holds a lone surrogate U\+{escape[2:].upper()} at character \d+, which is not valid Unicode"
    with pytest.raises(UserError, match=rf"t.jsonl, line at byte {at}: {lone}"):
        prepare(str(tmp / "t.jsonl"), BYTE, tmp / "out")
    conversation = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ' + \
        texts[line] + "}]}\n"
    (tmp / "c.jsonl").write_text(conversation)
    with pytest.raises(UserError, match=rf"c.jsonl, line at byte 0: {lone}"):
        prepare(str(tmp / "c.jsonl"), BYTE, tmp / "c", text_field="messages", chat=chat.load_format("chatml", BYTE))
    (tmp / "p.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": ' + texts[line] + "}\n")
    with pytest.raises(UserError, match=rf"p.jsonl, line at byte 0: {lone}"):
        prepare(str(tmp / "p.jsonl"), BYTE, tmp / "p", preference=True)
    (tmp / "task.jsonl").write_text('{"context": "c", "choices": ["x", ' + texts[line] + '], "label": 0}\n')
    with pytest.raises(UserError, match=rf"task.jsonl line 1: {lone}"):
        tasks.read(tmp / "task.jsonl")
    (tmp / "c.yaml").write_text('train: {out_note: "' + escape + '"}\nout: "runs/' + escape + '"\n')
    with pytest.raises(UserError, match=rf"c.yaml: {lone}"):
        load_config(str(tmp / "c.yaml"))
    with pytest.raises(UserError, match=rf"--set 'out=runs/\?': {lone}"):
        split_override("out=runs/" + chr(int(escape[2:], 16)))


@pytest.mark.fast
def test_train_tokenizer_names_the_line_of_an_undecodable_byte_in_any_chunk(tmp_path):
    """train-tokenizer reads text files in chunks of whole lines: the line is counted across chunks."""
    src = tmp_path / "big.txt"
    src.write_bytes(b"fine line\n" * 5000 + b"bad \xff byte\n" + b"more\n")
    with pytest.raises(UserError, match=r"big.txt, line 5,001: byte b'\\xff' \(offset \d+\) is not UTF-8"):
        list(tokenizer._texts([src], chunk_chars=4096))
    src.write_bytes(b"fine line\n" * 50)
    train_bpe([src], 300, tmp_path / "tok.json")


@pytest.mark.fast
def test_check_walks_nested_values_and_passes_valid_text():
    value = {"a": ["ok", ("é", {"k": "😀"})]}
    assert unicode.check(value, "w", "fix") is value
    with pytest.raises(UserError, match=r"^w: the text holds a lone surrogate U\+DC80 at character 1"):
        unicode.check({"a": ["ok", ("x\udc80", )]}, "w", "fix")
    with pytest.raises(UserError, match=r"^w: the text holds a lone surrogate U\+D800"):
        unicode.check({"\ud800": 1}, "w", "fix")


@pytest.mark.fast
def test_a_byte_order_mark_is_no_part_of_the_text(tmp_path):
    """An editor's BOM before a text file or a jsonl file is not trained: the tokens are those of the
    file without it."""
    for name, body in (("a.txt", "hello world\n"), ("a.jsonl", '{"text": "hello"}\n{"text": "world"}\n')):
        (tmp_path / name).write_text(body)
        (tmp_path / ("bom-" + name)).write_bytes(b"\xef\xbb\xbf" + body.encode())
        plain = prepare(str(tmp_path / name), BYTE, tmp_path / f"out-{name}")
        marked = prepare(str(tmp_path / ("bom-" + name)), BYTE, tmp_path / f"out-bom-{name}")
        assert marked["sha256"] == plain["sha256"]
