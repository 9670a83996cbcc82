"""Tokenizers: round trips, EOS detection, loading errors, the record a run keeps, the vocab check."""
import json

import pytest

from meshtrain.config.loader import UserError, load_config
from meshtrain.data import tokenizer

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n" * 20


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A tiny byte-level BPE trained on a few lines."""
    return tokenizer.train_bpe([TEXT], 300, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def test_byte_round_trip_and_newline_between_documents():
    tok = tokenizer.load("byte")
    ids = tok.encode("héllo ✓")
    assert ids.tolist() == list("héllo ✓".encode()) and tok.decode(ids) == "héllo ✓"
    assert tok.eos_id is None and tokenizer.document_end(tok).tolist() == [10]
    with pytest.raises(UserError, match="token id 300 is not a byte"):
        tok.decode([1, 300])


def test_trained_bpe_round_trips_and_ends_documents_with_its_eos(bpe):
    assert bpe.vocab_size == 300 and bpe.decode([bpe.eos_id]) == "<|endoftext|>"
    for text in ["To be, or not", "unseen wörds ✓ 123", ""]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text and (ids < 300).all() and bpe.eos_id not in ids
    assert len(bpe.encode("To be, or not to be")) < len("To be, or not to be")  # merges were learned
    assert [a.tolist() for a in bpe.encode_batch(["to be", "or not"])] == [bpe.encode("to be").tolist(),
                                                                           bpe.encode("or not").tolist()]
    assert tokenizer.document_end(bpe).tolist() == [bpe.eos_id]


def test_eos_comes_from_tokenizer_config_or_the_files_special_tokens(bpe, tmp_path):
    spec = json.loads(bpe.path.read_text())
    first_free = 300
    spec["added_tokens"] += [{"id": first_free, "content": "</s>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    both = tokenizer.load(str(tmp_path))  # a folder holding tokenizer.json
    assert both.vocab_size == 301 and both.eos_id == bpe.eos_id  # <|endoftext|> is named before </s>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert tokenizer.load(str(tmp_path / "tokenizer.json")).eos_id == first_free
    assert tokenizer.HFTokenizer(tmp_path, eos=7).eos_id == 7
    with pytest.raises(UserError, match="EOS token 'nope' is not in"):
        tokenizer.HFTokenizer(tmp_path, eos="nope")


def test_bad_tokenizer_specs_are_one_line_errors(tmp_path):
    (tmp_path / "garbage.json").write_text("{not json")
    for spec, message in [(str(tmp_path / "missing.json"), "does not exist; pass 'byte', a tokenizer.json"),
                          (str(tmp_path), "holds no tokenizer.json; pass 'byte'"),
                          (str(tmp_path / "garbage.json"), "is not a Hugging Face tokenizer.json"),
                          ("", "is empty; pass 'byte'")]:
        with pytest.raises(UserError, match=message) as e:
            tokenizer.load(spec)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="--vocab-size 100 is below the 256 byte symbols"):
        tokenizer.train_bpe(["abc"], 100, tmp_path / "t.json")


def test_a_folder_records_its_tokenizer(bpe, tmp_path):
    (tmp_path / "byte_run").mkdir()
    tokenizer.record(tmp_path / "byte_run", tokenizer.ByteTokenizer())
    assert tokenizer.for_run(tmp_path / "byte_run").name == "byte"
    (tmp_path / "bpe_run").mkdir()
    tokenizer.record(tmp_path / "bpe_run", bpe)
    again = tokenizer.for_run(tmp_path / "bpe_run")
    assert again.path == tmp_path / "bpe_run" / "tokenizer.json" and again.eos_id == bpe.eos_id
    ids = bpe.encode(TEXT[:80])
    assert again.decode(ids) == TEXT[:80]
    with pytest.raises(UserError, match="records no tokenizer"):
        tokenizer.for_run(tmp_path)


def test_check_config_needs_a_vocabulary_the_tokenizer_fits_in(bpe):
    with pytest.raises(UserError, match=r"model.vocab_size=256 is smaller than the vocabulary of "
                                        r"data.tokenizer \(300 ids, tokenizer .*tokenizer.json\); "
                                        r"set model.vocab_size >= 300"):
        load_config(None, [f"data.tokenizer={bpe.path}", "model.vocab_size=256"])
    fits = load_config(None, [f"data.tokenizer={bpe.path}", "model.vocab_size=320"])
    assert fits.data.tokenizer == str(bpe.path)
    with pytest.raises(UserError, match="model.vocab_size=200 is smaller than the vocabulary of data.tok"):
        load_config(None, ["data.tokenizer=byte", "model.vocab_size=200"])
    # a config naming a tokenizer file that is gone still loads (a finished run's config.yaml)
    assert load_config(None, ["data.tokenizer=/gone/tokenizer.json"]).data.tokenizer == "/gone/tokenizer.json"


def test_encode_adds_what_the_files_template_adds_and_survives_undecodable_bytes(bpe, tmp_path):
    """A Llama-style file prepends BOS (as Hugging Face does by default); bytes that are not UTF-8
    become U+FFFD for the library instead of failing."""
    from tokenizers import Tokenizer, processors

    rust = Tokenizer.from_file(str(bpe.path))
    eos = rust.token_to_id("<|endoftext|>")
    rust.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                        special_tokens=[("<|endoftext|>", eos)])
    rust.save(str(tmp_path / "tokenizer.json"))
    with_bos = tokenizer.HFTokenizer(tmp_path / "tokenizer.json")
    assert list(with_bos.encode("to be")) == [eos, *bpe.encode("to be")]
    assert list(bpe.encode(b"to \xff be".decode("utf-8", "surrogateescape"))) == list(bpe.encode("to \ufffd be"))


def test_the_planner_splits_documents_at_a_named_tokenizers_eos(bpe):
    """data.document_mask without data.eos_id: the planner reads the EOS of the tokenizer file
    data.tokenizer names, as the run does; 'auto' (the data's) and 'byte' give it none."""
    from meshtrain.config.spec import DataConfig
    from meshtrain.planner.aot import named_tokenizer_eos

    assert bpe.eos_id is not None
    assert named_tokenizer_eos(DataConfig(document_mask=True, tokenizer=str(bpe.path))) == bpe.eos_id
    assert named_tokenizer_eos(DataConfig(document_mask=True, tokenizer=str(bpe.path), eos_id=3)) is None  # its own
    assert named_tokenizer_eos(DataConfig(tokenizer=str(bpe.path))) is None  # no mask, no split
    for spec in ("auto", "byte"):
        assert named_tokenizer_eos(DataConfig(document_mask=True, tokenizer=spec)) is None
