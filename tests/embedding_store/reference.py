"""Plain-Python references for the embedding store's tests."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


def fully_associative_lru_hits(ids: np.ndarray, capacity: int) -> int:
    """Hits of a fully associative LRU cache of ``capacity`` rows fed ``ids`` (int64
    ``[n]``) one at a time: the bound a set-associative cache gives up against."""
    recent: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for row in ids.tolist():
        if row in recent:
            hits += 1
            recent.move_to_end(row)
            continue
        recent[row] = None
        if len(recent) > capacity:
            recent.popitem(last=False)
    return hits
