"""The id → slot map of a dynamic table: Numba kernels over flat arrays.

- **Hash index**: open addressing with linear probing over ``M`` (a power of two, at least
  twice the capacity) ``(key, slot)`` pairs in one int64 array, so a probe reads one cache
  line; deletion shifts the following entries back (no tombstones).
- **Slots**: per slot its key, last access tick (a counter of every id processed: unique,
  increasing), last seen time (the TTL clock: steps or partitions), uses (how many ids have
  held it: the generation of its next re-initialisation) and a live flag.
- **Recency queue**: every access appends ``(slot, tick)``; an entry whose tick is no longer
  its slot's (the slot was accessed again, or freed) is stale and skipped. The first live
  entry from the read cursor is the least recently used slot, exactly, and an access costs
  one sequential write instead of relinking a list through three random slots. Stale entries
  are dropped (:func:`compact`) before a batch that would not fit.
- **Free ring**: free slots, first freed first reused.

Recency and free order are both the order of ticks, so a checkpoint keeps only the per-slot
arrays and :meth:`IdMap.rebuild` recreates index, queue and ring. A checkpoint's increment
is the slots accessed since the last one (their tick says so) and those freed since.

Every decision is taken in the order of the ids given, one id after the other, in one thread:
the same ids in the same order give the same map, bit for bit. The kernels prefetch the
index positions (and then the slots or sketch counters) of ids a few places ahead, whose
random reads would otherwise each wait for memory.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from neorec.common.cache_prefetch import prefetch
from neorec.common.hashing import mix64_jit
from neorec.trainer.embedding.dynamic.admission import prefetch_counters, sketch_add

KEY, TICK, SEEN, USES = 0, 1, 2, 3
"""Columns of ``meta`` (int64 ``[capacity, 4]``)."""
READ, WRITE, FREE_FIRST, FREE_COUNT = 0, 1, 2, 3
"""Entries of ``cursors`` (int64 ``[4]``): the recency queue's read and write positions, the
free ring's first position and length."""
STAT_TICK, ADMITTED, REJECTED, EVICTED, LIVE = 0, 1, 2, 3, 4
"""Entries of ``stats`` (int64 ``[5]``)."""
INDEX_AHEAD = 32
"""How many ids ahead of the one being mapped a kernel prefetches its index position."""
SLOT_AHEAD = 16
"""How many ids ahead it finds the slot (or, for an unknown id, the sketch counters) and
prefetches it (those index lines have arrived by then)."""


@numba.njit(inline="always")
def _home(key, mask):
    return np.int64(mix64_jit(np.uint64(key)) & mask)


@numba.njit(inline="always")
def _find(entries, mask, key):
    """The index position of ``key``, or ``-1 - p`` where ``p`` is the empty position where it
    would go."""
    pos = _home(key, mask)
    while True:
        if entries[2 * pos + 1] < 0:
            return -1 - pos
        if entries[2 * pos] == key:
            return pos
        pos = (pos + 1) & np.int64(mask)


@numba.njit(inline="always")
def _delete(entries, mask, pos):
    """Remove the entry at ``pos``, shifting back the entries of its probe run."""
    i = pos
    j = pos
    while True:
        j = (j + 1) & np.int64(mask)
        if entries[2 * j + 1] < 0:
            break
        home = _home(entries[2 * j], mask)
        stays = (i < home <= j) if i <= j else (home > i or home <= j)
        if not stays:
            entries[2 * i] = entries[2 * j]
            entries[2 * i + 1] = entries[2 * j + 1]
            i = j
    entries[2 * i + 1] = -1


@numba.njit(inline="always")
def _is_current(meta, live, recency, q):
    s = recency[q, 0]
    return live[s] != 0 and meta[s, TICK] == recency[q, 1]


@numba.njit(inline="always")
def _least_recent(meta, live, recency, cursors):
    """The least recently used live slot (stale queue entries before it are dropped), or -1."""
    q = cursors[READ]
    while q < cursors[WRITE] and not _is_current(meta, live, recency, q):
        q += 1
    cursors[READ] = q
    return recency[q, 0] if q < cursors[WRITE] else -1


@numba.njit(inline="always")
def _pop_free(free, cursors):
    s = free[cursors[FREE_FIRST]]
    cursors[FREE_FIRST] = (cursors[FREE_FIRST] + 1) % free.size
    cursors[FREE_COUNT] -= 1
    return s


@numba.njit(inline="always")
def _push_free(free, cursors, s):
    free[(cursors[FREE_FIRST] + cursors[FREE_COUNT]) % free.size] = s
    cursors[FREE_COUNT] += 1


@numba.njit(cache=True, nogil=True)
def remap_train(entries, meta, live, recency, free, cursors, stats, counts, count_dirty, count_shift, salts,
                ids, min_count, clock, base, missing, out, reinit, reinit_uses):
    """Training lookup of ``ids`` (int64 ``[n]``) in order: a known id's slot (accessed at
    the next tick, seen at ``clock``); an unknown id is counted in the sketch and, at
    ``min_count`` sightings, gets a slot: a free one, else the least recently used one
    (its id evicted) unless that slot served an earlier id of these ``ids``. ``out`` int64
    ``[n]``: ``base`` + the slot, ``missing`` for ids without one (counted as rejected).
    Slots that held an id before go to ``reinit`` with their generation in ``reinit_uses``;
    returns how many. The recency queue must have room for ``n`` entries after its write
    cursor."""
    mask = np.uint64(entries.size // 2 - 1)
    flat_meta = meta.reshape(-1)
    flat_counts = counts.reshape(-1)
    width = np.int64(counts.shape[1])
    sketching = min_count > 1
    first_tick = stats[STAT_TICK]
    count = 0
    n = ids.size
    for i in range(n):
        # (written out here: moved into an inlined helper, these lines kept reference counting
        # of the helper's array arguments in the loop, which cost more than the prefetches save)
        if i + INDEX_AHEAD < n:
            prefetch(entries, 2 * _home(ids[i + INDEX_AHEAD], mask))
        if i + SLOT_AHEAD < n:
            ahead = _find(entries, mask, ids[i + SLOT_AHEAD])
            if ahead >= 0:
                prefetch(flat_meta, 4 * entries[2 * ahead + 1])
            elif sketching:
                prefetch_counters(flat_counts, width, salts, ids[i + SLOT_AHEAD])
        key = ids[i]
        tick = stats[STAT_TICK]
        stats[STAT_TICK] = tick + 1
        pos = _find(entries, mask, key)
        if pos >= 0:
            s = entries[2 * pos + 1]
        else:
            if sketching and sketch_add(counts, count_dirty, count_shift, salts, key) < min_count:
                out[i] = missing
                stats[REJECTED] += 1
                continue
            if cursors[FREE_COUNT] > 0:
                s = _pop_free(free, cursors)
            else:
                s = _least_recent(meta, live, recency, cursors)
                if s < 0 or meta[s, TICK] >= first_tick:  # every slot serves these ids
                    out[i] = missing
                    stats[REJECTED] += 1
                    continue
                cursors[READ] += 1
                _delete(entries, mask, _find(entries, mask, meta[s, KEY]))
                stats[EVICTED] += 1
                stats[LIVE] -= 1
                pos = _find(entries, mask, key)  # the deletion may have moved the empty position
            if meta[s, USES] > 0:
                reinit[count] = s
                reinit_uses[count] = meta[s, USES]
                count += 1
            meta[s, USES] += 1
            meta[s, KEY] = key
            live[s] = 1
            empty = -1 - pos
            entries[2 * empty] = key
            entries[2 * empty + 1] = s
            stats[ADMITTED] += 1
            stats[LIVE] += 1
        meta[s, TICK] = tick
        meta[s, SEEN] = clock
        q = cursors[WRITE]
        recency[q, 0] = s
        recency[q, 1] = tick
        cursors[WRITE] = q + 1
        out[i] = base + s
    return count


@numba.njit(cache=True, nogil=True)
def compact(meta, live, recency, cursors):
    """Drop the recency queue's stale entries, moving the current ones (in order) to its front."""
    flat_meta = meta.reshape(-1)
    kept = 0
    end = cursors[WRITE]
    for q in range(cursors[READ], end):
        if q + SLOT_AHEAD < end:
            prefetch(live, recency[q + SLOT_AHEAD, 0])
            prefetch(flat_meta, 4 * recency[q + SLOT_AHEAD, 0] + TICK)
        if _is_current(meta, live, recency, q):
            recency[kept, 0] = recency[q, 0]
            recency[kept, 1] = recency[q, 1]
            kept += 1
    cursors[READ] = 0
    cursors[WRITE] = kept


@numba.njit(cache=True, nogil=True)
def expire(entries, meta, live, freed, recency, free, cursors, stats, clock, ttl):
    """Free the slots of ids last seen more than ``ttl`` before ``clock``, oldest first."""
    mask = np.uint64(entries.size // 2 - 1)
    while True:
        s = _least_recent(meta, live, recency, cursors)
        if s < 0 or clock - meta[s, SEEN] <= ttl:
            return
        cursors[READ] += 1
        _delete(entries, mask, _find(entries, mask, meta[s, KEY]))
        _push_free(free, cursors, s)
        live[s] = 0
        freed[s] = 1
        stats[EVICTED] += 1
        stats[LIVE] -= 1


@numba.njit(cache=True, nogil=True)
def lookup(entries, ids, base, missing, out):
    """``out[i]``: ``base`` + the slot of ``ids[i]``, ``missing`` when it has none (read
    only); returns how many have none."""
    mask = np.uint64(entries.size // 2 - 1)
    none = 0
    for i in range(ids.size):
        if i + INDEX_AHEAD < ids.size:
            prefetch(entries, 2 * _home(ids[i + INDEX_AHEAD], mask))
        pos = _find(entries, mask, ids[i])
        if pos >= 0:
            out[i] = base + entries[2 * pos + 1]
        else:
            out[i] = missing
            none += 1
    return none


@numba.njit(cache=True, nogil=True)
def _rebuild(entries, meta, live, recency, free, cursors, order):
    """Index, queue and ring from the per-slot arrays; ``order``: the slots by tick, ascending."""
    mask = np.uint64(entries.size // 2 - 1)
    entries[1::2] = -1
    cursors[:] = 0
    for k in range(order.size):
        s = order[k]
        if live[s]:
            q = cursors[WRITE]
            recency[q, 0] = s
            recency[q, 1] = meta[s, TICK]
            cursors[WRITE] = q + 1
            empty = -1 - _find(entries, mask, meta[s, KEY])
            entries[2 * empty] = meta[s, KEY]
            entries[2 * empty + 1] = s
        else:
            _push_free(free, cursors, s)


def index_positions(capacity: int) -> int:
    """Positions of the hash index of a ``capacity``-slot map: a power of two, at least twice it."""
    return 1 << max(1, (2 * capacity - 1).bit_length())


QUEUE_PER_SLOT = 2
"""Recency queue entries per slot: between two compactions at least ``capacity`` accesses."""
SLOT_BYTES = 4 * 8 + 1 + 1 + 8 + QUEUE_PER_SLOT * 16
"""Bytes per slot beside the index: ``meta``, ``live``, ``freed``, the free ring and the queue."""


def map_bytes(capacity: int) -> int:
    """Bytes of a ``capacity``-slot :class:`IdMap` (index and per-slot arrays)."""
    return 16 * index_positions(capacity) + SLOT_BYTES * capacity


class IdMap:
    """The map of one dynamic table of ``capacity`` slots (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries = np.full(2 * index_positions(capacity), -1, dtype=np.int64)
        self.meta = np.zeros((capacity, 4), dtype=np.int64)
        self.meta[:, TICK] = np.arange(capacity, dtype=np.int64) - capacity  # never used: oldest, slot 0 first
        self.live = np.zeros(capacity, dtype=np.uint8)
        self.freed = np.zeros(capacity, dtype=np.uint8)
        """Slots freed by expiry since the last :meth:`delta` (accessed ones: their tick says)."""
        self.recency = np.empty((QUEUE_PER_SLOT * capacity, 2), dtype=np.int64)
        self.free = np.empty(capacity, dtype=np.int64)
        self.cursors = np.zeros(4, dtype=np.int64)
        self.stats = np.zeros(5, dtype=np.int64)
        self.delta_tick = 0
        """The tick of the last :meth:`delta`: slots accessed since have a tick at or above it."""
        self.rebuild()

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.entries, self.meta, self.live, self.freed, self.recency, self.free)))

    def rebuild(self) -> None:
        """Recreate index, queue and ring from the per-slot arrays (after :meth:`apply`)."""
        order = np.argsort(self.meta[:, TICK], kind="stable").astype(np.int64)
        _rebuild(self.entries, self.meta, self.live, self.recency, self.free, self.cursors, order)

    def make_room(self, accesses: int) -> None:
        """Let the recency queue take ``accesses`` more entries: drop its stale entries when
        they would not fit, and grow it when even that is not enough (a batch longer than
        the capacity)."""
        if self.cursors[WRITE] + accesses <= len(self.recency):
            return
        compact(self.meta, self.live, self.recency, self.cursors)
        needed = int(self.cursors[WRITE]) + accesses
        if needed > len(self.recency):
            grown = np.empty((max(needed, QUEUE_PER_SLOT * len(self.recency)), 2), dtype=np.int64)
            grown[: self.cursors[WRITE]] = self.recency[: self.cursors[WRITE]]
            self.recency = grown

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: the slots of ``ids`` (int64 ``[n]``), -1 for ids without one; the
        map does not change."""
        out = np.empty(ids.size, dtype=np.int64)
        self.lookup_into(ids, out, 0, -1)
        return out

    def lookup_into(self, ids: np.ndarray, out: np.ndarray, base: int, missing: int) -> int:
        """:meth:`lookup` writing ``base`` + each slot, ``missing`` for ids without one, to
        ``out`` (int64 ``[n]``, contiguous); returns how many have none."""
        return int(lookup(self.entries, np.ascontiguousarray(ids, dtype=np.int64), np.int64(base),
                          np.int64(missing), out))

    def expire(self, clock: int, ttl: int) -> None:
        """Evict the ids last seen more than ``ttl`` before ``clock``."""
        expire(self.entries, self.meta, self.live, self.freed, self.recency, self.free, self.cursors, self.stats,
               np.int64(clock), np.int64(ttl))

    def counters(self) -> dict[str, int]:
        """Ids ``admitted``, sightings ``rejected`` (read zeros), ids ``evicted``, ``live`` slots."""
        return {"admitted": int(self.stats[ADMITTED]), "rejected": int(self.stats[REJECTED]),
                "evicted": int(self.stats[EVICTED]), "live": int(self.stats[LIVE])}

    def delta(self, full: bool) -> dict[str, Any]:
        """The slots changed since the last delta (all when ``full``): ``slots`` int64 ``[k]``,
        their ``meta`` int64 ``[k, 4]`` and ``live`` uint8 ``[k]``, and the ``stats``."""
        if full:
            slots = np.arange(self.capacity, dtype=np.int64)
        else:
            slots = np.flatnonzero((self.meta[:, TICK] >= self.delta_tick) | (self.freed != 0)).astype(np.int64)
        self.freed[:] = 0
        self.delta_tick = int(self.stats[STAT_TICK])
        return {"slots": slots, "meta": self.meta[slots], "live": self.live[slots], "stats": self.stats.copy()}

    def apply(self, delta: dict[str, Any]) -> None:
        """Write a :meth:`delta` back (a checkpoint chain, oldest first; then :meth:`rebuild`)."""
        self.meta[delta["slots"]] = delta["meta"]
        self.live[delta["slots"]] = delta["live"]
        self.stats[:] = delta["stats"]
        self.delta_tick = int(self.stats[STAT_TICK])
