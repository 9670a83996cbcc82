"""Config loading, dotted overrides and validation; every shipped config loads."""
import math
from pathlib import Path

import pytest

from conftest import ROOT
from meshtrain.config import Config, UserError, apply_overrides, load_config
from meshtrain.mesh import parse_mesh


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_load(path: Path):
    cfg = load_config(str(path))
    assert cfg.model.resolved().head_dim * cfg.model.num_heads > 0


def test_overrides_coerce_types_and_nest():
    cfg = apply_overrides(Config(), ["model.num_layers=8", "optim.lr=3e-4", "model.tie_embeddings=false",
                                     "rules.mlp=[tensor, fsdp]", "mesh=2x2x2"])
    assert cfg.model.num_layers == 8 and cfg.optim.lr == 3e-4 and cfg.model.tie_embeddings is False
    assert cfg.rules == {"mlp": ["tensor", "fsdp"]} and cfg.mesh == "2x2x2"


@pytest.mark.parametrize("override,message", [
    ("model=3", "is a section"),
    ("train.steps.x=1", "has no field 'x'"),
    ("bogus=1", "unknown config key 'bogus'"),
    ("model.num_heads=6", "must be a multiple of model.num_kv_heads=4"),
    ("train.microbatches=3", "not divisible by train.microbatches=3"),
    ("zero=4", "zero=4 is not one of 0, 1, 2, 3"),
])
def test_invalid_configs_fail_clearly(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("spec,expected", [
    ("8x8x4", (8, 8, 4, 1)),
    ("2x2x2x4", (2, 2, 2, 4)),
    ("data=2,fsdp=4", (2, 4, 1, 1)),
    ("fsdp=-1,tensor=2", (1, 4, 2, 1)),
    ("-1x2", (4, 2, 1, 1)),
])
def test_mesh_specs(spec, expected):
    sizes = parse_mesh(spec, math.prod(expected))
    assert tuple(sizes.values()) == expected
