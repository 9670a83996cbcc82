"""8 simulated CPU devices (set before JAX starts) and a memoized tiny training run."""
import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One compilation cache per test session, shared with the CLI subprocesses: tests that compile the
# same program (a rerun after SIGKILL, a resume) load it instead of compiling it again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtrain-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
_RUNS = {}


def tiny_config(*overrides, out=None):
    """The tiny config in a fresh output folder (never resuming another test's checkpoint)."""
    import tempfile

    from meshtrain.config import load_config

    out = out or tempfile.mkdtemp(prefix="meshtrain-test-")
    return load_config(TINY, [f"out={out}", "checkpoint.resume=never", *overrides])


def run_tiny(*overrides, devices=None):
    """Train the tiny config (5 steps) and return (trainer, per-step losses, final params).
    Memoized: the parity, sharding and memory tests share compiled runs."""
    from meshtrain.metrics import MetricsLog
    from meshtrain.trainer import Trainer

    key = (overrides, None if devices is None else len(devices))
    if key not in _RUNS:
        trainer = Trainer(tiny_config(*overrides), devices=devices)
        history = trainer.fit(log=MetricsLog("/tmp/meshtrain-tests", primary=False))
        trainer.grad_norms = np.array([r["grad_norm"] for r in history if "loss" in r])
        losses = np.array([r["loss"] for r in history if "loss" in r])
        _RUNS[key] = (trainer, losses, jax.device_get(trainer.state["params"]))
    return _RUNS[key]


@pytest.fixture(scope="session")
def reference_run():
    """The single-device run every layout must reproduce."""
    return run_tiny("mesh=1", devices=jax.devices()[:1])
