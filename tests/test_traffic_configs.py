"""The shipped configs' layouts (configs/*.yaml), shrunk to tiny shapes on 8 simulated devices:
measured collective traffic per kind (meshtrain/hlo.py, corrected) within 10% of
meshtrain/traffic.py's formula, or flagged with the reason `traffic.compare` gives. Compile-only;
each program compiled once (module cache). The pods themselves: tests/test_shipped_configs.py."""
import functools

import pytest

from conftest import ROOT, tiny_config
from meshtrain import hlo, traffic
from meshtrain.program import TrainProgram

# Tiny Llama-shaped dims: every layer's structure (GQA, SwiGLU, untied or tied head) kept.
SHRINK = ("model.num_layers=2", "model.d_model=256", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=32",
          "model.mlp_dim=512", "model.vocab_size=1024", "train.seq_len=64")
CASES = {  # name: (config, overrides); the pod's axes on 8 devices, then the layouts
    "llama3_8b pod axes": ("llama3_8b", ("parallel.mesh=fsdp=2,tensor=4", "train.batch_size=32")),
    "llama2_70b pod axes": ("llama2_70b", ("parallel.mesh=fsdp=2,tensor=4", "train.batch_size=64")),
    "mixtral_8x7b pod axes": ("mixtral_8x7b", ("parallel.mesh=fsdp=2,expert=4", "train.batch_size=32")),
    "llama_1b pod axes": ("llama_1b", ("parallel.mesh=fsdp=8", "train.batch_size=16")),
    "gpt2_124m pod axes": ("gpt2_124m", ("parallel.mesh=data=8", "train.batch_size=16")),
    "tiny pod": ("tiny", ("parallel.mesh=2x2x2",)),
    "moe_tiny pod": ("moe_tiny", ("parallel.mesh=data=2,expert=4",)),
    "shakespeare_char pod": ("shakespeare_char", ("parallel.mesh=data=8",)),
    "data x tensor": ("llama3_8b", ("parallel.mesh=data=2,tensor=4", "train.batch_size=32")),
    "data x fsdp": ("llama3_8b", ("parallel.mesh=data=2,fsdp=4", "train.batch_size=128")),
    "sequence parallel": ("llama3_8b", ("parallel.mesh=fsdp=2,tensor=4", "parallel.sequence_parallel=true",
                                        "train.batch_size=32")),
    "context parallel": ("llama3_8b", ("parallel.mesh=fsdp=2,tensor=2,context=2", "train.batch_size=32",
                                       "train.seq_len=128", "parallel.attention=ring")),
    "zero1 data x tensor": ("llama3_8b", ("parallel.mesh=data=2,tensor=4", "parallel.zero=1", "parallel.microbatches=1",
                                          "train.batch_size=4")),
    "zero1 data x fsdp": ("llama3_8b", ("parallel.mesh=data=2,fsdp=4", "parallel.zero=1", "parallel.microbatches=1",
                                        "train.batch_size=8")),
    "expert parallel": ("moe_tiny", ("parallel.mesh=fsdp=2,expert=4",)),
    "int8 compression": ("gpt2_124m", ("parallel.mesh=data=8", "parallel.grad_compression=int8", "train.batch_size=16")),
}


@functools.cache
def compared(name):
    config, overrides = CASES[name]
    shrink = SHRINK if config not in ("tiny", "moe_tiny", "shakespeare_char") else ()
    program = TrainProgram.from_config(tiny_config(*shrink, *overrides, config=str(ROOT / "configs" / f"{config}.yaml")))
    measured = hlo.collectives(program.lower().compile().as_text(), program.mesh.size)
    return traffic.compare(measured, traffic.expected_traffic(program), gaps=traffic.known_gaps(program))


@pytest.mark.parametrize("name", CASES)
def test_each_kind_within_10_percent_or_flagged_with_its_reason(name):
    rows = compared(name)
    print(name, {k: (round(r["ratio"], 3) if r["ratio"] else None, r["measured_bytes"]) for k, r in rows.items()
                 if r["measured_bytes"] or r["formula_bytes"]})
    for kind, row in rows.items():
        if row["within"]:
            continue
        assert row["flag"] and "not modelled" not in row["flag"], (kind, row)
    assert any(row["within"] and row["ratio"] for row in rows.values())
