"""Config loading, dotted overrides and validation; every shipped config loads; the reference."""
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT

from meshtrain.config.loader import (
    Config,
    ModelSpec,
    OptimSpec,
    UserError,
    apply_overrides,
    commented_yaml,
    load_config,
    parse_yaml,
    reference_markdown,
)
from meshtrain.core.cli import command
from meshtrain.core.console import NOTICE
from meshtrain.engine.step import make_optimizer
from meshtrain.models import family
from meshtrain.parallel.mesh import parse_mesh

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)
MoESpec = family("moe").spec


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_load_and_print_config_round_trips(path: Path, tmp_path):
    cfg = load_config(str(path))
    assert cfg.out == f"runs/{path.stem}"  # each config its own run folder: README commands never collide
    printed = tmp_path / "printed.yaml"  # --print-config output is itself a valid config
    printed.write_text(commented_yaml(cfg))
    assert load_config(str(printed)) == cfg


def test_config_reference_is_in_sync():
    """docs/config.md is generated: `python -m meshtrain.train --config-reference > docs/config.md`."""
    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown()


def test_text_settings_are_never_yaml_typed():
    cfg = apply_overrides(Config(), ["parallel.mesh=0x8", "out=007", "data.path=1e3", "optim.lr=1e-3",
                                     "train.steps=1_0"])
    assert (cfg.parallel.mesh, cfg.out, cfg.data.path, cfg.optim.lr) == ("0x8", "007", "1e3", 1e-3)
    with pytest.raises(UserError, match="axis sizes must be >= 1"):  # not YAML's hex 8 = data=8
        parse_mesh(cfg.parallel.mesh, 8)
    assert cfg.train.steps == 10


def test_yaml_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: 4\ntrain: [\n")
    with pytest.raises(UserError, match=rf"^{bad} line 2, column 6: .*; fix the YAML syntax$"):
        load_config(str(bad))
    hexed = tmp_path / "hex.yaml"
    hexed.write_text("parallel: {mesh: 0x8}\n")
    assert load_config(str(hexed)).parallel.mesh == "0x8"


def test_architecture_is_resolved_and_leaves_out_loss_weights_and_capacity():
    explicit = MoESpec(d_model=128, mlp_dim=384, head_dim=32, capacity_factor=1.25, router_aux_loss=0.1)
    assert MoESpec(d_model=128).architecture() == explicit.architecture()
    assert not {"capacity_factor", "router_aux_loss", "router_z_loss"} & set(explicit.architecture())
    assert MoESpec(d_model=128, mlp_dim=512).architecture() != explicit.architecture()
    assert MoESpec(num_experts=4).architecture() != MoESpec().architecture()
    assert ModelSpec(d_model=128).architecture() != MoESpec(d_model=128).architecture()  # the family is in it


@pytest.mark.parametrize("optim", [{"clip_norm": 0.0}, {"clip_norm": 5.0, "lr": 1.0, "weight_decay": 0.0},
                                   {"b1": 0.5, "b2": 0.5, "eps": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0}])
def test_optimizer_state_layout_does_not_depend_on_hyperparameters(optim):
    params = {"w": jnp.ones((4, 3)), "scale": jnp.ones((3,))}
    axes = {"w": ("embed", "mlp"), "scale": ("embed",)}
    layout = lambda ocfg, steps: jax.tree.structure(make_optimizer(ocfg, steps, axes).init(params))
    assert layout(OptimSpec(**optim), 7) == layout(OptimSpec(), 100)


def test_overrides_coerce_types_and_nest():
    cfg = apply_overrides(Config(), ["model.num_layers=8", "optim.lr=3e-4", "model.tie_embeddings=false",
                                     "parallel.rules.mlp=[tensor, fsdp]", "parallel.mesh=2x2x2"])
    assert cfg.model.num_layers == 8 and cfg.optim.lr == 3e-4 and cfg.model.tie_embeddings is False
    assert cfg.parallel.rules == {"mlp": ["tensor", "fsdp"]} and cfg.parallel.mesh == "2x2x2"


@pytest.mark.parametrize("override,message", [
    ("model=3", "is a section"),
    ("model.num_layers=0", "model.num_layers=0 must be >= 1"),
    ("train.eval_every=-1", "train.eval_every=-1 must be >= 0"),
    ("checkpoint.every_minutes=-5", "checkpoint.every_minutes=-5.0 must be >= 0$"),
    ("devices=8192", r"devices=8192 must be in \[0, 4096\]"),
    ("data.val_fraction=1", r"data.val_fraction=1.0 must be in \[0, 1\)"),
    ("optim.b1=1", r"optim.b1=1.0 must be in \[0, 1\)"),
    ("optim.b2=-0.5", r"optim.b2=-0.5 must be in \[0, 1\)"),
    ("optim.eps=0", "optim.eps=0.0 must be > 0"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be > 0"),
    ("optim.clip_norm=.inf", "optim.clip_norm=inf must be a finite number >= 0"),
    ("optim.lr=.nan", "optim.lr=nan must be a finite number >= 0"),
    ("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio=1.5 must be in \[0, 1\]"),
    ("parallel.loss_scale_min=0", "parallel.loss_scale_min=0.0 must be > 0"),
    ("train.seed=-1", "train.seed=-1 must be >= 0"),
    ("train.seq_len=4294967296", r"train.seq_len=4294967296 is too large: integers here are at most 2\^31 - 1"),
    ("train.steps=1e400", "train.steps=inf is not a valid int"),
    ("train.steps=2.5", "train.steps=2.5 is not a valid int"),
    ("train.steps=[1, 2]", r"train.steps=\[1, 2\] is not a valid int"),
    ("optim.lr={a: 1}", r"optim.lr=\{'a': 1\} is not a valid float"),
    ("optim.lr=1e999", "optim.lr=inf must be a finite number >= 0"),
    ("data.prefetch=1000", r"data.prefetch=1000 must be in \[0, 64\]"),
    ("parallel.rules.mlp=[tensor, tensor]", "names a mesh axis twice; name each once"),
    ("parallel.rules.mlp=3", "parallel.rules.mlp=3 is not a list of mesh axes"),
    ("parallel.rules.seq=[tensor", "--set parallel.rules.seq line 1, column 8: .*fix the YAML syntax"),
    ("parallel.remat=some", "parallel.remat='some' is not one of none, full, save_matmuls, offload"),
    ("train.steps.x=1", "has no field 'x'"),
    ("bogus=1", "unknown config key 'bogus'"),
    ("model.num_heads=6", "must be a multiple of model.num_kv_heads=4"),
    ("parallel.microbatches=3", "not divisible by parallel.microbatches=3"),
    ("parallel.zero=4", "parallel.zero=4 is not one of 0, 1, 2, 3"),
    ("model.family=gpt", "model.family='gpt' is not one of llama, moe"),
    ("parallel.attention=flash", "parallel.attention='flash' is not one of auto, xla, blockwise, cudnn, ring"),
    ("model.num_experts=4", "the llama family has no num_experts .*; set model.family=moe"),
])
def test_invalid_configs_fail_clearly(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("spec,expected", [
    ("8x8x4", (8, 8, 4, 1, 1, 1)),
    ("2x2x2x4", (2, 2, 2, 4, 1, 1)),
    ("data=2,fsdp=4", (2, 4, 1, 1, 1, 1)),
    ("fsdp=-1,tensor=2", (1, 4, 2, 1, 1, 1)),
    ("-1x2", (4, 2, 1, 1, 1, 1)),
    ("data=2,expert=4", (2, 1, 1, 1, 4, 1)),
    ("fsdp=2,context=-1", (1, 2, 1, 1, 1, 4)),
])
def test_mesh_specs(spec, expected):
    sizes = parse_mesh(spec, math.prod(expected))
    assert tuple(sizes.values()) == expected


def test_renamed_keys_still_work_with_a_notice(tmp_path, caplog):
    import meshtrain.config.loader as config

    config._NOTICED.clear()
    old = tmp_path / "old.yaml"
    old.write_text("model: {num_layers: 2, remat: full, attention: blockwise}\nzero: 3\nprecision: bf16\n"
                   "mesh: data=2,fsdp=4\nrules: {mlp: [tensor]}\npipeline: {schedule: zb, microbatches: 8}\n"
                   "train: {microbatches: 1, steps: 7}\n")
    cfg = load_config(str(old))
    p = cfg.parallel
    assert (p.remat, p.attention, p.zero, p.precision, p.mesh) == ("full", "blockwise", 3, "bf16", "data=2,fsdp=4")
    # train.microbatches=1: the old default
    assert (p.rules, p.schedule, p.microbatches) == ({"mlp": ["tensor"]}, "zb", 8)
    assert cfg.model.num_layers == 2 and cfg.train.steps == 7
    notices = [r.getMessage() for r in caplog.records if r.levelno == NOTICE]  # `notice: ...` on stderr
    assert "config key 'model.remat' is now 'parallel.remat' (docs/config.md)" in notices
    assert len(notices) == 9 and all(line.startswith("config key '") for line in notices)
    assert load_config(None, ["train.microbatches=4"]).parallel.microbatches == 4


@pytest.mark.parametrize("text,message", [
    (b"train: {steps: \xff}\n", r"is not UTF-8 text \(byte 15: b'\\xff'\); save it as UTF-8$"),
    (b"optim: {lr: [1, 2]}\n", r"optim.lr=\[1, 2\] is not a valid float"),
    (b"out: [a, b]\n", r"out=\['a', 'b'\] is a list, not text; give one value"),
    (b"data: {path: }\n", "data.path has no value; give one or remove the key"),
    (b"train: {steps: .inf}\n", "train.steps=inf is not a valid int"),
    (b"optim: {b1: .nan}\n", r"optim.b1=nan must be a finite number in \[0, 1\)"),
    (b"train: 3\n", "config key 'train' is a section"),
    (b"- a list\n", "must hold a mapping of sections"),
    (b"parallel: {rules: {mlp: {tensor: 1}}}\n", r"parallel.rules.mlp=\{'tensor': 1\} is not a list of mesh axes"),
], ids=["non-utf8", "list-for-number", "list-for-text", "empty-value", "inf-int", "nan-beta", "section-scalar",
        "not-a-mapping", "rules-mapping"])
def test_malformed_config_files_fail_clearly(text, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(UserError, match=message):
        load_config(str(path))


def test_a_folder_or_unreadable_file_as_config(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(str(tmp_path))
    from meshtrain.config.loader import read_text
    with pytest.raises(UserError, match=rf"config file {tmp_path} cannot be read \(Is a directory\)"):
        read_text(tmp_path, "config file")


@pytest.mark.parametrize("bounds,inside,outside,shown", [
    (dict(min=1), [1, 2**31 - 1], [0, -5, 2**31], ">= 1"),
    (dict(min=0.0, below=1.0), [0.0, 0.999], [1.0, -0.1, float("nan"), float("inf")], "in [0, 1)"),
    (dict(above=0.0), [1e-30, 1e300], [0.0, -1.0, float("inf")], "> 0"),
    (dict(above=0.0, max=1.0), [1.0, 0.5], [0.0, 1.5], "in (0, 1]"),
    (dict(max=4096), [-1, 4096], [4097], "<= 4096"),
    (dict(), [0.0, -1e300, 2**31 - 1], [float("-inf"), float("nan"), -2**31 - 1], "a finite number"),
])
def test_bounds(bounds, inside, outside, shown):
    from meshtrain.core.bounds import Bounds
    b = Bounds(**bounds)
    assert str(b) == shown
    assert [b.problem(v) for v in inside] == [None] * len(inside)
    assert all(b.problem(v) for v in outside)
    with pytest.raises(UserError, match=r"^x=.* (must be|is too large)"):
        b.check("x", outside[0])


def test_every_number_key_has_a_range_in_the_reference():
    """Each int/float key declares its range, and docs/config.md shows it."""
    from meshtrain.config.spec import settings
    from meshtrain.core.bounds import Bounds
    numbers = [(key, f) for key, f, value in settings() if type(value) in (int, float) and not f.metadata["choices"]]
    assert numbers and all(f.metadata["bounds"] != Bounds() for key, f in numbers), \
        [key for key, f in numbers if f.metadata["bounds"] == Bounds()]
    reference = reference_markdown()
    assert all(f"| `{key}` |" in reference and str(f.metadata["bounds"]) in reference for key, f in numbers)


# a billion laughs: five levels of ten aliases each, 10^5 values from five short lines
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcd", "bcde"))


@pytest.mark.parametrize("text, error", [
    ("train:\n  steps: 3\nmodel: {}\ntrain:\n  steps: 4\n",
     "line 4: key 'train' is given twice (first on line 1); keep one"),
    ("train:\n  steps: 3\n  steps: 4\n", "line 3: key 'steps' is given twice (first on line 2); keep one"),
    (BOMB, "expands to more than 100,000 values (aliases included)"),
    ("train: " + "[" * 100 + "]" * 100, "nested deeper than 64 levels"),
    ("train: " + "[" * 5000 + "]" * 5000, "nested deeper than 64 levels"),
    ("a: &a\n  b: *a\n", "an alias refers to a value that contains it"),
    ("a: " + "x" * (1 << 20), "is larger than 1 MB"),
], ids=["duplicate section", "duplicate key", "alias bomb", "deep", "deeper than the stack", "alias cycle", "huge"])
def test_a_config_file_is_read_within_limits_and_without_duplicate_keys(tmp_path, text, error):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_config(str(path))
    assert str(e.value).startswith(str(path)) and error in str(e.value) and len(str(e.value)) < 300


def test_merge_keys_may_be_overridden():
    assert parse_yaml("base: &b {steps: 3, lr: 1}\ntrain:\n  <<: *b\n  steps: 4\n", "x") == {
        "base": {"steps": 3, "lr": 1}, "train": {"steps": 4, "lr": 1}}


def test_an_error_line_is_bounded(capsys):
    @command
    def main(argv):
        raise UserError("value " + "x" * 50_000 + "\nend")

    assert main([]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and len(line) < 2100 and "characters cut" in line and line.endswith("\\nend\n")


SWITCHED_ON = {"data.document_mask": True, "train.straggler_every": 2, "checkpoint.local_dir": "/tmp/local",
               "guard.spike_factor": 3.0, "logging.wandb": True, "model.lora.rank": 4,
               "eval.tasks": [{"path": "tasks.jsonl"}]}


def _other_value(f, default):
    """A value of the setting `f` other than its default, within its choices and range."""
    from meshtrain.core.bounds import Bounds

    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, list):
        return default[:1] or ["x"]
    if isinstance(default, str):
        return "x"
    b = f.metadata["bounds"]
    for candidate in (default + 1, default * 2, default / 2, 0.1):
        candidate = type(default)(candidate)
        if candidate != default and Bounds.problem(b, candidate) is None:
            return candidate
    raise AssertionError(f"no other value for {f.name}")


def _declared():
    from meshtrain.config.spec import settings

    return [(key, f) for key, f, _ in settings(load_config(TINY_CONFIG, ["model.lora.rank=4"]))
            if f.metadata.get("applies")]


TINY_CONFIG = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.fast
@pytest.mark.parametrize("key, f", _declared(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_setting_changed_where_it_has_no_effect_is_one_line_by_one_rule(key, f):
    """Every setting that declares where it applies (core/bounds.py `Applies`): changed from its default
    with its switch off, one error naming both keys; with the switch on, accepted."""
    import dataclasses

    from meshtrain.config.spec import Config, settings

    applies = f.metadata["applies"]
    fields = {k: g for k, g, _ in settings(Config())} | {k: g for k, g in _declared()}
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    value = _other_value(f, default)
    switch = fields[applies.key]
    switch_default = switch.default_factory() if switch.default is dataclasses.MISSING else switch.default
    off = next((c for c in switch.metadata["choices"] if c not in applies.values), switch_default)
    flow = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    setting = f"{key}={flow(value) if not isinstance(value, list) else value}"
    with pytest.raises(UserError) as e:
        load_config(TINY_CONFIG, [f"{applies.key}={flow(off) if not isinstance(off, list) else off}", setting])
    assert str(e.value).startswith(f"{key}={value!r} has no effect with {applies.key}={off!r} (it applies where "
                                   f"{applies.key} is ")
    on = applies.values[0] if applies.values else SWITCHED_ON[applies.key]
    try:
        load_config(TINY_CONFIG, [f"{applies.key}={flow(on) if not isinstance(on, list) else on}", setting])
    except UserError as other:  # another check may still object to the tiny model (not this rule)
        assert "has no effect" not in str(other)


@pytest.mark.fast
def test_a_runs_recorded_config_with_a_setting_without_effect_still_reads(tmp_path):
    """An earlier version accepted it: the run's config.yaml is read back as it is (eval, generate)."""
    (tmp_path / "config.yaml").write_text("parallel: {loss_scale_window: 5}\n")
    assert load_config(str(tmp_path / "config.yaml"), recorded=True).parallel.loss_scale_window == 5
    with pytest.raises(UserError, match="parallel.loss_scale_window=5 has no effect"):
        load_config(str(tmp_path / "config.yaml"))


@pytest.mark.fast
@pytest.mark.parametrize("config, override, message", [
    ("deepseek_v3_tiny", "model.qk_rope_head_dim=3", r"^model.qk_rope_head_dim=3: rotary embeddings rotate pairs of "
                                                      r"channels, so it must be even; set model.qk_rope_head_dim$"),
    ("tiny", "model.head_dim=7", r"^model.head_dim=7: rotary embeddings rotate pairs of channels"),
    ("deepseek_v3_tiny", "model.mtp_depth=100", r"^model.mtp_depth=100 predicts up to 101 tokens ahead, which "
                                                r"train.seq_len=\d+ does not hold"),
])
def test_errors_name_the_familys_own_key(config, override, message):
    """A family's error names the key it has (deepseek_v3's rope width is qk_rope_head_dim, not the
    head_dim it does not set); an MTP deeper than the sequence is one line, not a traceback."""
    with pytest.raises(UserError, match=message):
        load_config(str(ROOT / "configs" / f"{config}.yaml"), [override])
