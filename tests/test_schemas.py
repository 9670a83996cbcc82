"""Declared schemas of the files meshtrain reads (meshtrain/core/schema.py): a file of the wrong shape is
one UserError naming the file and the key, never another exception. The readers of a prepared-data
folder's manifest and of a token file's sidecar, with Hypothesis putting any JSON value in their place."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.core import schema
from meshtrain.core.errors import UserError
from meshtrain.data.tokens import MANIFEST, read_prepared, read_token_file, sidecar

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8)),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=12)
# A manifest's own keys, so Hypothesis also reaches the shards and their fields.
MANIFESTS = st.fixed_dictionaries({}, optional={"dtype": st.one_of(JSON, st.sampled_from(["uint16", "uint32"])),
                                                "tokens": st.one_of(JSON, st.integers(0, 64)),
                                                "shards": st.one_of(JSON, st.lists(st.fixed_dictionaries(
                                                    {}, optional={"file": st.one_of(JSON, st.just("s.bin")),
                                                                  "tokens": st.one_of(JSON, st.integers(0, 64))}),
                                                    max_size=2))})
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def prepared(tmp_path):
    """A prepared folder of one 8-token shard; the test writes its manifest."""
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "s.bin")
    return tmp_path


def test_the_manifest_of_the_issue_is_one_line(prepared):
    (prepared / MANIFEST).write_text(json.dumps({"shards": 7, "dtype": 3}))
    with pytest.raises(UserError, match=rf"^{prepared / MANIFEST}: dtype must be one of 'uint16', 'uint32', not 3; "
                                        r"prepare the data again$"):
        read_prepared(prepared)


@pytest.mark.parametrize("manifest, error", [
    ({"dtype": "uint16", "tokens": 8, "shards": 7}, "shards must be a list, not 7"),
    ({"dtype": "uint16", "tokens": 8, "shards": [{"file": "../s.bin", "tokens": 8}]},
     "shards[0].file must be a file name in the folder, not '../s.bin'"),
    ({"dtype": "uint16", "tokens": 8, "shards": [{"file": "s.bin"}]}, "the key shards[0].tokens is missing"),
    ({"dtype": "uint16", "tokens": True, "shards": []}, "tokens must be an integer from 0 to"),
    ({"dtype": "uint16", "tokens": -1, "shards": []}, "tokens must be an integer from 0 to"),
    ([1, 2], "must hold a mapping, not [1, 2]"),
])
def test_a_manifest_of_the_wrong_shape_names_its_key(prepared, manifest, error):
    (prepared / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError) as e:
        read_prepared(prepared)
    assert str(e.value).startswith(str(prepared / MANIFEST)) and error in str(e.value)


def test_a_manifest_that_is_not_json_or_not_utf8_is_one_line(prepared):
    (prepared / MANIFEST).write_bytes(b"\xff\xfe{")
    with pytest.raises(UserError, match="is unreadable .*; prepare the data again$"):
        read_prepared(prepared)


def test_a_sidecar_of_the_wrong_shape_names_its_key(prepared):
    sidecar(prepared / "s.bin").write_text(json.dumps({"dtype": "uint16", "tokenizer": "bytes", "vocab_size": "256"}))
    with pytest.raises(UserError, match=r"s\.bin\.json: vocab_size must be an integer from 1 to .*, not '256'"):
        read_token_file(prepared / "s.bin")


@FUZZ
@given(manifest=MANIFESTS)
def test_any_manifest_reads_or_is_one_user_error(prepared, manifest):
    (prepared / MANIFEST).write_text(json.dumps(manifest))
    try:
        tokens, _ = read_prepared(prepared)
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
    else:
        assert len(tokens) == 8 * len(manifest["shards"])


@FUZZ
@given(meta=JSON)
def test_any_sidecar_reads_or_is_one_user_error(prepared, meta):
    sidecar(prepared / "s.bin").write_text(json.dumps(meta))
    try:
        read_token_file(prepared / "s.bin")
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 400


def test_the_schema_forms():
    check = lambda value, kind: schema.check(value, kind, "f.json", "fix it")
    check({"a": 1, "later": "fields are allowed"}, {"a": int, "b": schema.Optional(str)})
    check(2.0, float), check(2, float), check(["x"], [str]), check("uint32", ("uint16", "uint32"))
    for value, kind, error in [(True, int, "must hold an integer, not True"), (float("nan"), float, "a number"),
                               ("x" * 100, int, "not 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."),
                               ({"a": [1, "2"]}, {"a": [int]}, "a[1] must be an integer, not '2'"),
                               ({"a": {}}, {"a": {"b": bool}}, "the key a.b is missing")]:
        with pytest.raises(UserError, match="^f.json: ") as e:
            check(value, kind)
        assert error in str(e.value) and str(e.value).endswith("; fix it")
