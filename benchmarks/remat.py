"""Remat policies: activation memory saved vs FLOPs added, read from the compiled train step
(8 layers, width 256, 16 x 256 tokens, fp32, one CPU device). Temp bytes come from
`memory_analysis()`; FLOPs from XLA's cost analysis (which counts the layer scan's body once, the
same for every policy, so the ratios compare like with like).

    python benchmarks/remat.py
"""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from meshtrain.config.loader import load_config  # noqa: E402
from meshtrain.engine.program import TrainProgram  # noqa: E402

POLICIES = ("none", "save_matmuls", "full")


def compiled(policy):
    cfg = load_config("configs/tiny.yaml", [
        "parallel.mesh=1", f"parallel.remat={policy}", "model.num_layers=8", "model.d_model=256", "model.num_heads=8",
        "model.num_kv_heads=8", "model.head_dim=32", "model.mlp_dim=1024", "train.batch_size=16", "train.seq_len=256",
        f"out={tempfile.mkdtemp()}"])
    c = TrainProgram.from_config(cfg).lower().compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return c.memory_analysis().temp_size_in_bytes, cost["flops"]


def main():
    results = {p: compiled(p) for p in POLICIES}
    base_bytes, base_flops = results["none"]
    print("| remat | temp bytes | vs none | XLA FLOPs | vs none |\n|---|---|---|---|---|")
    for p, (temp, flops) in results.items():
        print(f"| {p} | {temp:,} | {temp / base_bytes:.3f} | {flops:.3e} | {flops / base_flops:.3f} |")


if __name__ == "__main__":
    main()
