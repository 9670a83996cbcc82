"""8 simulated CPU devices (set before JAX starts), a shared compilation cache, and the tiny-run
harness (meshtrain/testing.py) with the single-device reference run."""
import os
import sys

# The tests' programs are tiny and compiled once each, so compiling is most of the suite's time:
# - XLA's CPU backend at LLVM optimization level 0 compiles them 2-5x faster (jit(init_state) of the
#   tiny model on fsdp=8: 4.9 s -> 1.0 s) and computes the same values (the 60-step loss of the tiny
#   run is bitwise equal) and the same buffers (the planner's memory figures are equal); runs are a
#   little slower per step, which few tests take many of.
# - XLA's elemental CPU fusion emitters (--xla_cpu_use_fusion_emitters=false; the MLIR ones are the
#   default) compile them another 2-3x faster (the tiny 2x2x2 train step: 5.0 s -> 1.9 s of CPU); a
#   20-step run's losses are equal but for the last bit of step 20's: the suite in 18:24 instead of
#   29:04 (clean-clone CI). (Two full runs with them lost a worker to a SIGABRT, cause unknown, its
#   message lost to fd capture; eight full runs with them since, none did. One of those hung instead, in
#   multiprocessing.Pool's terminate: a race of `prepare`'s, mended in meshtrain/data/prepare.py.
#   pytest now captures at the sys level (pyproject.toml), so what C++ writes to stderr before an
#   abort reaches the log.)
# The subprocesses the tests start inherit both.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
       "--xla_cpu_use_fusion_emitters=false"])
# Where the environment asks Python not to write bytecode, every CLI subprocess would compile
# meshtrain's sources again (~0.8 s each): the suite's processes write it (to __pycache__ folders,
# which git ignores).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
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
