"""The ring attention's schedule, as plain numbers known before tracing (meshtrain/ops/context_parallel.py
runs it): the load-balanced ("zigzag") order of the sequence's 2cp chunks, which chunk pairs a device
computes at each ring step (`step_pairs`), the sub-blocks of a pair (`sub_block_pairs`), the steps a
sliding window reaches (`ring_legs`) and what the ring sends (`ring_exchanges`, `ring_sends`), and
the share of the [L, L] scores it computes (`computed_fraction`). The derivations: context_parallel.py's
module doc.
"""
from __future__ import annotations

import numpy as np

from meshtrain.core.errors import UserError
from meshtrain.ops.packing import block_reaches

RING_BLOCK = 512  # positions per sub-block: a step forms [S, S] scores, never [Lc, Lc]


def load_balanced_order(seq_len: int, parts: int) -> np.ndarray:
    """positions[storage index] = true position: the sequence cut into 2*parts equal chunks, slot i
    of `parts` equal slots holding chunks i and 2*parts-1-i (an early and a late chunk, so causal
    attention costs every slot the same). parts=1: the identity."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if parts == 1:
        return np.arange(seq_len)
    if seq_len % (2 * parts):
        raise UserError(f"train.seq_len={seq_len} must split into 2 x {parts} equal chunks for "
                        f"load-balanced context parallelism; set train.seq_len to a multiple of "
                        f"{2 * parts} (or use a smaller context axis)")
    chunks_NxS = np.arange(seq_len).reshape(2 * parts, -1)
    slots = [np.concatenate([chunks_NxS[i], chunks_NxS[-1 - i]]) for i in range(parts)]
    return np.concatenate(slots)


# ---- the schedule, as data ----
def own_pairs(cp: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) pairs of a device's own block: (e, e) and (l, l) causal and
    (l, e) whole; with one device, the single chunk causal."""
    return [(0, 0, True)] if cp == 1 else [(0, 0, True), (1, 0, False), (1, 1, True)]


def step_pairs(me: int, t: int, cp: int) -> list[tuple[int, int, bool]]:
    """The visible (query chunk, key chunk, causal) pairs of device `me` at ring step t, whose held
    block is device me - t's: at t > 0, (c, c) and (l, e) with c = [src > me], both whole."""
    if t % cp == 0:
        return own_pairs(cp)
    c = int((me - t) % cp > me)
    return [(c, c, False), (1, 0, False)]


def sub_block_pairs(n: int, causal: bool) -> np.ndarray:
    """[items, 3] rows (query sub-block i, key sub-block j, diagonal) of a chunk pair cut into n
    sub-blocks: all n^2 for a whole pair; for a causal one the n(n+1)/2 with j <= i, the diagonal
    ones (i == j) masked by the lower triangle."""
    rows = [(i, j, int(causal and i == j)) for i in range(n) for j in range(n) if j <= i or not causal]
    return np.array(rows, dtype=np.int32)


def sub_block(chunk_len: int) -> int:
    """S: the largest divisor of the chunk length up to RING_BLOCK."""
    return max(b for b in range(1, min(RING_BLOCK, chunk_len) + 1) if chunk_len % b == 0)


def chunk_start(device, c, cp: int, chunk_len: int):
    """True position of the first token of chunk c (0 early, 1 late) of `device` (load-balanced order)."""
    late = 0 if cp == 1 else c  # chunk 2cp-1-device when late (c may be traced)
    return chunk_len * (device + late * (2 * cp - 1 - 2 * device))


def chunk_reach(chunk_len: int, window: int) -> int:
    """How many chunks back a `window` reaches: a key chunk d chunks before a query chunk is at least
    (d - 1) Lc + 1 positions back, needed iff that is < window: d <= ceil((window - 1) / Lc)."""
    return -(-(window - 1) // chunk_len)


def ring_legs(cp: int, chunk_len: int, window: int = 0) -> list[tuple[int, list[int]]]:
    """The exchanges as (hop, ring steps t): each leg passes K/V `hop` devices on per exchange and at
    its step t a device holds the block of device me - t. Without a window, one leg round the ring
    (t = 1..cp-1). At step t the nearest chunk pair over all devices is min(t, cp - t) chunks apart
    (an early pair t apart on devices me >= t, a late pair cp - t apart on the others), so a
    `window` reaching D = `chunk_reach` chunks needs only the steps with min(t, cp - t) <= D: D
    exchanges one way (t = 1..D) and D the other way (t = cp-1..cp-D), 2D < cp - 1 in all."""
    if cp == 1:
        return []
    reach = chunk_reach(chunk_len, window) if window else cp
    if 2 * reach >= cp - 1:
        return [(1, list(range(1, cp)))]
    return [leg for leg in ((1, list(range(1, reach + 1))), (-1, [cp - u for u in range(1, reach + 1)])) if leg[1]]


def ring_exchanges(seq_len: int, cp: int, window: int = 0) -> int:
    """K/V exchanges a ring pass makes: cp - 1, fewer under a short `window` (`ring_legs`)."""
    return sum(len(steps) for _, steps in ring_legs(cp, seq_len // (2 * cp), window))


def ring_sends(seq_len: int, cp: int, window: int = 0) -> dict[str, int]:
    """Sends per layer of one device: `kv` K/V blocks a ring pass (forward, and again backward),
    `grads` fp32 dK/dV blocks (one per exchange, one home per leg, less the second leg's first:
    it starts from zero sums), `legs` (`ring_legs`)."""
    legs = ring_legs(cp, seq_len // (2 * cp), window)
    kv = sum(len(steps) for _, steps in legs)
    return {"kv": kv, "grads": kv + 1 if kv else 0, "legs": len(legs)}


def computed_fraction(seq_len: int, cp: int, window: int = 0) -> float:
    """The share of the [L, L] score matrix the ring computes, summed over its cp devices:
    (2 n^2 cp + n) / (4 n^2 cp) = 1/2 + 1/(4 n cp) with n sub-blocks per chunk (the causal pairs'
    diagonal sub-blocks are computed whole); cp = 1 is one chunk: (n + 1) / (2n). With a `window`,
    the sub-blocks the kernel runs (`ring_legs`' steps, packing.block_reaches), counted."""
    chunks = 1 if cp == 1 else 2
    Lc = seq_len // (chunks * cp)
    S = sub_block(Lc)
    n = Lc // S
    if window:
        computed = 0
        steps = [0] + [t for _, ts in ring_legs(cp, Lc, window) for t in ts]
        for me in range(cp):
            for t in steps:
                src = (me - t) % cp
                for qc, kc, causal in step_pairs(me, t, cp):
                    i, j, _ = sub_block_pairs(n, causal).T
                    q0, k0 = chunk_start(me, qc, cp, Lc), chunk_start(src, kc, cp, Lc)
                    computed += np.count_nonzero(block_reaches(q0 + i * S, k0 + j * S + S - 1, window))
        return computed / (chunks * cp * n) ** 2
    per_pair = {True: n * (n + 1) // 2, False: n * n}
    per_device = sum(per_pair[causal] for *_, causal in own_pairs(cp)) + (cp - 1) * 2 * per_pair[False]
    return cp * per_device / (chunks * cp * n) ** 2
