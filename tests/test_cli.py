"""`python -m meshtrain.train` end to end on the default corpus (the Python standard library); every
command's failures through meshtrain/core/cli.py."""
import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from conftest import TINY as TINY_PATH

from meshtrain.core.errors import UserError
from meshtrain.core.exits import TERMINATED, Terminated


def test_cli_trains_on_default_corpus_and_writes_metrics(tmp_path):
    cmd = [sys.executable, "-m", "meshtrain.train", "--devices", "8", "--mesh", "data=2,fsdp=2,tensor=2",
           "--steps", "60", "--batch-size", "16", "--seq-len", "64", "--out", str(tmp_path),
           "--set", "model.num_layers=2", "--set", "model.d_model=64", "--set", "optim.lr=3e-3",
           "--set", "optim.warmup_steps=10", "--set", "train.log_every=10", "--set", "train.eval_every=30"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh data=2,fsdp=2,tensor=2,pipeline=1" in proc.stdout
    assert "tokens/s" in proc.stdout

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
    assert [r["step"] for r in evals] == [30, 60]
    for r in train:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s"} <= r.keys()
        assert r["tokens_per_sec"] > 0 and r["grad_norm"] > 0
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]

    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["parallel"]["mesh"] == "data=2,fsdp=2,tensor=2" and resolved["train"]["steps"] == 60


# ---- every command's main through meshtrain/core/cli.py: one line per failure, the exit status it means ----
# (command, argv with its required arguments, the function its main calls once the arguments are parsed)
COMMANDS = {
    "train": ("meshtrain.train", ["--config", "configs/tiny.yaml"], "run"),
    "plan": ("meshtrain.plan", ["--config", "configs/tiny.yaml", "--devices", "8"], "meshtrain.planner.aot.run"),
    "generate": ("meshtrain.generate", ["--run", "runs/none", "--prompt", "a", "--max-new-tokens", "1"],
                 "encode_prompts"),
    "convert": ("meshtrain.convert", ["--from-hf", "hf", "--out", "run"], "from_hf"),
    "quantize": ("meshtrain.convert", ["--quantize", "int8", "run", "out"], "meshtrain.run.int8_export.export_int8"),
    "sweep": ("meshtrain.sweep.__main__", ["--space", "space.yaml", "--trials", "1"], "prepare"),
    "report": ("meshtrain.report", ["run"], "load_run"),
    "prepare": ("meshtrain.data.__main__", ["prepare", "src", "--out", "out"], "detect"),
    "train-tokenizer": ("meshtrain.data.__main__", ["train-tokenizer", "src", "--vocab-size", "300", "--out", "t.json"],
                        "detect"),
    "ray_launch": ("meshtrain.ray_launch", ["--nodes", "1", "--", "--config", "configs/tiny.yaml"], "launch"),
}


def stubbed_main(monkeypatch, command: str, work):
    """The command's main, with the work after parsing replaced by `work`."""
    import importlib

    module_name, argv, target = COMMANDS[command]
    module = importlib.import_module(module_name)
    owner, _, name = target.rpartition(".")
    monkeypatch.setattr(importlib.import_module(owner) if owner else module, name, work)
    if command == "ray_launch":
        monkeypatch.setitem(sys.modules, "ray", type(sys)("ray"))  # no cluster: launch() is the work
        sys.modules["ray"].init = sys.modules["ray"].shutdown = lambda *a, **k: None
        sys.modules["ray"].is_initialized = lambda: False
    return module.main, argv


def raising(error):
    def work(*args, **kwargs):
        raise error
    return work


def import_error_from(signal_error):
    try:
        try:
            raise signal_error
        except KeyboardInterrupt as e:
            raise ImportError("initialization failed") from e
    except ImportError as e:
        return e


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("error,code,last_line", [
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C); run the command again to redo it"),
    (UserError("bad input; fix it"), 2, "error: bad input; fix it"),
    (RuntimeError("a bug"), 1, "internal error: a bug in meshtrain, not in your input; please report it with the "
                               "traceback above and the command you ran"),
    # SIGTERM raised while a native module initialised: the import reports its own error, chained to it
    (import_error_from(Terminated()), 143, TERMINATED),
], ids=["ctrl-c", "user-error", "bug", "sigterm-inside-an-import"])
def test_every_command_reports_a_failure_in_one_line(command, error, code, last_line, monkeypatch, capsys):
    main, argv = stubbed_main(monkeypatch, command, raising(error))
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == last_line
    if code == 1:  # a bug keeps its traceback, to be reported
        assert err[0] == "Traceback (most recent call last):" and "RuntimeError: a bug" in err
    else:
        assert len(err) == 1


@pytest.mark.parametrize("command,flags,message", [
    ("generate", ["--temperature", "nan"], "argument --temperature: nan must be a finite number >= 0"),
    ("generate", ["--top-p", "0"], "argument --top-p: 0 must be in (0, 1]"),
    ("generate", ["--max-new-tokens", "0"], "argument --max-new-tokens: 0 must be >= 1"),
    ("generate", ["--devices", "99999"], "argument --devices: 99999 must be in [1, 4096]"),
    ("plan", ["--headroom", "1"], "argument --headroom: 1 must be in [0, 1)"),
    ("plan", ["--device-memory", "0GB"], "argument --device-memory: 0 must be > 0"),
    ("plan", ["--device-memory", "infGB"], "argument --device-memory: inf must be a finite number > 0"),
    ("plan", ["--mem-fraction", "nan"], "argument --mem-fraction: nan must be a finite number in (0, 1]"),
    ("convert", ["--max-shard-gb", "0"], "argument --max-shard-gb: 0 must be > 0"),
    ("prepare", ["--workers", "0"], "argument --workers: 0 must be in [1, 1024]"),
    ("train-tokenizer", ["--vocab-size", "x"], "argument --vocab-size: 'x' is not a valid int"),
    ("ray_launch", ["--cpus-per-node", "-1"], "argument --cpus-per-node: -1 must be > 0"),
    ("train", ["--init-timeout", "0"], "argument --init-timeout: 0 must be >= 1"),
    ("sweep", ["--devices", "0"], "argument --devices: 0 must be in [1, 4096]"),
    ("report", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_flags_out_of_range_are_one_line_errors(command, flags, message, monkeypatch, capsys):
    main, argv = stubbed_main(monkeypatch, command, raising(AssertionError("the work must not start")))
    if command == "ray_launch":
        argv = [*flags, *argv]
    else:
        argv = [*argv, *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.endswith(" --help\n") and err.count("\n") == 1, err


def test_generate_refuses_an_absurd_length_before_loading(tmp_path, capsys):
    """--max-new-tokens 10^9: the KV cache by formula, against the device's memory; no weights are read."""
    import time

    from meshtrain.generate import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text())
    started = time.perf_counter()
    code = main(["--run", str(run), "--prompt", "hello", "--tokenizer", "byte", "--max-new-tokens", "1000000000"])
    err = capsys.readouterr().err
    assert code == 2 and time.perf_counter() - started < 10, err  # no weights read, nothing compiled
    assert err.startswith("error: --max-new-tokens 1000000000 needs at least ") and "the KV cache of 1 row(s) x " \
        "1,000,000,004 positions" in err and err.endswith("generate fewer tokens or fewer prompts at once\n")
    assert main(["--run", str(run), "--prompt", "hi", "--tokenizer", "byte", "--max-new-tokens", "2147483647"]) == 2
    assert "2,147,483,648 positions exceed the 2^31 - 1 a position id holds" in capsys.readouterr().err


def test_a_pipeline_of_100000_stages_is_refused_before_tracing():
    """10^5 stages need 10^5 devices; at any device count, the layers must divide into the stages."""
    from meshtrain.config.loader import load_config
    from meshtrain.config.validate import check_layout
    from meshtrain.parallel.mesh import parse_mesh
    from meshtrain.parallel.sharding import make_rules

    with pytest.raises(UserError, match="mesh 1x1x1x100000 needs 100000 devices, found 8"):
        parse_mesh("1x1x1x100000", 8)
    cfg = load_config(TINY_PATH, ["parallel.microbatches=200000", "train.batch_size=200000"])
    sizes = parse_mesh("1x1x1x100000", 100000)
    with pytest.raises(UserError, match=r"model.num_layers=4 is not divisible by pipeline stages \(100000\)"):
        check_layout(cfg.model, cfg.parallel, cfg.train, sizes, make_rules(), "cpu")


def test_simulated_devices_run_a_loop_far_ahead_and_three_loops_that_wait_as_the_trainer_does():
    """`simulate_cpu_devices(8)` gives XLA's CPU client 8 threads per device (PJRT_NPROC, core/cli.py
    `cpu_client_threads`): one Python thread dispatches 1,000 8-device all-gathers never waited on (a
    decode loop, a test's step loop: XLA's 32 programs in flight per device are reached), then three
    threads (the trainer's loop, its prefetcher, a checkpoint's copies) each dispatch 1,000 keeping at
    most 2 in flight, as the trainer does (it waits for step k-1 once step k is dispatched), and all
    complete. Three threads each running far ahead are what no meshtrain loop does and no thread count
    makes safe (core/cli.py). A process of its own: the thread count is read when JAX starts its CPU
    backend."""
    script = """
import threading
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from meshtrain.core.cli import simulate_cpu_devices
simulate_cpu_devices(8)
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
split, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
step = jax.jit(lambda x: jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, whole) + 1.0, split))
ends = [None] * 4
def loop(i, ahead):
    x, dispatched = jax.device_put(jnp.zeros((8, 64)), split), []
    for _ in range(1000):
        x = step(x)
        dispatched.append(x)
        if ahead and len(dispatched) > ahead:
            dispatched.pop(0).block_until_ready()
    ends[i] = x
loop(0, None)
threads = [threading.Thread(target=loop, args=(i, 2)) for i in (1, 2, 3)]
for t in threads: t.start()
for t in threads: t.join()
print(sum(float(x[0, 0]) for x in ends))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "XLA_FLAGS": "--xla_backend_optimization_level=0"})
    assert done.returncode == 0 and done.stdout.split()[-1] == "4000.0", done.stderr[-2000:]
