"""What every command's `main(argv)` shares: one line per failure, the exit status it means.

    @command
    def main(argv=None) -> int: ...

- `UserError` (bad input; each is raised where the input is read and names the file or flag and
  the fix) -> `error: ...` on stderr, exit 2. argparse's usage errors become one such line too
  (`Parser`), and numeric flags take their range from `number` (the config keys' `Bounds`).
- Ctrl-C where the command has nothing to save -> one line, exit 130; SIGTERM there -> one line,
  exit 143 (core/exits.py: at once, or raised as KeyboardInterrupt / `Terminated` where a lock or a
  write must be unwound first). Training catches both itself once it runs, saves, and exits 0.
- Any other exception is a bug, not bad input: its traceback is kept and a last line asks for a
  report, exit 1; it is never dressed up as a one-line `error:`.

Every command starts with `arguments(parser(), argv)`: the console, then its flags. The commands
that run JAX share their `--devices N` and `--compile-cache` too: `devices_flag(parser)` and
`compile_cache_flag(parser)` define them and `start_jax(args)` applies them (JAX is asked for that
many CPU devices, which must happen before it starts its backends: right after parsing, before
anything touches a device).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import os
import signal
import sys
import tempfile
import threading
import traceback

from meshtrain.core import compile_cache, exits
from meshtrain.core.bounds import Bounds
from meshtrain.core.console import use_console
from meshtrain.core.errors import UserError
from meshtrain.core.exits import (  # noqa: F401 - the statuses and lines, re-exported for the commands
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USER_ERROR,
    INTERRUPTED,
    TERMINATED,
    Terminated,
)

MAX_SIMULATED_DEVICES = 4096  # XLA starts 4096 CPU devices in ~15 s, 8192 in ~100 s
SIMULATE_HELP = f"simulate this many CPU devices (1 to {MAX_SIMULATED_DEVICES}), no accelerator"


def interrupted(error: KeyboardInterrupt) -> int:
    """The one line for a Ctrl-C or SIGTERM and its exit status; as a process, the exit itself
    (`exits.end`)."""
    signum = signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT
    if exits._as_process:
        exits.end(signum)
    return exits.said(signum)


def interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an error stands for: one a library turned into its own error while the
    signal's exception passed through it (a native module's import reports "initialization
    failed", chained to it), found in the error's causes and contexts; else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


MAX_ERROR_CHARS = 2000  # an error quoting the user's input (a huge value, a long path) stays a readable line


def one_line(message: str) -> str:
    """An error message as one bounded line: line breaks shown as \\n, the middle of a long one cut."""
    shown = message.replace("\r", "\\r").replace("\n", "\\n")  # user text may hold line breaks
    if len(shown) <= MAX_ERROR_CHARS:
        return shown
    cut = len(shown) - MAX_ERROR_CHARS
    return f"{shown[:MAX_ERROR_CHARS * 3 // 4]} [... {cut:,} characters cut ...] {shown[-MAX_ERROR_CHARS // 4:]}"


def command(main):
    """Wrap a command's `main(argv) -> int` (see the module doc)."""
    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        try:
            status = main(argv)
            exits.done(status)  # a signal in the teardown from here on keeps this status
            return status
        except UserError as e:
            print(f"error: {one_line(str(e))}", file=sys.stderr)
            return EXIT_USER_ERROR
        except KeyboardInterrupt as e:
            return interrupted(e)
        except Exception as e:  # noqa: BLE001 - a bug: shown whole, with where to report it
            if (signalled := interrupt_behind(e)) is not None:
                return interrupted(signalled)
            traceback.print_exc()
            print("internal error: a bug in meshtrain, not in your input; please report it with the traceback "
                  "above and the command you ran", file=sys.stderr)
            return EXIT_BUG
    return wrapped


def arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """A command's first step: the console installed (its lines as the docs show them,
    meshtrain/core/console.py), then its flags parsed (a usage error is one `error:` line, `Parser`)."""
    use_console()
    return parser.parse_args(argv)


def start_jax(args) -> None:
    """A JAX command's step before anything touches a device: `--devices` simulated
    (`simulate_devices`) and `--compile-cache` in use (meshtrain/core/compile_cache.py)."""
    simulate_devices(args.devices)
    compile_cache.use(args.compile_cache)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error raised as a UserError: one `error:` line, exit 2."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")


def number(kind: type, allowed: Bounds | None = None, **bounds):
    """An argparse `type` for a numeric flag: `kind` (int or float), finite, within `allowed` (or
    `Bounds(**bounds)`)."""
    allowed = allowed or Bounds(**bounds)

    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        problem = allowed.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value
    parse.__name__ = kind.__name__
    return parse


def devices_flag(parser, help: str = SIMULATE_HELP, type=None) -> None:
    """`--devices N` on `parser` (or an argument group): 1 to MAX_SIMULATED_DEVICES simulated CPU
    devices, checked by argparse unless the command passes its own `type` (train checks the range with
    the config key's message). The command calls `simulate_devices` with it before JAX starts."""
    parser.add_argument("--devices", type=type or number(int, min=1, max=MAX_SIMULATED_DEVICES), help=help)


def compile_cache_flag(parser) -> None:
    """`--compile-cache DIR|auto|off` on `parser` (meshtrain/core/compile_cache.py); the command passes it
    to `compile_cache.use` (None, not given: auto; train: through the config key `compile_cache`)."""
    parser.add_argument("--compile-cache", metavar="DIR|auto|off", help=compile_cache.SETTING_HELP)


def simulate_devices(count: int | None) -> None:
    """The `--devices` preamble: check JAX_PLATFORMS, ask JAX for `count` CPU devices (None or 0: the
    machine's own). Call it before anything starts JAX's backends."""
    check_platforms()
    if count:
        simulate_cpu_devices(count)


def check_platforms() -> None:
    """JAX_PLATFORMS naming an accelerator this machine lacks is one line here, not JAX's assertion (or
    "Unable to initialize backend") deep in start-up."""
    value = os.environ.get("JAX_PLATFORMS", "")
    for platform in filter(None, value.split(",")):
        if platform in ("cuda", "gpu") and no_cuda_driver():
            lacks = "no CUDA driver: libcuda.so.1 is not found"
        elif platform == "tpu" and importlib.util.find_spec("libtpu") is None:
            lacks = "no TPU runtime: libtpu is not installed"
        else:
            continue
        raise UserError(f"JAX_PLATFORMS={value} asks for {platform}, which this machine lacks ({lacks}); unset "
                        f"JAX_PLATFORMS, or set JAX_PLATFORMS=cpu to run on the CPU")


# XLA's CPU client runs each device's share of a multi-device program on a thread of one pool, of
# max(cores, devices) threads (PJRT_NPROC replaces the core count). A Python thread's dispatch takes one
# pool thread per device, and blocks it there while that device has 32 programs in flight; the programs
# with collectives run one at a time, in the order they were dispatched, each on one pool thread per
# device. So T Python threads dispatching at once need devices x (T + 1) threads: with fewer, the
# dispatches can hold every thread while the running collective waits for one device's share, and XLA
# aborts after 40 s ("Termination timeout for `all reduce ...`"). Measured with 8 devices on 2 cores: 1
# thread dies at 8 (3,000 dispatches), 2 at 16, 4 at 32; 24 carries 2 and 64 carries 4. A process asks
# for 8 per device, twice the least for DISPATCHING_THREADS. No thread count makes two Python threads
# that each keep 32 programs in flight safe: a program's collective turn is fixed when it is dispatched,
# its device's slot is taken later, so a later program can hold a device's last slot while the earlier
# one waits for it (CI, 2026-12-02, 64 threads: "only 6 of them arrived"). meshtrain's loops never do
# that: the trainer waits for step k-1 once step k is dispatched, and its prefetcher and checkpoints
# only copy (tests/test_cli.py). Threads idle are cheap: 16 -> 64 leaves the loop's time alike.
RUNNING_DEVICES = 64  # simulated meshes up to this size run programs; larger ones are planned (compile only)
DISPATCHING_THREADS = 3


def cpu_client_threads(count: int) -> None:
    """PJRT_NPROC at least 2 x (DISPATCHING_THREADS + 1) x `count` simulated devices (see above; a
    larger value stays), up to RUNNING_DEVICES devices. Before JAX starts its CPU backend."""
    if count <= RUNNING_DEVICES:
        now = os.environ.get("PJRT_NPROC", "")
        wanted = 2 * (DISPATCHING_THREADS + 1) * count
        os.environ["PJRT_NPROC"] = str(max(wanted, os.cpu_count() or 1, int(now) if now.isdigit() else 0))


def simulate_cpu_devices(count: int) -> None:
    """Ask for `count` CPU devices (and the CPU client's threads to run them: `cpu_client_threads`).
    Must run before JAX initialises its backends (JAX is imported here, when asked: `import meshtrain`
    stays light). Also meshtrain.simulate_cpu_devices and meshtrain/parallel/mesh.py's."""
    import jax

    cpu_client_threads(count)
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as e:  # backends already up: only fine if the count already matches
        if len(jax.devices("cpu")) != count:
            raise UserError(f"--devices {count} must be set before JAX starts "
                            f"(it already has {len(jax.devices('cpu'))} CPU devices)") from e


raise_interrupt = exits.on_signal  # train.py's handler while it starts


def interrupt_exits_quietly() -> None:
    """For `python -m meshtrain.<command>` (meshtrain/__init__.py, after `exits.take_signals`): a Ctrl-C
    or SIGTERM raised while the command's imports load, before `main` runs, is the same one line and
    exit 130 or 143, not a traceback; one raised where Python can only print it is sent again."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        interrupted(value)
    sys.excepthook = hook
    previous_unraisable = sys.unraisablehook

    def unraisable(report):
        """A Ctrl-C or SIGTERM raised where Python can only print it and go on (a `__del__`, a weakref
        or garbage-collection callback): sent again, to land in the command's own code."""
        if not isinstance(report.exc_value, KeyboardInterrupt):
            return previous_unraisable(report)
        signum = signal.SIGTERM if isinstance(report.exc_value, Terminated) else signal.SIGINT
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
    sys.unraisablehook = unraisable


# What JAX's CUDA plugin (the plan-gpu extra: XLA's GPU compiler without a GPU) writes to stderr as it
# loads on a machine without a GPU driver: absl's pre-initialisation notice and one line per probe.
# Harmless (JAX runs on the CPU; the planner's compile-only GPU devices need no driver), and not the
# command's own output: a failing command's stderr stays its one `error:` line.
CUDA_DRIVER_PROBE = ("All log messages before absl::InitializeLog() is called", "Could not find cuda drivers")


def no_cuda_driver() -> bool:
    """Whether this machine has no CUDA driver library to load (so JAX can run nothing on a GPU here)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def skip_cuda_check() -> bool:
    """Where JAX's CUDA plugin is installed and no CUDA driver loads, skip the plugin's CUDA version
    check (JAX_SKIP_CUDA_CONSTRAINTS_CHECK): it has no CUDA to check and would print its failure as a
    traceback on every JAX start before JAX goes on on the CPU. Whether it is skipped."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None or not no_cuda_driver():
        return False
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    return True


def import_jax_without_driver_probe() -> None:
    """For `python -m meshtrain.<command>` (meshtrain/__init__.py), where JAX's CUDA plugin is
    installed: import JAX and discover its plugins with the CUDA_DRIVER_PROBE lines taken out of what
    they write to stderr (every other line is written as it came). Plugins are discovered in that
    window where CUDA is out of the question: JAX_PLATFORMS leaves it out, or there is no CUDA driver,
    where the plugin's CUDA version check is skipped too (JAX_SKIP_CUDA_CONSTRAINTS_CHECK: it has no
    CUDA to check, and would print its failure as a traceback before JAX goes on on the CPU)."""
    if "jax" in sys.modules or importlib.util.find_spec("jax_cuda12_plugin") is None:
        return
    platforms = os.environ.get("JAX_PLATFORMS", "")
    no_cuda = (bool(platforms) and not {"cuda", "gpu"} & set(platforms.split(","))) or skip_cuda_check()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        exits.line_fd = saved  # a Ctrl-C meanwhile is said where stderr is
        try:
            import jax  # noqa: F401
            from jax._src import xla_bridge

            if no_cuda:
                getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
        finally:
            os.dup2(saved, 2)
            exits.line_fd = 2
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not any(p in line for p in CUDA_DRIVER_PROBE)))
            sys.stderr.flush()
