"""The persistent compilation cache: compiled XLA programs kept on disk, so a restart after a
preemption, an `eval` or `generate` of the same run, or a sweep trial of an earlier trial's shape
loads its programs instead of compiling them again.

It is JAX's own cache (`jax_compilation_cache_dir`), set up here, not a cache of ours:
- JAX keys an entry by the program (its HLO without source locations, so two clones of a project
  share entries), the compile options and XLA flags, the devices and the backend with its version,
  and jax/jaxlib's versions: an entry is only loaded where it is the program that would be compiled.
- Entries are written whole and evicted under a file lock (JAX's LRUCache, `filelock`): the processes
  of a host share one folder safely. Past `max_gb` the least recently used entries are evicted. The
  folder JAX was given (JAX_COMPILATION_CACHE_DIR) keeps JAX's bound (JAX_COMPILATION_CACHE_MAX_SIZE,
  none by default), which every process that writes there must share: JAX's eviction needs each
  entry's access time, which an unbounded writer does not record.
- Multi-host: each host reads and writes its own folder (the default is in the user's home); where
  the folder is shared, JAX's own rules for several processes apply.
- The folder is trusted code: whoever can write into it can make this process run what they wrote
  (JAX's warning). It is created readable by its owner only.

`compile_cache` (config key and the commands' `--compile-cache`): `auto` is the folder JAX was given
(JAX_COMPILATION_CACHE_DIR) or else $XDG_CACHE_HOME/meshtrain/xla (~/.cache/meshtrain/xla); a path is
that folder; `off` turns it off. `Outcome` tells whether a compile came from the cache; the planner's
GPU compiles run `suspended` (compile-only devices cannot load a cached program).
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

from meshtrain.core.errors import UserError
from meshtrain.core.folders import local

DEFAULT_MAX_GB = 10.0  # the cache's bound: past it, least recently used entries are evicted
MIN_COMPILE_S = 0.1  # programs that compile faster are not written (JAX's default is 1 s; see `use`)
SETTING_HELP = ("the persistent compilation cache (docs/operating.md): auto ($JAX_COMPILATION_CACHE_DIR, else "
                "$XDG_CACHE_HOME/meshtrain/xla, default ~/.cache/meshtrain/xla), a folder, or off")
HITS, REQUESTS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/compile_requests_use_cache"
_events: Counter = Counter()  # JAX's cache events in this process (`_count`)
_applied: dict = {}  # what `use` last set: {"folder": Path | None, "max_bytes": int}


def default_folder() -> Path:
    """$XDG_CACHE_HOME/meshtrain/xla, or ~/.cache/meshtrain/xla (the XDG base directory rules)."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"  # XDG: a relative value is ignored
    return root / "meshtrain" / "xla"


AUTO = (None, "", "auto")  # a command's flag not given, the config key's default


def folder_for(setting: str | None) -> Path | None:
    """The folder a `compile_cache` setting names; None for `off`."""
    if setting == "off":
        return None
    if setting in AUTO:
        return Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_folder())
    return local(setting, "compile_cache").expanduser()


def use(setting: str | None = "auto", max_gb: float = DEFAULT_MAX_GB) -> Path | None:
    """Point JAX's persistent compilation cache at `setting`'s folder (created, owner-only), bounded to
    `max_gb`; `off` turns it off. Call before the compiles it should serve; a later call with another
    folder moves the cache. Returns the folder (None: off)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    folder, max_bytes = folder_for(setting), int(max_gb * 2**30)
    if setting in AUTO and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        # JAX's folder, under JAX's bound (-1: none): its other users write entries that the bounded cache's
        # eviction could not read (no access time is written for them), so all keep JAX's one setting.
        max_bytes = int(os.environ.get("JAX_COMPILATION_CACHE_MAX_SIZE", -1))
    if _applied == {"folder": folder, "max_bytes": max_bytes}:
        return folder
    if folder is not None:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"compile_cache {folder} cannot be created ({e.strerror}); pass --compile-cache DIR "
                            f"with a writable folder, or --compile-cache off") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"compile_cache {folder} is not writable; pass --compile-cache DIR with a writable "
                            f"folder, or --compile-cache off")
    if not _applied:
        jax.monitoring.register_event_listener(_count)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            # JAX skips programs compiled in under 1 s; on a CPU a small model's step is such a program,
            # and loading one (~10 ms) still beats compiling it.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_enable_compilation_cache", folder is not None)
    jax.config.update("jax_compilation_cache_dir", None if folder is None else str(folder))
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    compilation_cache.reset_cache()  # JAX opens its cache once, at the first compile after this
    _applied.update(folder=folder, max_bytes=max_bytes)
    return folder


@contextlib.contextmanager
def suspended():
    """No cache inside: for compile-only devices (the planner's GPU compiles), whose programs JAX can
    write to the cache but not load back. JAX decides once per process whether it uses the cache (at the
    first compile after `reset_cache`), so the switch resets it on the way in and out: without, a cache
    already in use stays on inside, and one first asked inside stays off for the rest of the process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def _count(event: str, **_) -> None:
    if event in (HITS, REQUESTS):
        _events[event] += 1


class Outcome:
    """Whether the compiles since `Outcome()` came from the cache: `loaded` is True when each that asked
    the cache found its program there (False where any compiled; None: none asked)."""

    def __init__(self):
        self.before = Counter(_events)

    @property
    def loaded(self) -> bool | None:
        asked, hits = (_events[e] - self.before[e] for e in (REQUESTS, HITS))
        return None if not asked else hits == asked

    def verb(self, what: str) -> str:
        """`compiled the train step` or `loaded the train step from the compilation cache`."""
        return f"loaded {what} from the compilation cache" if self.loaded else f"compiled {what}"
