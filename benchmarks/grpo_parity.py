"""GRPO's sampler against its trainer (docs/fine-tuning.md, "Sampler and trainer"): the largest
logp_diff_max over a 6-step run of the tiny model (16 completions of 6 tokens a step, the settings of
tests/test_grpo.py) for each rl.sampler, precision and layout, and the seconds a rollout took. On 8
simulated CPU devices:

    python benchmarks/grpo_parity.py
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from meshtrain.parallel.mesh import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.data.__main__ import main as data_main  # noqa: E402
from meshtrain.testing import run_tiny  # noqa: E402

SETTINGS = ("data.kind=auto", "train.objective=grpo", "train.batch_size=16", "rl.group_size=4",
            "rl.max_new_tokens=6", "train.seq_len=16", "optim.lr=1e-2", "train.steps=6", "rl.reward=format",
            "rl.format_pattern=.*[a-z].*")
LAYOUTS = (("one device", "1", 1, ()), ("fsdp=2,tensor=2", "fsdp=2,tensor=2", 4, ()),
           ("data=2, 2 microbatches", "data=2", 2, ("parallel.microbatches=2",)))


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    with open(folder / "sums.jsonl", "w") as f:
        for a, b in rng.integers(10, 50, size=(200, 2)):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    assert data_main(["prepare", str(folder / "sums.jsonl"), "--prompts", "--out", str(folder / "prompts")]) == 0
    print("| rl.sampler | precision | " + " | ".join(name for name, *_ in LAYOUTS) + " |")
    print("|---|---|" + "---|" * len(LAYOUTS))
    for sampler in ("cache", "exact"):
        for precision in ("fp32", "bf16"):
            cells = []
            for _, mesh, n, extra in LAYOUTS:
                trainer = run_tiny(f"data.path={folder / 'prompts'}", *SETTINGS, f"rl.sampler={sampler}",
                                   f"parallel.precision={precision}", f"parallel.mesh={mesh}", *extra,
                                   devices=jax.devices()[:n])[0]
                steps = [r for r in trainer.history if "loss" in r]
                cells.append(f"{max(r['logp_diff_max'] for r in steps):.2g} "
                             f"({np.median([r['rollout_s'] for r in steps]):.2f} s)")
            print(f"| {sampler} | {precision} | " + " | ".join(cells) + " |")
    print("cells: the largest logp_diff_max over 6 steps (the median rollout's seconds)")


if __name__ == "__main__":
    main()
