"""On an NVIDIA GPU: how many cuDNN fused-attention forwards and backwards the compiled train step
runs per layer, for each remat policy (llama_1b shape, 2 layers, batch 2 x 1024, bf16). A second
forward per layer is the fused forward rerun in the backward for its softmax statistics.

    python benchmarks/cudnn_hlo.py
"""
import os
import re
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

from meshtrain.config.loader import load_config  # noqa: E402
from meshtrain.engine.program import TrainProgram  # noqa: E402

LAYERS = 2


def main():
    if jax.default_backend() != "gpu":
        sys.exit("error: cuDNN attention needs an NVIDIA GPU; run this on one")
    for remat in ("none", "save_matmuls", "full"):
        cfg = load_config("configs/llama_1b.yaml", [
            "parallel.mesh=1", f"model.num_layers={LAYERS}", "train.batch_size=2", "train.seq_len=1024",
            "parallel.attention=cudnn", f"parallel.remat={remat}", f"out={tempfile.mkdtemp()}"])
        text = TrainProgram.from_config(cfg, devices=jax.devices()[:1]).lower().compile().as_text()
        calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)
        print(f"remat={remat}: " + ", ".join(f"{c} x{calls.count(c)}" for c in sorted(set(calls))), flush=True)


if __name__ == "__main__":
    main()
