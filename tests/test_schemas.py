"""Declared schemas of the files meshtrain reads (meshtrain/core/schema.py): a file of the wrong shape is
one UserError naming the file and the key, never another exception. Each reader (a prepared-data folder's
manifest, a token file's sidecar, run.json, a run's config.yaml, a checkpoint's manifest and metadata,
sweep.json, a Hugging Face config.json and safetensors header, SHA256SUMS, a task file) with Hypothesis
putting any JSON (or YAML) value in its file's place, and concrete cases of each. That the files
meshtrain writes read back: tests/test_schemas_written.py."""
import copy
import json

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meshtrain.core import schema
from meshtrain.core.errors import UserError
from meshtrain.data.tokens import MANIFEST, read_prepared, read_token_file, sidecar
from meshtrain.models import ModelSpec

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
@example(manifest={"dtype": "uint32", "tokens": 0, "shards": [{"file": "s.bin", "tokens": 4}]})
def test_any_manifest_reads_or_is_one_user_error(prepared, manifest):
    """A manifest that reads describes the shard's bytes exactly: its 16 bytes are 8 uint16 tokens or 4
    uint32 ones (a fuzzed run once found the second, which the test had counted as 8)."""
    (prepared / MANIFEST).write_text(json.dumps(manifest))
    try:
        tokens, _ = read_prepared(prepared)
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
    else:
        assert len(tokens) == sum(shard["tokens"] for shard in manifest["shards"])
        assert len(tokens) == 16 // np.dtype(manifest["dtype"]).itemsize * len(manifest["shards"])


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
    check(None, schema.Nullable(int)), check({"x": 1, "y": 2}, schema.Table(int)), check([{}], object)
    check({"num_layers": 2, "other": "keys pass"}, schema.Settings(ModelSpec))
    for value, kind, error in [(True, int, "must hold an integer, not True"), (float("nan"), float, "a number"),
                               ("x" * 100, int, "not 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."),
                               ({"a": [1, "2"]}, {"a": [int]}, "a[1] must be an integer, not '2'"),
                               ({"a": {}}, {"a": {"b": bool}}, "the key a.b is missing"),
                               ("2", schema.Nullable(int), "must hold null or an integer, not '2'"),
                               ({"a\nb": "1"}, schema.Table(int), "'a\\nb' must be an integer, not '1'"),
                               ("a\nb", schema.Line(), "must hold text on one line"),
                               ({"num_layers": 0}, schema.Settings(ModelSpec), "num_layers=0 must be >= 1"),
                               ({"rope_scaling": "ntk"}, schema.Settings(ModelSpec), "rope_scaling must be one of")]:
        with pytest.raises(UserError, match="^f.json: ") as e:
            check(value, kind)
        assert error in str(e.value) and str(e.value).endswith("; fix it")


# ---- every other file meshtrain reads (issue 42, section 1): any JSON (or YAML) value in its place gives a
# result or one UserError line (a checkpoint's manifest may also prove damage), never another exception ----

def one_line(error: UserError, path) -> None:
    assert "\n" not in str(error) and str(path) in str(error), str(error)


def fills(valid: dict):
    """Mappings like `valid`, each key kept, dropped or given any JSON value: Hypothesis reaches past the
    first key."""
    return st.fixed_dictionaries({}, optional={k: st.one_of(st.just(v), JSON) for k, v in valid.items()})


@pytest.fixture(scope="module")
def tiny_cfg():
    from meshtrain.testing import tiny_config

    return tiny_config()


@FUZZ
@given(record=st.one_of(JSON, fills({"identity": None, "starts": [], "data_source": "synthetic data"})),
       identity=fills({"model": {"family": "llama", "num_layers": 4}, "data": "synthetic", "seed": 0,
                       "schedule_steps": 2}),
       model=fills({"family": "llama", "num_layers": 4, "num_heads": 8, "d_model": 32, "head_dim": 0}),
       allow_change=st.booleans())
def test_any_run_json_continues_or_is_one_user_error(tmp_path, tiny_cfg, record, identity, model, allow_change):
    from meshtrain.run import run_dir

    if isinstance(record, dict) and record.get("identity") is None:
        record["identity"] = {**identity, "model": model} if isinstance(identity.get("model"), dict) else identity
    (tmp_path / "run.json").write_text(json.dumps(record))
    try:  # continued() sets the config's horizon: each example its own copy
        run_dir.continued(tmp_path, copy.deepcopy(tiny_cfg), "synthetic", allow_change)
    except UserError as e:
        one_line(e, tmp_path)


@FUZZ
@given(config=st.one_of(JSON, fills({"model": {"num_layers": 2}, "train": {"steps": 3}, "optim": {"lr": 0.1}})))
def test_any_config_yaml_of_a_run_reads_or_is_one_user_error(tmp_path, config):
    from meshtrain.run import run_dir

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    try:
        run_dir.run_config(tmp_path)
    except UserError as e:
        assert "\n" not in str(e)


@FUZZ
@given(manifest=st.one_of(JSON, st.dictionaries(st.sampled_from(["a", "b/c", "../a", "/etc/hostname", "", ".", "a\0"]),
                                                st.one_of(JSON, st.integers(0, 4)))))
def test_any_checkpoint_manifest_checks_or_is_one_user_error(tmp_path, manifest):
    from meshtrain.run.checkpoint import MANIFEST, Damaged, check_manifest

    (tmp_path / "a").write_bytes(b"1234")
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    try:
        check_manifest(tmp_path)
    except UserError as e:
        one_line(e, tmp_path / MANIFEST)
    except Damaged as e:  # a file it lists is missing or of another size: proof of damage
        assert str(e).startswith("file ")


@FUZZ
@given(meta=st.one_of(JSON, fills({"config": {"model": {"family": "llama", "num_layers": 2}}, "mesh": "data=1",
                                    "checksums": [1, 2], "skip_batches": [3], "layer_order": [1, 0],
                                    "spike_detector": {"mean": 2.5, "seen": 3}})))
def test_any_checkpoint_metadata_reads_or_is_one_user_error(tmp_path, meta):
    from meshtrain.models import make_spec
    from meshtrain.run.checkpoint import saved_metadata

    (tmp_path / "metadata").mkdir(exist_ok=True)
    (tmp_path / "metadata" / "metadata").write_text(json.dumps(meta))
    try:
        read = saved_metadata(tmp_path)
    except UserError as e:
        one_line(e, tmp_path / "metadata")
    else:  # what a resume does with it (meshtrain/run/trainer.py `restore`)
        make_spec(read.get("config", {}).get("model", {})).architecture()
        np.argsort(np.asarray(read.get("layer_order", [])))


class Study:
    def __init__(self, out):
        self.user_attrs = {"meshtrain_folder": {"id": "abc", "out": str(out)}}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


@FUZZ
@given(record=st.one_of(JSON, fills({"study": "s", "storage": "sqlite:///db", "id": "abc"})))
def test_any_sweep_json_is_claimed_or_is_one_user_error(tmp_path, record):
    from meshtrain.sweep.folder import RECORD, claim

    (tmp_path / RECORD).write_text(json.dumps(record))
    try:
        claim(tmp_path, "s", "sqlite:///db", lambda: True, lambda: Study(tmp_path), lambda: Study(tmp_path))
    except UserError as e:
        assert "\n" not in str(e)


LLAMA = {"model_type": "llama", "vocab_size": 256, "num_hidden_layers": 2, "hidden_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "rope_scaling": None, "hidden_act": "silu"}


@FUZZ
@given(config=st.one_of(JSON, fills(LLAMA), fills({**LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                                                   "num_experts_per_tok": 2}),
                        fills({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                        fills({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
                        fills({**LLAMA, "model_type": "gemma3_text", "hidden_act": "gelu_pytorch_tanh",
                               "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {"full_attention": {"rope_theta": 1e6}}})))
def test_any_hf_config_json_reads_or_is_one_user_error(tmp_path, config):
    from meshtrain.interop import hf

    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        hf.read_spec(tmp_path)
    except UserError as e:
        one_line(e, tmp_path / "config.json")


@FUZZ
@given(header=st.one_of(JSON, st.dictionaries(st.sampled_from(["w", "__metadata__", "a\nb"]), st.one_of(JSON, fills(
    {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})))))
def test_any_safetensors_header_reads_or_is_one_user_error(tmp_path, header):
    from meshtrain.interop import hf

    text = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + bytes(8))
    try:
        hf.SafetensorsFolder(tmp_path)
    except UserError as e:
        one_line(e, tmp_path / "model.safetensors")


@FUZZ
@given(lines=st.lists(st.one_of(st.text(max_size=80), st.builds(lambda name: "0" * 64 + "  " + name,
                                                                st.sampled_from(["a", "../a", "/a", "b"]))),
                      max_size=3),
       raw=st.binary(max_size=8))
def test_any_sha256sums_checks_or_is_one_user_error(tmp_path, lines, raw):
    from meshtrain.interop import hf

    (tmp_path / "a").write_bytes(b"")
    (tmp_path / hf.SUMS).write_bytes("\n".join(lines).encode() + raw)
    try:
        hf.check_sums(tmp_path)
    except UserError as e:
        one_line(e, tmp_path / hf.SUMS)


@FUZZ
@given(items=st.lists(st.one_of(JSON, fills({"context": "a", "choices": ["x", "y"], "label": 0})), min_size=1,
                      max_size=3),
       raw=st.binary(max_size=6))
def test_any_task_file_reads_or_is_one_user_error(tmp_path, items, raw):
    from meshtrain.data import tasks

    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(json.dumps(item).encode() for item in items) + b"\n" + raw)
    try:
        tasks.read(path)
    except UserError as e:
        one_line(e, path)


def read_run_json(folder):
    from meshtrain.run import run_dir
    run_dir.read_record(folder)


def read_run_config(folder):
    from meshtrain.run import run_dir
    run_dir.run_config(folder)


def read_manifest(folder):
    from meshtrain.run import checkpoint
    (folder / "a").write_bytes(b"1234")
    checkpoint.check_manifest(folder)


def read_metadata(folder):
    from meshtrain.run import checkpoint
    checkpoint.saved_metadata(folder)


def read_sweep_json(folder):
    from meshtrain.sweep.folder import claim
    claim(folder, "s", "sqlite:///db", lambda: True, lambda: Study(folder), lambda: Study(folder))


def read_hf_config(folder):
    from meshtrain.interop import hf
    hf.read_spec(folder)


def read_safetensors(folder):
    from meshtrain.interop import hf
    hf.SafetensorsFolder(folder)


def read_sums(folder):
    from meshtrain.interop import hf
    (folder / "a").write_bytes(b"")
    hf.check_sums(folder)


def read_task(folder):
    from meshtrain.data import tasks
    tasks.read(folder / "t.jsonl")


def header(value) -> bytes:
    text = value if isinstance(value, bytes) else json.dumps(value).encode()
    return len(text).to_bytes(8, "little") + text + bytes(8)


IDENTITY = {"model": {"family": "llama"}, "data": "synthetic", "seed": 0, "schedule_steps": 2}
MOE = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
TENSOR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
REGRESSIONS = {  # file kind -> (file, its reader, [(content, the error's words)]); content: bytes or a JSON value
    "run.json": ("run.json", read_run_json, [
        ({"identity": {**IDENTITY, "seed": "0"}, "starts": []},
         r"run.json: identity.seed must be an integer from 0 to .*, not '0'; it records what defines this run"),
        ({"identity": {**IDENTITY, "model": {"num_heads": 0}}, "starts": []},
         "identity.model.num_heads=0 must be >= 1"),
        ({"identity": {**IDENTITY, "model": {"family": "gpt"}}, "starts": []}, "identity.model.family must be one of"),
        ({"identity": IDENTITY, "starts": [{"at": "now", "step": 0, "steps": 2}]},
         r"the key starts\[0\].changes is missing"),
        ({"identity": IDENTITY}, "the key starts is missing"),
        ({"identity": IDENTITY, "starts": [{"at": "now", "step": 0, "steps": 2, "changes": [], "goodput": {
            "first": 0, "reached": 2, "replayed_steps": 0, "wall_s": 1.0, "seconds": {"compile": "1s"}}}]},
         r"starts\[0\].goodput.seconds.compile must be"),
        ({"identity": IDENTITY, "starts": [], "data_files": [{"path": 3, "from_run": None, "data": "x"}]},
         r"data_files\[0\].path must be"),
        (b'{"identity": "\xff"}', r"is unreadable \(not UTF-8: byte 14 is b'\\xff'\)")]),
    "config.yaml": ("config.yaml", read_run_config, [
        (b"model: {num_layers: x}\n", "config.yaml: model.num_layers='x' is not a valid int"),
        (b"model: [1]\n", "config key 'model' is a section"),
        (b"model: {\xff: 1}\n", "is not UTF-8 text")]),
    "checkpoint manifest": ("meshtrain_manifest.json", read_manifest, [
        ({"a": "4"}, "a must be an integer from 0 to .*, not '4'"),
        ({"../a": 4}, "'../a' is not a file of the checkpoint; delete .* or restore it"),
        ([4], "must hold a mapping, not \\[4\\]"),
        (b"\xff", "is unreadable \\(not UTF-8")]),
    "checkpoint metadata": ("metadata/metadata", read_metadata, [
        ({"config": {"model": {}}, "mesh": 1, "checksums": []}, "mesh must be text, not 1"),
        ({"config": {"model": {}}, "mesh": "data=1"}, "the key checksums is missing"),
        ({"config": {"optim": {}}, "checksums": []}, "the key config.model is missing"),
        ({"config": {"model": {"num_layers": 2}}, "mesh": "data=1", "checksums": [], "layer_order": [0, 0]},
         "layer_order is not an order of the model's layers"),
        ({"config": {"model": {"num_layers": 2**40}}, "mesh": "data=1", "checksums": []},
         "config.model.num_layers=1099511627776 is too large")]),
    "sweep.json": ("sweep.json", read_sweep_json, [
        ({"study": 1, "storage": "sqlite:///db", "id": "abc"}, "study must be text, not 1; restore it"),
        ({"study": "s", "storage": "sqlite:///db"}, "the key id is missing"),
        (b"\xff", "is unreadable \\(not UTF-8")]),
    "config.json": ("config.json", read_hf_config, [
        ({**LLAMA, "num_hidden_layers": "2"}, "num_hidden_layers must be an integer from 1 to"),
        ({**LLAMA, "rope_scaling": [8]}, "rope_scaling must be null or a mapping, not \\[8\\]"),
        ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "lacks 'vocab_size'"),
        ({**MOE, "num_local_experts": -1}, r"\(as meshtrain's config\): model.num_experts=-1 must be"),
        ({**LLAMA, "rope_parameters": {"rope_type": "default"}},
         r"is not a llama config.json meshtrain can read \(KeyError: 'rope_theta'\)"),
        (b'{"model_type": "\xff"}', "is unreadable \\(not UTF-8"),
        (b'{"model_type": ' * 100_000, "is unreadable \\(not JSON")]),
    "safetensors header": ("model.safetensors", read_safetensors, [
        (header({"w": {**TENSOR, "shape": "2"}}), "header: w.shape must be a list, not '2'"),
        (header({"w": {"dtype": "F32", "shape": [2]}}), "header: the key w.data_offsets is missing"),
        (header({"w": {**TENSOR, "data_offsets": [0]}}), "w lies outside the file or has the wrong size"),
        (header([1]), "header: must hold a mapping"),
        (header(b'{"\xff": 1}'), "header is unreadable \\(not UTF-8"),
        (b"\xff" * 8 + b"{}", "cannot be read as safetensors \\(ValueError: a header of")]),
    "SHA256SUMS": ("SHA256SUMS", read_sums, [
        (b"0" * 64 + b"  ../a\n", r"line that is not '<sha256>  <file>': .* \(line 1, a file in the folder\)"),
        (b"0" * 64 + b"  a\n" + b"\xff", "is not UTF-8 text \\(byte 68\\)")]),
    "task jsonl": ("t.jsonl", read_task, [
        (b'{"context": "a", "choices": ["x", "y"], "label": "0"}', "line 1: label must be an integer from 0"),
        (b'{"context": "a", "choices": ["x", "y"], "label": 0}\n{"context": "\xff"}',
         r"t.jsonl line 2 is unreadable \(not UTF-8")]),
}


@pytest.mark.parametrize("kind, case", [(kind, i) for kind, (_, _, cases) in REGRESSIONS.items()
                                        for i in range(len(cases))])
def test_a_file_of_the_wrong_shape_names_the_file_and_the_key(tmp_path, kind, case):
    name, reader, cases = REGRESSIONS[kind]
    content, words = cases[case]
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(UserError, match=words) as e:
        reader(tmp_path)
    one_line(e.value, tmp_path)


def test_checkpoint_metadata_orbax_cannot_decode_is_damage(tmp_path):
    """Not JSON (or not UTF-8): Orbax fails to decode a checkpoint's file, which is proof of damage
    (meshtrain/run/checkpoint.py's module doc), not a UserError."""
    from meshtrain.run import checkpoint

    (tmp_path / "metadata").mkdir()
    (tmp_path / "metadata" / "metadata").write_bytes(b'{"mesh": "\xff')
    with pytest.raises(ValueError) as e:
        checkpoint.saved_metadata(tmp_path)
    assert isinstance(checkpoint._as_damage(e.value), checkpoint.Damaged)
