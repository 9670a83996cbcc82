"""Hugging Face import/export against transformers itself (CPU torch, random weights from small
configs, nothing downloaded): logits, bitwise round trips, sharded loading, fine-tuning via the CLI."""
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshtrain import convert  # noqa: E402
from meshtrain.config.loader import UserError, load_config  # noqa: E402
from meshtrain.interop import hf  # noqa: E402
from meshtrain.models import FAMILIES  # noqa: E402
from meshtrain.parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from meshtrain.parallel.sharding import param_shardings  # noqa: E402
from meshtrain.run import run_dir  # noqa: E402
from meshtrain.testing import max_param_diff, run_tiny  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.2, rms_norm_eps=1e-5)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 48))


def save_hf(folder, kind="llama", **overrides):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(intermediate_size=128, rope_theta=500000.0, **{**COMMON, **overrides})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                            **{**COMMON, **overrides})
        model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(folder)
    return folder


def hf_logits(folder, tokens=TOKENS):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def imported(folder, mesh=None):
    spec = hf.read_spec(folder)
    model = FAMILIES[spec.family](spec)
    mesh = mesh or build_mesh(parse_mesh("1", 1), jax.devices()[:1])
    return model, hf.load_params(folder, model, param_shardings(model, mesh))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # short, so scaled frequencies matter at 48 tokens
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5}  # cos and sin x 1.06: the factor counts too


@pytest.mark.parametrize("kind, overrides", [
    ("llama", dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE)),
    ("llama", dict(tie_word_embeddings=True)),
    ("llama", dict(tie_word_embeddings=False, rope_scaling=YARN_ROPE)),
    ("mixtral", dict(tie_word_embeddings=False)),
])
def test_import_reproduces_transformers_logits(tmp_path, kind, overrides):
    folder = save_hf(tmp_path / "hf", kind, **overrides)
    model, params = imported(folder)
    assert model.cfg.tie_embeddings == overrides["tie_word_embeddings"]
    assert model.cfg.rope_scaling == overrides.get("rope_scaling", {}).get("rope_type", "none")
    ours, theirs = np.asarray(model.apply(params, TOKENS)), hf_logits(folder)
    assert np.abs(theirs).max() > 1.0  # logits large enough for the comparison to mean something
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.fast
@pytest.mark.parametrize("rope", [YARN_ROPE, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                              "original_max_position_embeddings": 4096},  # DeepSeek-V3's
                                  {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}])
def test_yarn_frequencies_and_factor_are_transformers(rope):
    """models/rope.py's yarn rope equals transformers' own init function: inverse frequencies and the
    factor on cos and sin (m(mscale) / m(mscale_all_dim), or m(1) without them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from meshtrain.models.rope import rope_attention_factor, rope_frequencies
    from meshtrain.models.spec import HFConfig

    config = transformers.LlamaConfig(**{**COMMON, "head_dim": 32, "max_position_embeddings": int(
        rope["factor"] * rope["original_max_position_embeddings"]), "rope_parameters": {**rope, "rope_theta": 5e4}})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    spec = FAMILIES["llama"].hf.read(HFConfig({**config.to_dict(), "intermediate_size": 128}, "config.json"))
    assert spec.rope_scaling == "yarn" and spec.head_dim == 32
    np.testing.assert_allclose(np.asarray(rope_frequencies(spec)), inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(spec) == pytest.approx(factor, rel=1e-12)


def test_rope_scaling_changes_the_function(tmp_path):
    """Without model.rope_scaling the imported Llama 3.x weights would not give their logits."""
    folder = save_hf(tmp_path / "hf", rope_scaling=LLAMA3_ROPE)
    model, params = imported(folder)
    plain = FAMILIES["llama"](dataclasses.replace(model.cfg, rope_scaling="none"))
    assert np.abs(np.asarray(plain.apply(params, TOKENS)) - hf_logits(folder)).max() > 1e-2


@pytest.mark.parametrize("mesh", ["fsdp=2,tensor=2", "pipeline=2,expert=2"])  # layers and experts split too
def test_sharded_import_reads_each_shard_and_equals_one_device(tmp_path, mesh):
    folder = save_hf(tmp_path / "hf", "mixtral")
    _, one = imported(folder)
    _, sharded = imported(folder, build_mesh(parse_mesh(mesh, 4), jax.devices()[:4]))
    assert max_param_diff(jax.device_get(sharded), jax.device_get(one)) == 0
    experts = sharded["blocks"]["expert_gate"]  # [layers, experts, D, F]: split 4 ways on either mesh
    assert all(s.data.size * 4 == experts.size for s in experts.addressable_shards)


def test_cli_fine_tunes_imported_weights_and_exports_them_bitwise(tmp_path):
    """convert --from-hf writes a run config; training starts from the weights (step 0's loss is the
    Hugging Face model's); export of that checkpoint gives back the same bytes and config."""
    folder = save_hf(tmp_path / "hf", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)
    run = tmp_path / "run"
    assert convert.main(["--from-hf", str(folder), "--out", str(run)]) == 0
    from meshtrain.run.trainer import Trainer

    cfg = load_config(str(run / "config.yaml"), ["data.kind=synthetic", "train.steps=2", "train.batch_size=2",
                                                 "train.seq_len=16", "parallel.mesh=fsdp=2,tensor=2",
                                                 "train.log_every=1", "train.eval_every=0"])
    trainer = Trainer(cfg, devices=jax.devices()[:4])
    _, start = imported(folder)
    assert max_param_diff(jax.device_get(trainer.state["params"]), jax.device_get(start)) == 0
    trainer.save_checkpoint(wait=True)
    assert convert.main(["--to-hf", str(run), str(tmp_path / "back"), "--mesh", "fsdp=-1"]) == 0
    original, back = hf.SafetensorsFolder(folder), hf.SafetensorsFolder(tmp_path / "back")
    assert original.tensors.keys() == back.tensors.keys()
    for name, x in original.tensors.items():
        assert x.dtype == back.get(name).dtype and np.array_equal(x.view(np.uint8), back.get(name).view(np.uint8))
    assert hf.read_spec(tmp_path / "back") == hf.read_spec(folder)
    history = trainer.fit()
    tokens = torch.tensor(np.asarray(trainer.train_batches(0))).long()  # [B, L + 1]: step 1's batch
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        hf_loss = hf_model(tokens, labels=tokens).loss.item()  # predicts tokens 1..L, as meshtrain does
    assert abs(history[0]["loss"] - hf_loss) < 1e-4


def test_export_of_a_trained_run_loads_in_transformers(tmp_path):
    """A run trained by meshtrain (configs/tiny.yaml: tied head) exported in several fp32 files:
    from_pretrained reproduces meshtrain's logits."""
    trainer, _, _ = run_tiny("parallel.mesh=1", devices=jax.devices()[:1])
    trainer.save_checkpoint(wait=True)
    files = convert.to_hf(str(trainer.out), str(tmp_path / "hf"), "float32", 60_000, "fsdp=-1")
    assert len(files) > 1 and (tmp_path / "hf" / hf.INDEX).is_file()
    index = json.loads((tmp_path / "hf" / hf.INDEX).read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    ours = np.asarray(trainer.program.model.apply(trainer.unpermuted_params(), TOKENS))
    np.testing.assert_allclose(hf_logits(tmp_path / "hf"), ours, atol=1e-4, rtol=0)


def test_host_params_export_and_a_llama3_config_loads(tmp_path):
    """numpy parameters export layer by layer; Llama 3.1's rope settings give a config.json that
    transformers accepts (max_position_embeddings an int: 8192 x 8)."""
    folder = save_hf(tmp_path / "hf")
    model, params = imported(folder)
    hf.save_params(jax.device_get(params), model.cfg, tmp_path / "np")
    a, b = hf.SafetensorsFolder(folder), hf.SafetensorsFolder(tmp_path / "np")
    assert all(np.array_equal(a.get(n), b.get(n)) for n in a.tensors)
    llama31 = dataclasses.replace(model.cfg, rope_scaling="llama3", rope_original_max_len=8192)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(hf.hf_config(llama31)))
    assert transformers.AutoConfig.from_pretrained(tmp_path / "cfg").max_position_embeddings == 65536
    assert hf.read_spec(tmp_path / "cfg") == llama31


def test_bfloat16_export_round_trips(tmp_path):
    folder = save_hf(tmp_path / "hf")
    model, params = imported(folder)
    hf.save_params(params, model.cfg, tmp_path / "bf16", dtype="bfloat16")
    _, again = imported(tmp_path / "bf16")
    hf.save_params(again, model.cfg, tmp_path / "bf16_again", dtype="bfloat16")
    a, b = hf.SafetensorsFolder(tmp_path / "bf16"), hf.SafetensorsFolder(tmp_path / "bf16_again")
    assert all(np.array_equal(a.get(n).view(np.uint16), b.get(n).view(np.uint16)) for n in a.tensors)
    model_bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert next(model_bf16.parameters()).dtype == torch.bfloat16


def test_errors_name_the_problem(tmp_path, capsys):
    folder = save_hf(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        hf.read_spec(tmp_path / "gpt2")
    (tmp_path / "bias").mkdir()
    (tmp_path / "bias" / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(UserError, match="attention_bias=True is not implemented"):
        hf.read_spec(tmp_path / "bias")
    model = FAMILIES["llama"](dataclasses.replace(hf.read_spec(folder), d_model=32))
    with pytest.raises(UserError, match=r"has model.d_model=64, this run has 32; .*convert --from-hf"):
        run_dir.initial_params(f"hf:{folder}", model, None)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    capsys.readouterr()
    assert convert.main(["--from-hf", str(folder), "--out", str(tmp_path / "taken")]) == 2
    assert capsys.readouterr().err.startswith("error: ") and sorted(Path(tmp_path / "taken").iterdir()) == \
        [tmp_path / "taken" / "x"]
    assert convert.main(["--from-hf", str(folder), "--out", str(tmp_path / "new"), "--step", "3"]) == 2
    assert capsys.readouterr().err == "error: --step chooses the checkpoint --to-hf or --quantize reads; --from-hf " \
                                      "has none\n" and not (tmp_path / "new").exists()


def test_tensors_the_config_does_not_describe_are_refused(tmp_path):
    """An import accounts for every tensor: a config.json saying fewer layers than its files hold, or a
    file with a tensor no model part reads, is one error, not a model read in part."""
    folder = save_hf(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] - 1}))
    last = config["num_hidden_layers"] - 1
    with pytest.raises(UserError, match=rf"^{folder}: \d+ tensor\(s\) of its files are no part of the model its "
                                        rf"config.json describes \(model.layers.{last}\..*, \.\.\.\); fix config.json"):
        imported(folder)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {n: np.asarray(a) for n, a in hf.SafetensorsFolder(folder).tensors.items()}
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file({**tensors, "model.extra.weight": np.zeros(3, np.float32),
               "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)},
              str(folder / "model.safetensors"))
    with pytest.raises(UserError, match=r"1 tensor\(s\) of its files are no part .* \(model.extra.weight\)"):
        imported(folder)


def test_nan_or_inf_weights_are_refused_as_they_are_read(tmp_path):
    folder = save_hf(tmp_path / "hf")
    tensors = {n: np.array(a) for n, a in hf.SafetensorsFolder(folder).tensors.items()}
    for f in folder.glob("*.safetensors"):
        f.unlink()
    tensors["model.layers.1.mlp.up_proj.weight"].flat[[0, 5]] = [np.nan, np.inf]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match=rf"^{folder}: tensor model.layers.1.mlp.up_proj.weight holds 2 NaN/inf "
                                        rf"values; the checkpoint is damaged"):
        imported(folder)


@pytest.mark.fast
def test_the_streaming_writer_writes_what_safetensors_reads_one_tensor_at_a_time(tmp_path):
    """safetensors_writer: every dtype the export writes, any shapes (a scalar, an empty one), read back
    equal by the safetensors library with the metadata; each tensor is made only once the one before it
    is written and released, so the host holds one at a time."""
    import gc
    import weakref

    import ml_dtypes
    from safetensors import safe_open

    from meshtrain.interop import safetensors_writer as writer

    rng = np.random.default_rng(0)
    wanted = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b.weight": rng.normal(size=(7,)).astype(
        ml_dtypes.bfloat16), "c": np.array(2.5, np.float16), "d": np.zeros((0, 4), np.float32)}
    alive = []

    def make(name):
        def made():
            gc.collect()
            assert not [r for r in alive if r() is not None], f"{name} made while another tensor is held"
            x = wanted[name].copy()
            alive.append(weakref.ref(x))
            return x
        return made
    writer.write(tmp_path / "x.safetensors", [writer.Entry(n, x.dtype, x.shape, make(n)) for n, x in wanted.items()],
                 {"format": "pt"})
    with safe_open(tmp_path / "x.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(wanted)
        for name, x in wanted.items():
            if x.dtype != ml_dtypes.bfloat16:  # safetensors' numpy loader cannot return bfloat16
                np.testing.assert_array_equal(f.get_tensor(name), x)
    read = hf.SafetensorsFolder(tmp_path)  # meshtrain's own reader takes bfloat16 too
    for name, x in wanted.items():
        np.testing.assert_array_equal(read.get(name), x)
