"""Batches built ahead in a background thread: the same batches as building them in the loop, in
any order the guard asks for them (rollbacks, skipped batches), with build errors raised in the loop."""
import threading

import pytest

from meshtrain.data.prefetch import Prefetcher


def recording_build(log):
    def build(index):
        log.append((index, threading.current_thread().name))
        if index == 99:
            raise ValueError("cannot read batch 99")
        return f"batch {index}"
    return build


@pytest.mark.fast
def test_prefetch_builds_ahead_in_a_thread_and_misses_rebuild_the_right_batch():
    log = []
    prefetch = Prefetcher(recording_build(log), depth=2)
    wanted = [0, 1, 2, 3, 1, 2, 5, 6]  # a rollback to 1, then the guard skips batch 4
    got = [prefetch.get(i, [j for j in wanted[n + 1:n + 3]]) for n, i in enumerate(wanted)]
    prefetch.close()
    assert got == [f"batch {i}" for i in wanted]
    in_thread = {i for i, name in log if name.startswith("meshtrain-prefetch")}
    assert {2, 3, 5, 6} <= in_thread and prefetch.misses == 1  # only the very first batch is a miss


@pytest.mark.fast
def test_prefetch_off_builds_in_the_loop_and_errors_surface_in_the_loop():
    log = []
    prefetch = Prefetcher(recording_build(log), depth=0)
    assert prefetch.get(7, [8]) == "batch 7" and log == [(7, threading.current_thread().name)]
    ahead = Prefetcher(recording_build([]), depth=1)
    ahead.get(0, [99])
    with pytest.raises(ValueError, match="cannot read batch 99"):
        ahead.get(99, [])
    ahead.close()


def test_training_with_and_without_prefetch_is_identical(reference_run):
    import jax
    import numpy as np
    from conftest import run_tiny

    _, ref_losses, ref_params = reference_run  # data.prefetch=1, the default
    _, losses, params = run_tiny("parallel.mesh=1", "data.prefetch=0", devices=jax.devices()[:1])
    np.testing.assert_array_equal(losses, ref_losses)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(a, b)
