"""The persistent compilation cache (meshtrain/core/compile_cache.py): where `compile_cache` points,
a bad folder as one error, JAX's size bound set, and a run whose train step is loaded from the cache
trains bitwise as the run that compiled it."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from meshtrain.core import compile_cache
from meshtrain.core.errors import UserError


@pytest.fixture
def restore_cache():
    """Each test may move the cache: the suite's own is set back after it."""
    yield
    compile_cache.use("auto")


@pytest.mark.fast
def test_the_setting_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert compile_cache.folder_for("auto") == tmp_path / "home" / ".cache" / "meshtrain" / "xla"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # XDG: only an absolute path counts
    assert compile_cache.default_folder() == tmp_path / "home" / ".cache" / "meshtrain" / "xla"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.folder_for("") == tmp_path / "xdg" / "meshtrain" / "xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))  # the folder JAX was given wins
    assert compile_cache.folder_for("auto") == tmp_path / "jax"
    assert compile_cache.folder_for(str(tmp_path / "mine")) == tmp_path / "mine"
    assert compile_cache.folder_for("off") is None


@pytest.mark.fast
def test_a_folder_that_cannot_be_made_is_one_error(tmp_path, restore_cache):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"compile_cache .*file/xla cannot be created .*--compile-cache off"):
        compile_cache.use(str(tmp_path / "file" / "xla"))


@pytest.mark.fast
def test_the_cache_is_owner_only_evicts_past_its_bound_and_can_be_turned_off(tmp_path, restore_cache):
    x = jnp.ones(5)  # made first: each window below compiles the one program it names
    folder = compile_cache.use(str(tmp_path / "c"), max_gb=0.5)
    assert folder == tmp_path / "c" and (folder.stat().st_mode & 0o777) == 0o700
    assert jax.config.jax_compilation_cache_max_size == 2**29 and jax.config.jax_enable_compilation_cache
    outcome = compile_cache.Outcome()
    jax.jit(lambda x: x * 3 + 1).lower(x).compile()
    assert outcome.loaded is False and outcome.verb("it") == "compiled it"
    assert any(p.name.endswith("-cache") for p in folder.iterdir())  # written
    jax.clear_caches()  # the process's own caches: the next compile asks the folder
    outcome = compile_cache.Outcome()
    jax.jit(lambda x: x * 3 + 1).lower(x).compile()
    assert outcome.loaded is True and outcome.verb("it") == "loaded it from the compilation cache"
    entries = [p for p in folder.iterdir() if p.name.endswith("-cache")]
    bound = 1.5 * sum(p.stat().st_size for p in entries)  # bytes
    compile_cache.use(str(folder), max_gb=bound / 2**30)
    for k in range(4, 8):  # four more programs: the least recently used are evicted to stay within the bound
        jax.jit(lambda x, k=k: x * k + 1).lower(x).compile()
    kept = [p for p in folder.iterdir() if p.name.endswith("-cache")]
    assert sum(p.stat().st_size for p in kept) <= bound and len(kept) < len(entries) + 4
    assert compile_cache.use("off") is None and not jax.config.jax_enable_compilation_cache
    jax.clear_caches()
    outcome = compile_cache.Outcome()
    jax.jit(lambda x: x * 3 + 1).lower(x).compile()
    assert outcome.loaded is None  # nothing asked the cache


def entries(folder):
    """The programs a cache folder holds (JAX writes `<key>-cache`, and `<key>-atime` when bounded)."""
    return {p.name for p in folder.iterdir() if p.name.endswith("-cache")}


@pytest.mark.fast
def test_suspended_writes_nothing_inside_and_the_cache_serves_again_after(tmp_path, restore_cache):
    """The planner's GPU compiles run `suspended`: no entry is written for them (JAX could not load it
    back: "PjRtCompiler must be constructed with a Client"), whether the cache was in use before (JAX's
    once-per-process check would keep it on) or first asked inside (it would stay off after)."""
    from jax.sharding import SingleDeviceSharding

    from meshtrain.planner import compilers

    x, gpu = jnp.ones(7), compilers.choose("gpu", "h100", 1, 8).devices[0]
    gpu_input = jax.ShapeDtypeStruct((7,), jnp.float32, sharding=SingleDeviceSharding(gpu))
    for first_inside in (False, True):
        folder = compile_cache.use(str(tmp_path / f"c{first_inside}"))
        if not first_inside:
            jax.jit(lambda x: x * 3 + 2).lower(x).compile()  # the cache in use before
        written = entries(folder)
        with compile_cache.suspended():
            jax.jit(lambda x: jnp.tanh(x) * 3).lower(gpu_input).compile()
        assert entries(folder) == written
        outcome = compile_cache.Outcome()
        jax.jit(lambda x: x * 4 + 2).lower(x).compile()  # after: asked and written
        assert outcome.loaded is False and len(entries(folder)) == len(written) + 1


def test_a_step_loaded_from_the_cache_trains_bitwise_as_the_compiled_one(tmp_path, caplog, restore_cache):
    """Two fresh runs on 2x2x2 with their own cache folder: the first compiles its train step and writes
    it, the second (JAX's in-process caches cleared) loads it; losses, gradient norms and every array of
    the final state (parameters and optimizer state: what the checkpoint holds) are bitwise equal."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    runs = []
    for _ in range(2):
        jax.clear_caches()
        caplog.clear()
        trainer = Trainer(tiny_config("parallel.mesh=2x2x2", f"compile_cache={tmp_path / 'cache'}",
                                      "train.steps=3"))
        history = trainer.fit(log=MetricsLog(trainer.out, primary=False))
        said = [r.getMessage() for r in caplog.records if "the train step" in r.getMessage()]
        runs.append((trainer.step_from_cache, said, [(r["loss"], r["grad_norm"]) for r in history if "loss" in r],
                     jax.device_get(trainer.state)))
    (cold, said_cold, metrics_cold, state_cold), (warm, said_warm, metrics_warm, state_warm) = runs
    assert (cold, warm) == (False, True)
    assert said_cold[-1].startswith("compiled the train step in ")
    assert said_warm[-1].startswith("loaded the train step from the compilation cache in ")
    assert metrics_cold == metrics_warm and len(metrics_cold) == 3
    for a, b in zip(jax.tree.leaves(state_cold), jax.tree.leaves(state_warm), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert os.listdir(tmp_path / "cache")
