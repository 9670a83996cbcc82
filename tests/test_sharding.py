"""PartitionSpecs per parameter / optimizer-state leaf, and per-device bytes vs the ZeRO formulas."""
import jax
import pytest
from conftest import ROOT, run_tiny, tiny_config
from jax.sharding import PartitionSpec as P

from meshtrain.config.loader import UserError
from meshtrain.core.formulas import zero_bytes
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.parallel.sharding import DEFAULT_RULES, LAYER_AXES, make_rules, spec_for

D, F = "fsdp", "tensor"


def specs_of(tree, name_filter):
    return {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(tree)
            if name_filter(jax.tree_util.keystr(p))}


@pytest.mark.fast
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_param_and_opt_state_specs_on_2x2x2(zero):
    from meshtrain.engine.program import TrainProgram

    # shardings only: nothing compiled
    program = TrainProgram.from_config(tiny_config("parallel.mesh=2x2x2", f"parallel.zero={zero}"))
    params = program.state_shardings["params"]
    dp = ("data", "fsdp") if zero >= 3 else "fsdp"
    assert params["embedding"].spec == P("tensor", dp)
    assert params["blocks"]["wq"].spec == P(None, dp, "tensor", None)
    assert params["blocks"]["wk"].spec == P(None, dp, "tensor", None)
    assert params["blocks"]["wo"].spec == P(None, "tensor", None, dp)
    assert params["blocks"]["w_gate"].spec == P(None, dp, "tensor")
    assert params["blocks"]["w_down"].spec == P(None, "tensor", dp)
    assert params["blocks"]["attn_norm"]["scale"].spec == P(None, dp)
    assert params["final_norm"]["scale"].spec == P(dp)

    opt_dp = ("data", "fsdp") if zero >= 1 else "fsdp"
    moments = specs_of(program.state_shardings["opt_state"], lambda k: "['wq']" in k)
    assert len(moments) == 2  # Adam's mu and nu
    assert set(moments.values()) == {P(None, opt_dp, "tensor", None)}
    grad_dp = ("data", "fsdp") if zero >= 2 else "fsdp"
    assert program.grad_specs["blocks"]["wq"] == P(None, grad_dp, "tensor", None)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_argument_bytes_follow_zero_formula(zero):
    """fp32 Adam, N = |data| = 8: params 4Psi (/N at stage 3), moments 8Psi (/N from stage 1)
    (meshtrain/core/formulas.py); the step's arguments hold no gradients."""
    trainer, _, _ = run_tiny("parallel.mesh=data=8", f"parallel.zero={zero}")
    formula = zero_bytes(trainer.program.num_params, trainer.program.sizes, zero)
    t = trainer.cfg.train
    expected = formula["parameters"] + formula["optimizer_state"]
    expected += t.batch_size * (t.seq_len + 1) * 4 / 8  # int32 tokens
    measured = trainer.compiled_step.memory_analysis().argument_size_in_bytes
    assert abs(measured - expected) / expected < 0.01, (measured, expected)


def test_zero2_shards_gradients_and_cuts_temp_bytes():
    temp = {z: run_tiny("parallel.mesh=data=8", f"parallel.zero={z}")[0]
               .compiled_step.memory_analysis().temp_size_in_bytes for z in (1, 2)}
    assert temp[2] < temp[1]


@pytest.mark.fast
def test_activation_and_param_specs_resolve_axis_conflicts():
    mesh = build_mesh(parse_mesh("2x2x2", 8))
    rules = make_rules()
    assert spec_for(("batch", "seq", "embed"), rules, mesh) == P(("data", "fsdp"), None, None)
    assert spec_for(("embed", "mlp"), rules, mesh) == P("fsdp", "tensor")
    assert spec_for(("batch", "seq", "vocab"), rules, mesh) == P(("data", "fsdp"), None, "tensor")
    # an axis that does not divide its dimension is dropped, never padded
    assert spec_for(("embed", "mlp"), rules, mesh, shape=(5, 8)) == P(None, "tensor")


@pytest.mark.fast
def test_rules_are_overridable_from_config():
    rules = make_rules({"mlp": ["tensor", "fsdp"], "embed": None})
    assert rules["mlp"] == ("tensor", "fsdp") and rules["embed"] == ()
    assert set(DEFAULT_RULES) == {"batch", "seq", "residual_seq", "embed", "heads", "kv_heads", "head_dim", "mlp",
                                  "vocab", "layers", "outer_layers", "experts", "lora_rank", "q_lora", "kv_lora"}
    assert make_rules({}, sequence_parallel=True)["residual_seq"] == ("context", "tensor")
    with pytest.raises(UserError, match="unknown mesh axis 'model'"):
        make_rules({"mlp": "model"})
    with pytest.raises(UserError, match="unknown logical axis"):
        make_rules({"width": "tensor"})


@pytest.mark.fast
def test_mostly_replicated_parameters_are_an_error():
    from meshtrain.run.trainer import Trainer

    cfg = tiny_config("parallel.mesh=fsdp=8", "model.d_model=36", "model.mlp_dim=36")  # 36 is not divisible by 8
    with pytest.raises(UserError, match="stay replicated"):
        Trainer(cfg)


def test_the_docs_rules_table_is_the_default_rules():
    """docs/mesh.md shows the default rules as YAML: it is the table the code uses."""
    import re

    import yaml

    page = (ROOT / "docs" / "mesh.md").read_text()
    block = re.search(r"```yaml\nparallel:\n  rules:.*?\n(.*?)```", page, re.S).group(1)
    assert {k: tuple(v) for k, v in yaml.safe_load(block).items()} == DEFAULT_RULES


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*tiny.yaml")))
def test_every_weight_matrix_of_every_family_is_fsdp_sharded(config):
    """ZeRO-3 splits every weight matrix over fsdp (a dimension whose logical axis maps to it): one
    left whole, as deepseek_v3's wkv_b was with no rule for its latent axis, is held, updated and
    gradient-all-reduced on every fsdp device."""
    from meshtrain.models import FAMILIES

    cfg = tiny_config(config=ROOT / "configs" / config)
    model = FAMILIES[cfg.model.family](cfg.model)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    axes = jax.tree.leaves(model.logical_axes(abstract), is_leaf=lambda n: isinstance(n, tuple))
    whole = [jax.tree_util.keystr(path) for (path, x), names in zip(leaves, axes)
             if x.ndim - sum(n in (*LAYER_AXES, "experts") for n in names) >= 2  # one layer's (expert's) matrix
             and not any("fsdp" in DEFAULT_RULES.get(name, ()) for name in names)]
    assert whole == [], whole
