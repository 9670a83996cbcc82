"""8 simulated CPU devices (set before JAX starts), a shared compilation cache, and the tiny-run
harness (meshtrain/testing.py) with the single-device reference run."""
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

import jax  # noqa: E402
import pytest  # noqa: E402

from meshtrain.testing import MOE_TINY, ROOT, TINY, max_param_diff, run_tiny, tiny_config  # noqa: E402, F401


@pytest.fixture(scope="session")
def reference_run():
    """The single-device run every layout must reproduce."""
    return run_tiny("parallel.mesh=1", devices=jax.devices()[:1])
