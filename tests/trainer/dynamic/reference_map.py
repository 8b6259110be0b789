"""A plain-Python dynamic id map with the documented semantics, to check the kernels against:
dicts and an OrderedDict for the LRU order, a list-of-lists count-min sketch."""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from neorec.common.hashing import combine, mix64
from neorec.trainer.embedding.dynamic.admission import SATURATED


class ReferenceSketch:
    """Count-min with conservative update, hashing as the kernels do, counting up to
    :data:`SATURATED`."""

    def __init__(self, width: int, depth: int, table: int) -> None:
        self.width = width
        self.rows = [[0] * width for _ in range(depth)]
        self.salts = [combine(table, r) for r in range(depth)]

    def add(self, key: int) -> int:
        with np.errstate(over="ignore"):
            cells = [int(mix64(np.uint64(key & (2**64 - 1)) ^ np.uint64(salt))) % self.width for salt in self.salts]
        new = min(min(row[c] for row, c in zip(self.rows, cells)) + 1, SATURATED)
        for row, c in zip(self.rows, cells):
            row[c] = max(row[c], new)
        return new

    def halve(self) -> None:
        self.rows = [[c // 2 for c in row] for row in self.rows]


class ReferenceMap:
    """The id → slot map of one table, an id at a time."""

    def __init__(self, capacity: int, min_count: int, ttl: int, width: int = 64, depth: int = 2,
                 table: int = 0, half_life: int = 0) -> None:
        self.min_count, self.ttl, self.half_life = min_count, ttl, half_life
        self.sketch = ReferenceSketch(width, depth, table)
        self.slot_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.seen: dict[int, int] = {}
        self.free = deque(range(capacity))
        self.uses = [0] * capacity
        self.clock = 0
        self.admitted = self.rejected = self.evicted = 0

    def expire(self) -> None:
        for key in list(self.lru):
            if self.clock - self.seen[key] <= self.ttl:
                break
            self.free.append(self._evict(key))

    def _evict(self, key: int) -> int:
        del self.lru[key]
        self.evicted += 1
        return self.slot_of.pop(key)

    def train(self, ids: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Slots of a training batch (-1: none) and the (slot, generation) re-initialised."""
        if self.ttl:
            self.expire()
        used: set[int] = set()
        out, reinit = [], []
        for key in ids:
            if key in self.slot_of:
                self.lru.move_to_end(key)
                self.seen[key] = self.clock
                out.append(self.slot_of[key])
                used.add(self.slot_of[key])
                continue
            if self.min_count > 1 and self.sketch.add(key) < self.min_count:
                out.append(-1)
                self.rejected += 1
                continue
            if self.free:
                slot = self.free.popleft()
            else:
                victim = next(iter(self.lru))
                if self.slot_of[victim] in used:
                    out.append(-1)
                    self.rejected += 1
                    continue
                slot = self._evict(victim)
            if self.uses[slot]:
                reinit.append((slot, self.uses[slot]))
            self.uses[slot] += 1
            self.slot_of[key] = slot
            self.lru[key] = None
            self.seen[key] = self.clock
            self.admitted += 1
            used.add(slot)
            out.append(slot)
        self.clock += 1
        if self.half_life and self.clock % self.half_life == 0:
            self.sketch.halve()
        return out, reinit
