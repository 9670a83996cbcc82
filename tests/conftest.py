"""8 simulated CPU devices (set before JAX starts), a shared compilation cache, and the tiny-run
harness (meshtrain/testing.py) with the single-device reference run."""
import logging
import os
import sys

# The tests' programs are tiny and compiled once each, so compiling is most of the suite's time:
# - XLA's CPU backend at LLVM optimization level 0 compiles them 2-5x faster (jit(init_state) of the
#   tiny model on fsdp=8: 4.9 s -> 1.0 s) and computes the same values (the 60-step loss of the tiny
#   run is bitwise equal) and the same buffers (the planner's memory figures are equal); runs are a
#   little slower per step, which few tests take many of.
# - Not XLA's elemental CPU fusion emitters (--xla_cpu_use_fusion_emitters=false): they compile the
#   tests' programs 2-3x faster (the suite in ~18.5 min instead of ~29), but with them a worker aborts now
#   and then (3 of 14 full runs): XLA's check failure "AwaitAndLogIfStuck" in
#   InProcessCommunicator::AllGather, a rendezvous of the 8 simulated devices that one of them never
#   reached within XLA's timeouts (the stop-34 CI log). No run without them is known to have.
# The subprocesses the tests start inherit it.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"])
# Where the environment asks Python not to write bytecode, every CLI subprocess would compile
# meshtrain's sources again (~0.8 s each): the suite's processes write it (to __pycache__ folders,
# which git ignores).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Tests run on the CPU. With the plan-gpu extra installed (the test extra brings it), JAX would also try
# the CUDA plugin at start and print that no CUDA driver is there; the planner's GPU compiles take their
# compile-only devices from a topology (meshtrain/planner/compilers.py), not from a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache per test session, shared with the CLI subprocesses: tests that compile the
# same program (a rerun after SIGKILL, a resume) load it instead of compiling it again. The process
# that makes it (pytest's, before its xdist workers start; they inherit it) removes it at its exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtrain-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from meshtrain.core.console import use_console  # noqa: E402
from meshtrain.testing import MOE_TINY, ROOT, TINY, max_param_diff, run_tiny, tiny_config  # noqa: E402, F401

# The library speaks through the `meshtrain` logger (meshtrain/core/console.py). The tests' processes
# show it as a command does (info on stdout, `notice:`/`warning:`/`error:` lines on stderr), whichever
# test ran first: capsys sees what a user would; caplog sees the records, which reach its handler on
# the root logger because they still propagate here (a command's console stops that; pytest's own
# root handlers print nothing).
use_console()
logging.getLogger("meshtrain").propagate = True


@pytest.fixture(scope="session")
def reference_run():
    """The single-device run every layout must reproduce."""
    return run_tiny("parallel.mesh=1", devices=jax.devices()[:1])


# XLA:CPU maps memory for every compiled program's code. A worker that compiles ~600 tests' programs
# reaches the kernel's default vm.max_map_count (65,530 regions): LLVM then fails with "Cannot allocate
# memory" and the worker crashes (the stop-51 CI lost one that way in test_fp16, at 97%). Past the mark
# below, the worker lets its programs go: the memoized runs and JAX's caches (later tests compile again,
# or load from the session's compilation cache); the next mark is set above what is left mapped, so a
# worker whose regions stay mapped does not clear after every test.
_maps_mark = [int(os.environ.get("MESHTRAIN_TEST_MAPS_MARK", 40_000))]


def _mapped_regions() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True)
def _release_programs_near_the_map_limit():
    yield
    if os.path.exists("/proc/self/maps") and _mapped_regions() > _maps_mark[0]:
        import gc

        from meshtrain import testing

        testing._RUNS.clear()
        jax.clear_caches()
        gc.collect()
        _maps_mark[0] = max(_maps_mark[0], _mapped_regions() + 10_000)
