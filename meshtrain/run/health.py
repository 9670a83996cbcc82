"""How a long run is doing, beyond its loss (docs/operating.md): stragglers among the processes,
loss spikes, per-layer gradient norms and the communication share of the step.

- `Stragglers` (train.straggler_every, straggler_factor): every N steps each process publishes its
  host time per step (the loop's wall time outside waiting for the devices: getting the batch,
  dispatching, logging) and its data wait, through JAX's coordination service; process 0 reads them
  and names each process slower than the median by the factor. Every process's wall time per step is
  the same (the devices of all of them wait for the slowest at the step's collectives), so the time
  each host adds is what tells a slow host; a slow device shows in no host's clock (a profile does).
- `SpikeDetector` (guard.spike_factor, spike_window): a loss above factor x the running mean.
- `grad_norm_fields`: the step's per-layer and per-kind gradient norms (meshtrain/engine/step.py
  `grad_norms_by_group`) as record fields, layers in model order.
- `CollectiveTimer`: the communication share of the step, from a timed all-reduce of the gradients'
  bytes over the data-parallel axes.
"""
from __future__ import annotations

import json
import socket
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.core.console import log

KEY = "meshtrain/stragglers"
GATHER_TIMEOUT_MS = 60_000


def find_stragglers(host_s: list[float], factor: float) -> tuple[float, list[int]]:
    """(the median host time per step, the processes slower than factor x it). The median of an even
    count is its lower middle value, so that of two processes the faster one is the reference."""
    median = statistics.median_low(host_s)
    return median, [i for i, t in enumerate(host_s) if t > factor * median]


class Stragglers:
    def __init__(self, every: int, factor: float, process: int, processes: int):
        self.every, self.factor = every, factor
        self.process, self.processes = process, processes
        self.host = socket.gethostname()

    def due(self, step: int) -> bool:
        return bool(self.every) and self.processes > 1 and step % self.every == 0

    def gather(self, step: int, step_s: float, host_s: float, data_s: float) -> dict:
        """Publish this process's figures for `step`; on process 0, read everyone's, print a warning
        per straggler and return the record fields (host_time_spread: slowest / median,
        host_time_max_s); {} elsewhere."""
        from jax._src import distributed  # the client has no public handle

        client = distributed.global_state.client
        mine = {"host": self.host, "host_s": host_s, "data_s": data_s}
        client.key_value_set(f"{KEY}/{step}/{self.process}", json.dumps(mine), allow_overwrite=True)
        if self.process != 0:
            return {}
        rows = []
        for i in range(self.processes):
            try:
                rows.append(json.loads(client.blocking_key_value_get(f"{KEY}/{step}/{i}", GATHER_TIMEOUT_MS)))
            except Exception:  # noqa: BLE001 - a process that far behind is the step watchdog's to judge
                log.warning(f"step {step}: process {i} sent no step times within {GATHER_TIMEOUT_MS // 1000} s; "
                            f"no straggler figures at this step")
                return {}
            client.key_value_delete(f"{KEY}/{step}/{i}")
        times = [r["host_s"] for r in rows]
        median, slow = find_stragglers(times, self.factor)
        for i in slow:
            r = rows[i]
            log.warning(f"step {step}: straggler: process {i} (host {r['host']}) adds {r['host_s'] * 1e3:.1f} ms "
                        f"per step outside the device wait, {r['host_s'] / max(median, 1e-9):.1f}x the median "
                        f"{median * 1e3:.1f} ms ({r['host_s'] / step_s:.0%} of the {step_s * 1e3:.1f} ms step; "
                        f"{r['data_s'] * 1e3:.1f} ms of it waiting for data)")
        return {"host_time_spread": max(times) / max(median, 1e-9), "host_time_max_s": max(times),
                "data_wait_max_s": max(r["data_s"] for r in rows)}


class SpikeDetector:
    """A loss above `factor` x the running mean of the losses before it is a spike. The mean is an
    exponential moving average, m <- m + (loss - m) / window, over the losses that were not
    spikes; steps are judged from the `window`-th loss this detector saw on. Checkpoints keep its
    `state()` (the trainer's save metadata): a resumed run, or one rolled back to a checkpoint, judges
    its next steps as the run that never stopped would, with no new warm-up (`resume`)."""

    def __init__(self, factor: float, window: int):
        self.factor, self.window = factor, window
        self.mean, self.seen = None, 0

    def state(self) -> dict:
        return {"mean": self.mean, "seen": self.seen}

    def resume(self, saved: dict | None, same_data: bool) -> None:
        """Go on from a checkpoint's `saved` state; warm up again where it holds none (an earlier
        version's checkpoint, or one saved with spike detection off) or its data differ from this
        run's (`same_data` False: the old data's mean would judge the new data's losses)."""
        self.mean, self.seen = (saved["mean"], saved["seen"]) if saved and same_data else (None, 0)

    def check(self, loss: float) -> float | None:
        """The running mean when `loss` is a spike (it is then left out of the mean), else None."""
        if self.mean is not None and self.seen >= self.window and loss > self.factor * self.mean:
            return self.mean
        self.mean = loss if self.mean is None else self.mean + (loss - self.mean) / self.window
        self.seen += 1
        return None


def grad_norm_fields(norms, layer_order) -> dict:
    """{'grad_norm_layer_<i>' (model order: the embed stacks' layers, then `blocks`'),
    'grad_norm_<kind>'} from the step's `grad_norms` ({'layer': [layers] in storage order,
    'embed_stacks': [layers], 'kind': {name: norm}}; meshtrain/engine/step.py `grad_norms_by_group`)."""
    layer = np.concatenate([np.asarray(norms["embed_stacks"]), np.asarray(norms["layer"])[np.argsort(layer_order)]])
    return ({f"grad_norm_layer_{i}": float(v) for i, v in enumerate(layer)}
            | {f"grad_norm_{name}": float(v) for name, v in norms["kind"].items()})


class CollectiveTimer:
    """The communication share of the step, estimated: the time of an all-reduce of the gradients'
    bytes over the data-parallel axes (data, fsdp), timed alone (median of REPEATS after a warm-up)
    on a buffer of at most CAP_BYTES per device and scaled to the gradients' bytes, over the step
    time. It is the gradient reduction's share where nothing overlaps it; tensor, pipeline, expert
    and context traffic are not in it (a profile, logging.profile, shows every collective and the
    overlap). None without a data-parallel axis."""

    CAP_BYTES, REPEATS = 64 * 2**20, 3

    def __init__(self, mesh, num_params: int):
        self.axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
        group = int(np.prod([mesh.shape[a] for a in self.axes])) if self.axes else 1
        self.grad_bytes = 4 * num_params * group / mesh.size  # fp32 gradients each device holds before reducing
        per_device = max(1, int(min(self.grad_bytes, self.CAP_BYTES)) // 4)
        self.scale = self.grad_bytes / (4 * per_device)
        if not self.axes:
            self.reduce = None
            return
        spec = P(tuple(mesh.axis_names))
        self.reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, self.axes), mesh=mesh, in_specs=spec,
                                            out_specs=spec))
        # made in place, each device its part: no device ever holds the whole buffer
        self.buffer = jax.jit(lambda: jnp.ones((mesh.size * per_device,), jnp.float32),
                              out_shardings=NamedSharding(mesh, spec))

    def seconds(self) -> float | None:
        """The estimated all-reduce time of the gradients (None without a data-parallel axis)."""
        if self.reduce is None:
            return None
        x = self.buffer()
        self.reduce(x).block_until_ready()  # compiled once, at the first interval
        times = []
        for _ in range(self.REPEATS):
            started = time.perf_counter()
            self.reduce(x).block_until_ready()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * self.scale

    def share(self, step_s: float) -> dict:
        seconds = self.seconds()
        return {} if seconds is None else {"comm_share": min(1.0, seconds / step_s), "comm_s": seconds}
