"""Batches built ahead, in a background thread, while the device runs the current step.

The batch of a step is a pure function of its index (meshtrain/data/batches.py), so prefetching cannot
change the data: a miss (after a guard rollback, or when the guard has just skipped a batch) only
means that one batch is built in the loop instead.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Prefetcher:
    def __init__(self, build: Callable[[int], object], depth: int):
        self.build, self.depth = build, depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-prefetch") if depth else None
        self.ahead: dict[int, Future] = {}  # batch index -> the batch being built
        self.misses = 0
        self.waited = 0.0  # seconds the loop spent waiting for (or building) its batches

    def get(self, index: int, upcoming: list[int]):
        """The batch `index`; then start building the `upcoming` ones (the next steps' indices)."""
        started, future = time.perf_counter(), self.ahead.pop(index, None)
        if future is None:
            self.misses += bool(self.pool)
            batch = self.build(index)
        else:
            batch = future.result()  # re-raises an error of the build, in the loop
        self.waited += time.perf_counter() - started
        wanted = upcoming[:self.depth]
        for stale in set(self.ahead) - set(wanted):
            self.ahead.pop(stale).cancel()
        for i in wanted:
            if i not in self.ahead:
                self.ahead[i] = self.pool.submit(self.build, i)
        return batch

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.ahead.clear()
