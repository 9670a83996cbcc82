"""Host memory of a checkpoint save and restore, against the state size S (issue 42, section 3).

    python benchmarks/checkpoint_memory.py [--size 1GB] [--devices 8] [--restore-devices 4] [--dir DIR]

A llama-shaped train state of about --size bytes (parameters and AdamW moments, fp32, sharded over
fsdp) is saved and restored through `meshtrain.run.checkpoint.Checkpointer`, the code path training
uses (`Trainer.save_checkpoint`, `Trainer.restore`). Each case runs in its own process, so its
resident memory is its own:

- save: the state built on --devices CPU devices; steady = RSS with the state resident (on CPU
  devices the arrays live in host RAM), then `save` + `wait`. added = peak - steady.
- restore onto the same mesh, and onto --restore-devices devices (resharding on load): a fresh
  process, baseline = RSS before any array is read; added = peak - (baseline + S).

Peak is the larger of VmHWM (reset through /proc/self/clear_refs where the kernel permits) and
VmRSS sampled every 5 ms. The bound: added <= 0.25 x S + 200 MB.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 1 << 20
SLACK = 200 * MB  # allocator noise, compiled checksum programs, Orbax's own buffers


def bound(state_bytes: int) -> int:
    return state_bytes // 4 + SLACK


def _status(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakRSS:
    """The resident high-water mark of the `with` block: VmHWM reset at entry (where permitted), and
    VmRSS sampled every 5 ms by a thread, for kernels that refuse the reset."""

    def __enter__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.sampled, self._stop = _status("VmRSS"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, _status("VmRSS"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.sampled, _status("VmHWM") if self.hwm else 0)


def steady_rss() -> int:
    gc.collect()
    time.sleep(0.2)
    return _status("VmRSS")


def program_of(size: int, devices: int):
    """A TrainProgram on `devices` CPU devices (fsdp) whose state holds about `size` bytes: d_model
    512, as many scanned layers as it takes."""
    from meshtrain.config.loader import load_config
    from meshtrain.engine.program import TrainProgram

    def program(layers: int):
        cfg = load_config("configs/tiny.yaml", [f"model.num_layers={layers}", "model.d_model=512", "model.num_heads=8",
                                                "model.num_kv_heads=8", "model.head_dim=64", "model.mlp_dim=1536",
                                                f"parallel.mesh=fsdp={devices}", "out=unused"])
        return TrainProgram.from_config(cfg)

    one, two = (state_bytes(program(n).abstract_state) for n in (1, 2))
    return program(max(1, round((size - one) / (two - one)) + 1))


def state_bytes(tree) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def save_case(size: int, folder: Path) -> dict:
    import jax

    from meshtrain.run.checkpoint import Checkpointer

    program = program_of(size, jax.device_count())
    state = jax.jit(program.init_state, out_shardings=program.state_shardings)(jax.random.key(0))
    jax.block_until_ready(state)
    checkpointer = Checkpointer(folder, keep=1, owner=True)
    steady = steady_rss()
    with PeakRSS() as peak:
        started = time.perf_counter()
        checkpointer.save(state, {"mesh": f"fsdp={jax.device_count()}"})
        blocking = time.perf_counter() - started
        checkpointer.wait()
        total = time.perf_counter() - started
    checkpointer.close()
    return {"state_bytes": state_bytes(state), "steady": steady, "peak": peak.peak, "added": peak.peak - steady,
            "blocking_s": blocking, "total_s": total, "num_layers": program.spec.num_layers}


def restore_case(size: int, folder: Path) -> dict:
    import jax

    from meshtrain.run.checkpoint import Checkpointer, abstract_like

    program = program_of(size, jax.device_count())
    abstract = abstract_like(program.abstract_state, program.state_shardings)
    reader = Checkpointer(folder, keep=1000)
    baseline = steady_rss()
    with PeakRSS() as peak:
        started = time.perf_counter()
        _, state, _ = reader.restore_latest_intact(reader.steps(), abstract, optional=program.optional_state())
        jax.block_until_ready(state)
        total = time.perf_counter() - started
    s = state_bytes(state)
    return {"state_bytes": s, "baseline": baseline, "peak": peak.peak, "added": peak.peak - baseline - s,
            "total_s": total, "resident_after": steady_rss() - baseline}


def run_case(case: str, size: int, devices: int, folder: Path) -> dict:
    """One case in a fresh process with `devices` simulated CPU devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, __file__, "--case", case, "--size", str(size), "--dir", str(folder)],
                         env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if out.returncode:
        raise SystemExit(f"{case} on {devices} devices failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "devices": devices}


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": MB, "GB": 1 << 30}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * scale)
    return int(text)


def measure(size: int, devices: int, fewer: int, folder: Path) -> list[dict]:
    """The three cases, saved under `folder`: [save, restore same mesh, restore on `fewer` devices]."""
    folder = folder / "checkpoints"
    return [{"case": "save", **run_case("save", size, devices, folder)},
            {"case": "restore, same mesh", **run_case("restore", size, devices, folder)},
            {"case": f"restore, {fewer} devices", **run_case("restore", size, fewer, folder)}]


def table(rows: list[dict]) -> str:
    lines = ["| case | devices | S | steady (before) | peak | added | bound 0.25 S + 200 MB | within |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before = r.get("steady", r.get("baseline"))
        lines.append(f"| {r['case']} | {r['devices']} | {r['state_bytes'] / MB:,.0f} MB | {before / MB:,.0f} MB | "
                     f"{r['peak'] / MB:,.0f} MB | {r['added'] / MB:,.0f} MB | {bound(r['state_bytes']) / MB:,.0f} MB "
                     f"| {'yes' if r['added'] <= bound(r['state_bytes']) else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="train state bytes per process, e.g. 64MB, 1GB")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--restore-devices", type=int, default=4)
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--case", choices=("save", "restore"), help=argparse.SUPPRESS)  # one case, this process
    args = parser.parse_args()
    size = parse_size(args.size)
    if args.case:
        case = save_case if args.case == "save" else restore_case
        print(json.dumps(case(size, Path(args.dir))))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        rows = measure(size, args.devices, args.restore_devices, Path(folder))
    print(table(rows))
    for r in rows:
        print(f"{r['case']}: {r['total_s']:.1f} s" + (f", save() blocked {r['blocking_s']:.1f} s"
                                                        if "blocking_s" in r else ""))


if __name__ == "__main__":
    main()
