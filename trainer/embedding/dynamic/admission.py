"""Admission by count: a count-min sketch (Cormode & Muthukrishnan, 2005) with conservative
update, whose memory is fixed however many distinct ids it sees.

Each of ``depth`` rows of ``width`` uint8 counters hashes an id to one counter; a sighting
raises the smallest of the id's counters by one and lifts the others to that value, and the
id's count is that value: never below its true count (or :data:`SATURATED`, where counting
stops: admission needs no more), above it only by collisions. :meth:`CountMinSketch.halve`
halves every counter (a table's ``sketch_half_life``), so that old sightings fade. A byte per counter keeps the
sketch, whose counters an unknown id reads at random, a quarter of 32-bit counters' size in
the caches. The
sketch's counters are checkpoint state; :attr:`CountMinSketch.dirty` marks the blocks of
counters changed since the last :meth:`CountMinSketch.delta`, so a checkpoint holds only those.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from neorec.common.cache_prefetch import prefetch
from neorec.common.hashing import combine, mix64_jit

BLOCK_SHIFT = 10
"""Counters per dirty-tracking block: ``2**BLOCK_SHIFT`` (or a row, when narrower)."""
SATURATED = 255
"""The largest count a counter holds (so the largest ``min_count`` admission can ask for)."""


@numba.njit(cache=True, nogil=True)
def sketch_add(counts: np.ndarray, dirty: np.ndarray, shift: np.int64, salts: np.ndarray, key: np.int64) -> np.int64:
    """Count one sighting of ``key`` in ``counts`` (uint8 ``[depth, width]``, width a power
    of two; ``salts`` uint64 ``[depth]``); mark changed blocks in ``dirty`` (uint8, one per
    ``2**shift`` counters of the flattened array); returns the key's count after it."""
    depth, width = counts.shape
    mask = np.uint64(width - 1)
    low = np.uint8(SATURATED)
    for r in range(depth):
        c = counts[r, np.int64(mix64_jit(np.uint64(key) ^ salts[r]) & mask)]
        if c < low:
            low = c
    if low == SATURATED:
        return np.int64(low)
    new = np.uint8(low + 1)
    for r in range(depth):
        j = np.int64(mix64_jit(np.uint64(key) ^ salts[r]) & mask)
        if counts[r, j] < new:
            counts[r, j] = new
            dirty[(r * width + j) >> shift] = 1
    return np.int64(new)


@numba.njit(inline="always")
def prefetch_counters(flat_counts: np.ndarray, width: np.int64, salts: np.ndarray, key: np.int64) -> None:
    """Start loading ``key``'s counters into the cache (``flat_counts``: the counters
    flattened, ``width`` per row)."""
    mask = np.uint64(width - 1)
    for r in range(salts.size):
        prefetch(flat_counts, r * width + np.int64(mix64_jit(np.uint64(key) ^ salts[r]) & mask))


class CountMinSketch:
    """uint8 ``[depth, width]`` counters of one table's ids (see the module docstring)."""

    def __init__(self, width: int, depth: int, table: int) -> None:
        """``table``: the table's number, which salts its hashes (tables count apart)."""
        self.counts = np.zeros((depth, width), dtype=np.uint8)
        self.salts = np.array([combine(table, r) for r in range(depth)], dtype=np.uint64)
        self.shift = min(BLOCK_SHIFT, width.bit_length() - 1)
        self.dirty = np.zeros((depth * width) >> self.shift, dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.counts.nbytes + self.dirty.nbytes)

    def add(self, key: int) -> int:
        """Count one sighting of ``key``; its count after it."""
        return int(sketch_add(self.counts, self.dirty, np.int64(self.shift), self.salts, np.int64(key)))

    def halve(self) -> None:
        """Halve every count, rounded down (a count is then never below half its key's
        true count before the halving, rounded down, plus its sightings since); the blocks
        that change are marked dirty."""
        blocks = self.counts.reshape(self.dirty.size, -1)
        self.dirty |= blocks.any(axis=1)
        blocks >>= 1

    def delta(self, full: bool) -> dict[str, Any]:
        """The counters changed since the last delta (all when ``full``), as numpy arrays:
        ``blocks`` int64 ``[k]`` and their ``values`` uint8 ``[k, block]``; the
        dirty marks are cleared."""
        blocks = np.arange(self.dirty.size) if full else np.flatnonzero(self.dirty)
        values = self.counts.reshape(self.dirty.size, -1)[blocks]
        self.dirty[:] = 0
        return {"blocks": blocks.astype(np.int64), "values": values}

    def apply(self, delta: dict[str, Any]) -> None:
        """Write a :meth:`delta` back (restoring a checkpoint chain, oldest first; counts of
        wider counters, from checkpoints written before counters were bytes, saturate)."""
        self.counts.reshape(self.dirty.size, -1)[delta["blocks"]] = np.minimum(delta["values"], SATURATED)
