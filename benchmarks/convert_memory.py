"""Host memory of a Hugging Face export, against the largest tensor (issue 57, class 8).

    python benchmarks/convert_memory.py [--configs tiny gpt2_124m] [--dir DIR]

For each config a run of one step is trained (1 CPU device, a checkpoint at its end), then, in a
process of its own, its parameters are read from the checkpoint as `convert --to-hf` reads them and
written as a Hugging Face folder by `meshtrain.interop.hf.save_params`, the export's code path.
steady = resident memory with the parameters read (on a CPU device the arrays live in host RAM);
peak = the most resident memory while the folder is written (VmHWM, reset through
/proc/self/clear_refs where the kernel permits, and VmRSS sampled every 2 ms). added = peak - steady:
what the export holds beyond the parameters. The bound: the largest tensor gathered and its converted
copy (2 x the largest tensor), plus 64 MB; a file's worth held at once (the export before issue 57)
exceeds it on any model whose weights are more than twice its largest tensor.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

MB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def export(run: str, out: str) -> dict:
    """In this process: the run's parameters read, then written as a Hugging Face folder; the memory
    figures of the write."""
    import jax
    import numpy as np

    from meshtrain.interop import hf
    from meshtrain.models import FAMILIES
    from meshtrain.run import run_dir

    cfg = run_dir.run_config(run)
    model = FAMILIES[cfg.model.family](cfg.model)
    params, _ = run_dir.newest_params(run, model)
    jax.block_until_ready(params)
    leaves = jax.tree.leaves(params)
    largest = max(x.nbytes // x.shape[0] if x.ndim > 2 else x.nbytes for x in leaves)  # a layer's slice
    steady = _status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pass
    peak, done = [steady], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], _status("VmRSS"))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    hf.save_params(params, cfg.model, out)
    done.set()
    sampler.join()
    peak = max(peak[0], _status("VmHWM"))
    return {"params": int(sum(np.asarray(x.nbytes) for x in leaves)), "largest": int(largest), "steady": steady,
            "peak": peak, "added": peak - steady, "bound": 2 * int(largest) + 64 * MB}


def train_one_step(config: str, folder: Path) -> str:
    from meshtrain.config.loader import load_config
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    out = folder / f"run-{Path(config).stem}"
    cfg = load_config(config, [f"out={out}", "train.steps=1", "train.batch_size=1", "train.seq_len=32",
                               "parallel.mesh=1", "data.kind=synthetic", "data.path=", "train.eval_every=0",
                               "logging.tensorboard=false"])
    import jax

    Trainer(cfg, devices=jax.devices()[:1]).fit(log=MetricsLog(primary=False))
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["tiny", "gpt2_124m"])
    p.add_argument("--dir", help="where the runs and exports are written (default: a temporary folder)")
    p.add_argument("--export", nargs=2, metavar=("RUN", "OUT"), help=argparse.SUPPRESS)  # the measured process
    args = p.parse_args()
    if args.export:
        print(json.dumps(export(*args.export)))
        return
    folder = Path(args.dir or tempfile.mkdtemp(prefix="convert-memory-"))
    rows = []
    for name in args.configs:
        run = train_one_step(str(ROOT / "configs" / f"{name}.yaml"), folder)
        done = subprocess.run([sys.executable, __file__, "--export", run, str(folder / f"hf-{name}")],
                              capture_output=True, text=True, check=True)
        rows.append((name, json.loads(done.stdout.strip().splitlines()[-1])))
    print("| config | parameters | largest tensor | steady RSS | peak RSS | added | bound (2 x largest + 64 MB) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['params'] / MB:,.1f} MB | {r['largest'] / MB:,.1f} MB | {r['steady'] / MB:,.0f} MB | "
              f"{r['peak'] / MB:,.0f} MB | {r['added'] / MB:,.1f} MB | {r['bound'] / MB:,.1f} MB "
              f"{'ok' if r['added'] <= r['bound'] else 'OVER'} |")


if __name__ == "__main__":
    main()
