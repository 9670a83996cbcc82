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
# - XLA's elemental CPU fusion emitters (--xla_cpu_use_fusion_emitters=false) compile them about 2x
#   faster again (three tiny layouts: 31 s -> 18 s; the suite: 58 -> 28 min); they may place buffers a
#   little differently (the planner's XLA:CPU figures move by bytes; its commands keep XLA's default).
# - One LLVM module per program (--xla_cpu_parallel_codegen_split_count=1): the workers already keep
#   both cores busy, so splitting codegen over threads only adds work.
# The workers' and subprocesses' CPU clients get 8 threads per device (meshtrain/core/cli.py
# `cpu_client_threads`: with fewer, Python threads dispatching at once, a loop and its prefetcher, can
# starve a collective into XLA's "Termination timeout" abort, whichever emitters compiled it; a test
# dispatches from one thread at a time or waits as the trainer does). A collective whose last device
# thread is late waits 240 s before XLA aborts the worker, not 40 (--xla_cpu_collective_call_terminate_
# timeout_seconds): a clean CI run on 2 busy cores aborted test_fp16's resume test so, seven of eight
# participants arrived at an all-gather. The subprocesses inherit all this.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
       "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1",
       "--xla_cpu_collective_call_terminate_timeout_seconds=240"])
from meshtrain.core import compile_cache  # noqa: E402  (neither imports JAX)
from meshtrain.core.cli import cpu_client_threads  # noqa: E402

cpu_client_threads(8)
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
# The compilation cache (meshtrain/core/compile_cache.py), shared by the workers and the commands they
# start, outlives the session: a rerun on this machine loads what an earlier run compiled (JAX keys an
# entry by the program, the XLA flags and the versions, so a changed program compiles again).
# MESHTRAIN_TEST_COMPILE_CACHE=fresh: an empty one, removed at exit (the budget's cold run); a folder: that.
_TEST_CACHE_MAX_BYTES = 2 * 2**30  # a full run writes ~120 MB
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import shutil

    _cache = os.environ.get("MESHTRAIN_TEST_COMPILE_CACHE", str(compile_cache.default_folder().parent / "xla-tests"))
    if _cache == "fresh":
        import atexit
        import tempfile

        _cache = tempfile.mkdtemp(prefix="meshtrain-jax-cache-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    elif os.path.isdir(_cache) and sum(f.stat().st_size for f in os.scandir(_cache)) > _TEST_CACHE_MAX_BYTES:
        shutil.rmtree(_cache, ignore_errors=True)  # past its bound: this run starts it afresh
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Unbounded for every process that writes there (compile_cache.use keeps JAX's setting in JAX's folder):
    # JAX's bounded cache reads every entry's access time on each write, ~0.1-0.3 s with a full suite's
    # 3,600 entries, minutes over a run; the bound above is applied once, here, instead.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
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
compile_cache.use("auto")  # the folder and bound above, for the tests' own compiles too


@pytest.fixture(scope="session")
def reference_run():
    """The single-device run every layout must reproduce."""
    return run_tiny("parallel.mesh=1", devices=jax.devices()[:1])


# XLA:CPU maps memory for every compiled program's code. A worker that compiles ~600 tests' programs
# reaches the kernel's default vm.max_map_count (65,530 regions): LLVM then fails with "Cannot allocate
# memory" and the worker crashes. Past the mark
# below, the worker lets its programs go: the memoized runs and JAX's caches (later tests compile again,
# or load from the session's compilation cache); the next mark is set above what is left mapped, so a
# worker whose regions stay mapped does not clear after every test.
_maps_mark = [int(os.environ.get("MESHTRAIN_TEST_MAPS_MARK", 40_000))]


def _mapped_regions() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True)
def _release_programs_near_the_map_limit(request):
    yield
    if not os.path.exists("/proc/self/maps"):
        return
    regions = _mapped_regions()
    _worker_status(f"after {request.node.nodeid}: {regions:,} mapped regions (mark {_maps_mark[0]:,})")
    if regions > _maps_mark[0]:
        import gc

        from meshtrain import testing

        _worker_status(f"releasing the programs after {request.node.nodeid} at {regions:,} mapped regions")
        testing._RUNS.clear()
        jax.clear_caches()
        gc.collect()
        _maps_mark[0] = max(_maps_mark[0], _mapped_regions() + 10_000)
        _worker_status(f"released after {request.node.nodeid}: {_mapped_regions():,} mapped regions left")


# A worker killed by a fatal signal (an XLA check's abort, a segfault) takes its evidence with it:
# pytest-xdist names the test and the log holds faulthandler's dump somewhere in the middle. Each
# worker writes that dump to a file, and a status line after every test (its mapped regions, a
# release under way) to another; the controller puts both into the crashed test's report
# (`pytest_handlecrashitem`), which CI prints near the end of its log: the other threads' tops first,
# then the status, the fatal error and the crashing thread's innermost frames last, where a log's
# tail shows them.
CRASHES = "MESHTRAIN_TEST_CRASH_DIR"
_crash_dump: list = []  # the worker's open dump file (faulthandler writes to its descriptor)


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin enabled it on stderr: this file instead
def pytest_configure(config):
    import faulthandler
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        os.environ.setdefault(CRASHES, tempfile.mkdtemp(prefix="meshtrain-test-crashes-"))  # the workers inherit it
    elif os.environ.get(CRASHES):
        _crash_dump.append(open(os.path.join(os.environ[CRASHES], f"{worker}.dump"), "w"))
        faulthandler.enable(_crash_dump[0], all_threads=True)


def _worker_status(line: str) -> None:
    worker, folder = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(CRASHES)
    if worker and folder:
        with open(os.path.join(folder, f"{worker}.status"), "w") as f:
            f.write(line + "\n")


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    folder = os.environ.get(CRASHES)
    if gateway is None or not folder:
        return
    read = lambda suffix: (open(path, errors="replace").read() if os.path.exists(
        path := os.path.join(folder, f"{gateway.id}.{suffix}")) else "")
    blocks = [b.splitlines() for b in read("dump").split("\n\n") if b.strip()]
    fatal = [b for b in blocks if b[0].startswith("Fatal Python error")]
    current = [b for b in blocks if b[0].startswith("Current thread")]
    others = [line for b in blocks if b[0].startswith("Thread ") for line in b[:3]]
    said = [*others, read("status").strip(), *(fatal[0][:1] if fatal else []), *(current[0][:14] if current else [])]
    report.longrepr = "\n".join([str(report.longrepr), "", *filter(None, said)])
