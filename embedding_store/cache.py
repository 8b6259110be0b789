"""An N-way set-associative cache of table rows (Numba kernels), LRU or LFU.

``sets * ways`` slots; row ``r`` may live only in the ways of set ``mix64(r) % sets``.
For each slot the cache keeps the row it holds (``tags``, -1 empty), the row's score for
the policy (``scores``: the clock of its last use for LRU, its use count for LFU), the
batch it is pinned by (``pins``: a slot used by the batch being trained or being admitted
is never chosen as a victim) and whether its row changed since it came in (``dirty``: it
must be written back when evicted). The rows' data live wherever the caller keeps them,
at the slots' numbers (the store-backed table keeps them in the fused module's buffers).

Admitting a batch's rows: hits are pinned and scored; each miss takes an empty way of its
set, or the way with the lowest score among those not pinned by this batch (its row is
evicted: the caller writes it back when dirty). A miss whose set's ways are all pinned by
this batch gets no slot (-1): the caller places it in a per-batch scratch area.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from neorec.common.hashing import mix64_jit
from neorec.common.cache_prefetch import prefetch

POLICIES = ("lru", "lfu")
EMPTY = -1
AHEAD = 8
"""Rows ahead whose sets the kernels prefetch: a set is a few cache lines of a tag array
much larger than the CPU's caches, so each would otherwise wait for memory."""


@numba.njit(inline="always")
def _set_of(row: int, sets: int) -> int:
    return int(mix64_jit(np.uint64(row)) % np.uint64(sets))


@numba.njit(inline="always")
def _set_ahead(rows: np.ndarray, i: int, sets: int, ways: int) -> int:
    """The first slot of ``rows[i]``'s set, or -1 past the last row (what the kernels
    prefetch ahead). The kernels prefetch that set's lines themselves, in their loops: an
    inlined helper taking the tag arrays kept reference counting of each of them in the loop,
    two atomic calls per array and row, which cost more than the prefetch saved."""
    return _set_of(rows[i], sets) * ways if i < rows.shape[0] else -1


@numba.njit(cache=True, nogil=True)
def lookup(tags: np.ndarray, ways: int, rows: np.ndarray, slots: np.ndarray) -> int:
    """``slots[i]``: the slot holding ``rows[i]``, or -1; returns the hits."""
    sets = tags.shape[0] // ways
    hits = 0
    for i in range(rows.shape[0]):
        ahead = _set_ahead(rows, i + AHEAD, sets, ways)
        for w in range(0, ways if ahead >= 0 else 0, 8):  # 8 int64 a cache line
            prefetch(tags, ahead + w)
        row = rows[i]
        base = _set_of(row, sets) * ways
        slots[i] = -1
        for w in range(ways):
            if tags[base + w] == row:
                slots[i] = base + w
                hits += 1
                break
    return hits


@numba.njit(cache=True, nogil=True)
def admit(tags: np.ndarray, scores: np.ndarray, pins: np.ndarray, dirty: np.ndarray, ways: int, lfu: bool,
          rows: np.ndarray, batch: int, clock: int, slots: np.ndarray, evicted: np.ndarray,
          evicted_dirty: np.ndarray) -> int:
    """Place distinct ``rows`` (int64) for ``batch``: ``slots[i]`` its slot (or -1: no way
    free of this batch's pins), ``evicted[i]`` the row it displaced (or -1) and
    ``evicted_dirty[i]`` whether that row was dirty. Hits keep their slot; they are pinned
    before any miss is placed, so no row of the batch displaces another. Returns the
    misses (rows that were not cached)."""
    sets = tags.shape[0] // ways
    misses = 0
    for i in range(rows.shape[0]):  # hits: pinned first
        ahead = _set_ahead(rows, i + AHEAD, sets, ways)
        for w in range(0, ways if ahead >= 0 else 0, 8):
            prefetch(tags, ahead + w)
            prefetch(scores, ahead + w)
            prefetch(pins, ahead + w)
        row = rows[i]
        base = _set_of(row, sets) * ways
        slots[i] = -1
        evicted[i] = -1
        evicted_dirty[i] = False
        for w in range(ways):
            s = base + w
            if tags[s] == row:
                scores[s] = scores[s] + 1 if lfu else clock
                pins[s] = batch
                slots[i] = s
                break
    for i in range(rows.shape[0]):  # misses: an empty way, or the lowest score not pinned by the batch
        if slots[i] >= 0:
            continue
        ahead = _set_ahead(rows, i + AHEAD, sets, ways)
        for w in range(0, ways if ahead >= 0 else 0, 8):
            prefetch(tags, ahead + w)
            prefetch(scores, ahead + w)
            prefetch(pins, ahead + w)
        misses += 1
        row = rows[i]
        base = _set_of(row, sets) * ways
        victim = -1
        for w in range(ways):
            s = base + w
            if tags[s] == EMPTY:
                victim = s
                break
            if pins[s] != batch and (victim < 0 or scores[s] < scores[victim]):
                victim = s
        slots[i] = victim
        if victim < 0:
            continue
        if tags[victim] != EMPTY:
            evicted[i] = tags[victim]
            evicted_dirty[i] = dirty[victim]
        tags[victim] = row
        scores[victim] = 1 if lfu else clock
        pins[victim] = batch
        dirty[victim] = False
    return misses


@dataclass
class CacheCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    overflows: int = 0
    """Misses that found every way of their set pinned (placed in scratch)."""


class SetAssociativeCache:
    """The cache's bookkeeping for ``slots`` rows in sets of ``ways`` (see the module)."""

    def __init__(self, slots: int, ways: int = 32, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if slots <= 0 or ways <= 0:
            raise ValueError("a cache needs slots and ways")
        ways = min(ways, slots)
        sets = max(1, slots // ways)
        self.ways = ways
        self.slots = sets * ways
        self.lfu = policy == "lfu"
        self.tags = np.full(self.slots, EMPTY, dtype=np.int64)
        self.scores = np.zeros(self.slots, dtype=np.int64)
        self.pins = np.full(self.slots, -1, dtype=np.int64)
        self.dirty = np.zeros(self.slots, dtype=np.bool_)
        self.clock = 0
        self.counters = CacheCounters()

    def admit(self, rows: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Place distinct ``rows`` for ``batch`` (see :func:`admit`); returns ``(slots,
        evicted, evicted_dirty, evicted_slots)``."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        slots = np.empty(rows.size, dtype=np.int64)
        evicted = np.empty(rows.size, dtype=np.int64)
        evicted_dirty = np.empty(rows.size, dtype=np.bool_)
        self.clock += 1
        misses = admit(self.tags, self.scores, self.pins, self.dirty, self.ways, self.lfu, rows, batch, self.clock,
                       slots, evicted, evicted_dirty)
        counters = self.counters
        counters.lookups += rows.size
        counters.hits += rows.size - misses
        counters.misses += misses
        counters.evictions += int((evicted >= 0).sum())
        counters.overflows += int((slots < 0).sum())
        return slots, evicted, evicted_dirty, np.where(evicted >= 0, slots, -1)

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """The slots holding ``rows`` (-1 where not cached); changes nothing."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        slots = np.empty(rows.size, dtype=np.int64)
        lookup(self.tags, self.ways, rows, slots)
        return slots

    def clear(self) -> None:
        """Empty every slot (nothing written back: the caller's rows below are the truth)."""
        self.tags.fill(EMPTY)
        self.scores.fill(0)
        self.pins.fill(-1)
        self.dirty.fill(False)
