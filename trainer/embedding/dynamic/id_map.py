"""The id → slot map of a dynamic table: Numba kernels over flat arrays.

- **Hash index**: open addressing with linear probing over ``M`` (a power of two, at least
  twice the capacity) ``(key, slot)`` pairs in one int64 array, so a probe reads one cache
  line; deletion shifts the following entries back (no tombstones).
- **Slots**: per slot its key, last access tick (a counter of every id processed: unique,
  increasing), last seen time (the TTL clock: steps or partitions), uses (how many ids have
  held it: the generation of its next re-initialisation), a live flag and a dirty flag.
- **Lists**: live slots in a doubly linked LRU list (head: most recent); free slots in a FIFO
  list. Both are ordered by tick, so a checkpoint keeps only the per-slot arrays and
  :meth:`IdMap.rebuild` recreates index and lists.

Every decision is taken in the order of the ids given, one id after the other, in one thread:
the same ids in the same order give the same map, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from neorec.common.hashing import mix64_jit
from neorec.trainer.embedding.dynamic.admission import sketch_add

KEY, TICK, SEEN, USES = 0, 1, 2, 3
"""Columns of ``meta`` (int64 ``[capacity, 4]``)."""
LRU_HEAD, LRU_TAIL, FREE_HEAD, FREE_TAIL = 0, 1, 2, 3
"""Entries of ``ends`` (int64 ``[4]``; -1: empty list)."""
STAT_TICK, ADMITTED, REJECTED, EVICTED, LIVE = 0, 1, 2, 3, 4
"""Entries of ``stats`` (int64 ``[5]``)."""


@numba.njit(inline="always")
def _find(entries, mask, key):
    """The index position of ``key``, or ``-1 - p`` where ``p`` is the empty position where it
    would go."""
    pos = np.int64(mix64_jit(np.uint64(key)) & mask)
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
        home = np.int64(mix64_jit(np.uint64(entries[2 * j])) & mask)
        stays = (i < home <= j) if i <= j else (home > i or home <= j)
        if not stays:
            entries[2 * i] = entries[2 * j]
            entries[2 * i + 1] = entries[2 * j + 1]
            i = j
    entries[2 * i + 1] = -1


@numba.njit(inline="always")
def _unlink(links, ends, head, s):
    p, n = links[s, 0], links[s, 1]
    if p >= 0:
        links[p, 1] = n
    else:
        ends[head] = n
    if n >= 0:
        links[n, 0] = p
    else:
        ends[head + 1] = p


@numba.njit(inline="always")
def _push_front(links, ends, head, s):
    first = ends[head]
    links[s, 0] = -1
    links[s, 1] = first
    if first >= 0:
        links[first, 0] = s
    else:
        ends[head + 1] = s
    ends[head] = s


@numba.njit(inline="always")
def _push_back(links, ends, head, s):
    last = ends[head + 1]
    links[s, 1] = -1
    links[s, 0] = last
    if last >= 0:
        links[last, 1] = s
    else:
        ends[head] = s
    ends[head + 1] = s


@numba.njit(cache=True, nogil=True)
def remap_train(entries, meta, links, live, dirty, ends, stats, counts, count_dirty, count_shift, salts,
                ids, min_count, clock, out, reinit, reinit_uses):
    """Training lookup of ``ids`` (int64 ``[n]``) in order: a known id's slot (touched in the
    LRU list, seen at ``clock``); an unknown id is counted in the sketch and, at
    ``min_count`` sightings, gets a slot: a free one, else the least recently used one
    (its id evicted) unless that slot served an earlier id of these ``ids``. ``out`` int64
    ``[n]``: slots, -1 for ids without one. Slots that held an id before go to ``reinit``
    with their generation in ``reinit_uses``; returns how many."""
    mask = np.uint64(entries.size // 2 - 1)
    first_tick = stats[STAT_TICK]
    count = 0
    for i in range(ids.size):
        key = ids[i]
        tick = stats[STAT_TICK]
        stats[STAT_TICK] = tick + 1
        pos = _find(entries, mask, key)
        if pos >= 0:
            s = entries[2 * pos + 1]
            meta[s, TICK] = tick
            meta[s, SEEN] = clock
            dirty[s] = 1
            if ends[LRU_HEAD] != s:
                _unlink(links, ends, LRU_HEAD, s)
                _push_front(links, ends, LRU_HEAD, s)
            out[i] = s
            continue
        if min_count > 1 and sketch_add(counts, count_dirty, count_shift, salts, key) < min_count:
            out[i] = -1
            stats[REJECTED] += 1
            continue
        s = ends[FREE_HEAD]
        if s >= 0:
            _unlink(links, ends, FREE_HEAD, s)
        else:
            s = ends[LRU_TAIL]
            if s < 0 or meta[s, TICK] >= first_tick:  # every slot serves these ids
                out[i] = -1
                stats[REJECTED] += 1
                continue
            _delete(entries, mask, _find(entries, mask, meta[s, KEY]))
            _unlink(links, ends, LRU_HEAD, s)
            stats[EVICTED] += 1
            stats[LIVE] -= 1
            pos = _find(entries, mask, key)  # the deletion may have moved the empty position
        if meta[s, USES] > 0:
            reinit[count] = s
            reinit_uses[count] = meta[s, USES]
            count += 1
        meta[s, USES] += 1
        meta[s, KEY] = key
        meta[s, TICK] = tick
        meta[s, SEEN] = clock
        live[s] = 1
        dirty[s] = 1
        empty = -1 - pos
        entries[2 * empty] = key
        entries[2 * empty + 1] = s
        _push_front(links, ends, LRU_HEAD, s)
        stats[ADMITTED] += 1
        stats[LIVE] += 1
        out[i] = s
    return count


@numba.njit(cache=True, nogil=True)
def expire(entries, meta, links, live, dirty, ends, stats, clock, ttl):
    """Free the slots of ids last seen more than ``ttl`` before ``clock``, oldest first."""
    mask = np.uint64(entries.size // 2 - 1)
    while True:
        s = ends[LRU_TAIL]
        if s < 0 or clock - meta[s, SEEN] <= ttl:
            return
        _delete(entries, mask, _find(entries, mask, meta[s, KEY]))
        _unlink(links, ends, LRU_HEAD, s)
        _push_back(links, ends, FREE_HEAD, s)
        live[s] = 0
        dirty[s] = 1
        stats[EVICTED] += 1
        stats[LIVE] -= 1


@numba.njit(cache=True, nogil=True)
def lookup(entries, ids, out):
    """``out[i]``: the slot of ``ids[i]``, -1 when it has none (read only)."""
    mask = np.uint64(entries.size // 2 - 1)
    for i in range(ids.size):
        pos = _find(entries, mask, ids[i])
        out[i] = entries[2 * pos + 1] if pos >= 0 else -1


@numba.njit(cache=True, nogil=True)
def _rebuild(entries, meta, links, live, ends, order):
    """Index and lists from the per-slot arrays; ``order``: the slots by tick, ascending."""
    mask = np.uint64(entries.size // 2 - 1)
    entries[1::2] = -1
    ends[:] = -1
    for k in range(order.size):
        s = order[k]
        if live[s]:
            _push_front(links, ends, LRU_HEAD, s)
            empty = -1 - _find(entries, mask, meta[s, KEY])
            entries[2 * empty] = meta[s, KEY]
            entries[2 * empty + 1] = s
        else:
            _push_back(links, ends, FREE_HEAD, s)


def index_positions(capacity: int) -> int:
    """Positions of the hash index of a ``capacity``-slot map: a power of two, at least twice it."""
    return 1 << max(1, (2 * capacity - 1).bit_length())


SLOT_BYTES = 4 * 8 + 2 * 4 + 1 + 1
"""Bytes per slot beside the index: ``meta``, ``links``, ``live``, ``dirty``."""


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
        self.links = np.empty((capacity, 2), dtype=np.int32)
        self.live = np.zeros(capacity, dtype=np.uint8)
        self.dirty = np.zeros(capacity, dtype=np.uint8)
        self.ends = np.full(4, -1, dtype=np.int64)
        self.stats = np.zeros(5, dtype=np.int64)
        self.rebuild()

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.entries, self.meta, self.links, self.live, self.dirty)))

    def rebuild(self) -> None:
        """Recreate index and lists from the per-slot arrays (after :meth:`apply`)."""
        order = np.argsort(self.meta[:, TICK], kind="stable").astype(np.int64)
        _rebuild(self.entries, self.meta, self.links, self.live, self.ends, order)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: the slots of ``ids`` (int64 ``[n]``), -1 for ids without one; the
        map does not change."""
        out = np.empty(ids.size, dtype=np.int64)
        lookup(self.entries, np.ascontiguousarray(ids, dtype=np.int64), out)
        return out

    def expire(self, clock: int, ttl: int) -> None:
        """Evict the ids last seen more than ``ttl`` before ``clock``."""
        expire(self.entries, self.meta, self.links, self.live, self.dirty, self.ends, self.stats,
               np.int64(clock), np.int64(ttl))

    def counters(self) -> dict[str, int]:
        """Ids ``admitted``, sightings ``rejected`` (read zeros), ids ``evicted``, ``live`` slots."""
        return {"admitted": int(self.stats[ADMITTED]), "rejected": int(self.stats[REJECTED]),
                "evicted": int(self.stats[EVICTED]), "live": int(self.stats[LIVE])}

    def delta(self, full: bool) -> dict[str, Any]:
        """The slots changed since the last delta (all when ``full``): ``slots`` int64 ``[k]``,
        their ``meta`` int64 ``[k, 4]`` and ``live`` uint8 ``[k]``, and the ``stats``; the
        dirty marks are cleared."""
        slots = np.arange(self.capacity, dtype=np.int64) if full else np.flatnonzero(self.dirty).astype(np.int64)
        self.dirty[:] = 0
        return {"slots": slots, "meta": self.meta[slots], "live": self.live[slots], "stats": self.stats.copy()}

    def apply(self, delta: dict[str, Any]) -> None:
        """Write a :meth:`delta` back (a checkpoint chain, oldest first; then :meth:`rebuild`)."""
        self.meta[delta["slots"]] = delta["meta"]
        self.live[delta["slots"]] = delta["live"]
        self.stats[:] = delta["stats"]
