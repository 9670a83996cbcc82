"""Hugging Face import/export parity: max |logit difference| between meshtrain and transformers
(CPU torch, fp32) for random-weight Llama, Mixtral, Qwen3 and Qwen3-MoE checkpoints built from small configs (nothing
downloaded), and for a meshtrain run exported to Hugging Face and loaded with from_pretrained.
--expert-mesh: instead, tiny Mixtral-form, Qwen3-MoE and DeepSeek-V3 runs trained 2 steps on expert meshes
(and two resumed onto another expert count), exported with convert --to-hf (tests/test_hf_moe.py's cases).

    python benchmarks/hf_parity.py [--width 256 --layers 4 --seq 256]
    python benchmarks/hf_parity.py --expert-mesh
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# the repository instead of this folder: transformers imports a package named `kernels` if it finds one
sys.path[0] = str(Path(__file__).resolve().parent.parent)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from meshtrain.interop import hf  # noqa: E402
from meshtrain.models import FAMILIES  # noqa: E402
from meshtrain.parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from meshtrain.parallel.sharding import param_shardings  # noqa: E402
from meshtrain.testing import (  # noqa: E402
    MOE_EXPORT_FAMILIES,
    MOE_EXPORT_LAYOUTS,
    MOE_RESUMED_FAMILIES,
    MOE_RESUMED_ON,
    hf_export_parity,
    trained_run,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def checkpoints(width: int, layers: int):
    common = dict(vocab_size=1000, hidden_size=width, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=2, initializer_range=0.1)
    yield "llama, untied, GQA 8/2, llama3 rope", transformers.LlamaForCausalLM(transformers.LlamaConfig(
        intermediate_size=2 * width, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
        **common))
    yield "llama, tied head", transformers.LlamaForCausalLM(transformers.LlamaConfig(
        intermediate_size=2 * width, tie_word_embeddings=True, **common))
    yield "mixtral, 8 experts top-2", transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=width, num_local_experts=8, num_experts_per_tok=2, **common))
    qwen3 = dict(common, head_dim=width // 4, rope_theta=1000000.0, rms_norm_eps=1e-6)  # 8 heads of 2 x width/8
    untied = transformers.Qwen3Config(intermediate_size=2 * width, tie_word_embeddings=False, **qwen3)
    yield "qwen3, untied, GQA 8/2, head_dim 2x", with_random_norms(transformers.Qwen3ForCausalLM(untied))
    yield "qwen3, tied head", with_random_norms(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        intermediate_size=2 * width, tie_word_embeddings=True, **qwen3)))
    yield "qwen3_moe, 8 experts top-2, renormalized", with_random_norms(transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(moe_intermediate_size=width // 2, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, tie_word_embeddings=False, **qwen3)))


def with_random_norms(model):
    """RMSNorm scales start at 1; random ones, so a misplaced scale shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--expert-mesh", action="store_true", help="MoE runs trained on expert meshes, exported")
    args = ap.parse_args()
    if args.expert_mesh:
        return expert_mesh_exports()
    torch.manual_seed(0)
    tokens = np.random.default_rng(0).integers(0, 1000, (2, args.seq))
    mesh = build_mesh(parse_mesh("fsdp=2,tensor=2", 4), jax.devices()[:4])
    print("| checkpoint | import: max abs logit diff (max abs logit) | export -> from_pretrained | "
          "re-export bitwise |\n|---|---|---|---|")
    for name, hf_model in checkpoints(args.width, args.layers):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            hf_model.eval().save_pretrained(tmp / "in")
            spec = hf.read_spec(tmp / "in")
            model = FAMILIES[spec.family](spec)
            params = hf.load_params(tmp / "in", model, param_shardings(model, mesh))  # on fsdp=2,tensor=2
            theirs, ours = logits(hf_model, tokens), np.asarray(model.apply(params, tokens))
            hf.save_params(params, spec, tmp / "out", max_shard_bytes=2**20)
            back = transformers.AutoModelForCausalLM.from_pretrained(tmp / "out", dtype=torch.float32).eval()
            a, b = hf.SafetensorsFolder(tmp / "in"), hf.SafetensorsFolder(tmp / "out")
            same = all(np.array_equal(a.get(n), b.get(n)) for n in a.tensors) and a.tensors.keys() == b.tensors.keys()
            print(f"| {name} | {np.abs(ours - theirs).max():.2e} ({np.abs(theirs).max():.1f}) | "
                  f"{np.abs(logits(back, tokens) - ours).max():.2e} | {'yes' if same else 'NO'} |")


def expert_mesh_exports() -> None:
    tokens = np.random.default_rng(1).integers(0, 256, (2, 24))
    print("| run | max abs logit diff (max abs logit) | import(export) - trained |\n|---|---|---|")
    row = lambda name, parity: print(f"| {name} | {parity[0]:.1e} ({parity[1]:.1f}) | {parity[2]:.1e} |")
    for family, (config, model_overrides) in MOE_EXPORT_FAMILIES.items():
        for layout, overrides in MOE_EXPORT_LAYOUTS.items():
            with tempfile.TemporaryDirectory() as tmp:
                trainer = trained_run(Path(tmp) / "run", config, (*model_overrides, *overrides), steps=2)
                row(f"{family}, {layout}", hf_export_parity(trainer, Path(tmp) / "hf", tokens))
                if family in MOE_RESUMED_FAMILIES and layout == "data=2,expert=4":
                    resumed = trained_run(Path(tmp) / "run", config, (*model_overrides, MOE_RESUMED_ON), steps=3,
                                          resume=True)
                    row(f"{family}, {layout} resumed on {MOE_RESUMED_ON.split('=', 1)[1]}",
                        hf_export_parity(resumed, Path(tmp) / "hf2", tokens))


if __name__ == "__main__":
    main()
