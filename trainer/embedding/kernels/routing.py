"""Routing of a batch's ids to the shards that hold their rows (the sending side of the
input all-to-all), as a two-pass counting sort.

A *unit* is one feature routed over one or more *routes*: a route is a destination slot
and the first table row it holds. A row-split table's feature is one unit whose routes are
its shards (an id goes to the last route whose first row is <= the id); any other
table's feature gives one unit per shard with a single route at row 0 (every id goes to
every shard). The output is slot-major, then bag, then id order.

A dynamic table's unit (``unit_shards`` > 0: its map shards) routes a raw id by the first
row of its map shard (:mod:`~neorec.trainer.embedding.dynamic.shards`) and sends the raw id
itself: any int64 is valid, the receiving rank maps it to a row.
"""

from __future__ import annotations

import numba
import numpy as np

from neorec.trainer.embedding.dynamic.shards import shard_of_jit


@numba.njit(cache=True, nogil=True)
def _route_of(row: int, route_rows: np.ndarray, first: int, count: int) -> int:
    """Index of the last route of ``route_rows[first:first + count]`` starting at or below ``row``."""
    lo, hi = first, first + count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if route_rows[mid] <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


@numba.njit(cache=True, nogil=True)
def route_ids(
    values: np.ndarray,         # int64 [N]: the batch's ids
    id_weights: np.ndarray,     # float32 [N] or [0]
    bag_offsets: np.ndarray,    # int64 [F_batch * B + 1]
    unit_source: np.ndarray,    # int64 [U]: batch feature of each unit
    unit_rows: np.ndarray,      # int64 [U]: rows of the unit's table
    unit_routes: np.ndarray,    # int64 [U + 1]: unit u's routes are [unit_routes[u], unit_routes[u+1])
    unit_shards: np.ndarray,    # int64 [U]: map shards of a dynamic table's unit, 0 for a static one
    route_rows: np.ndarray,     # int64 [R]: first row of each route
    route_slot: np.ndarray,     # int64 [R]: slot of each route
    num_slots: int,
    batch_size: int,
    lengths: np.ndarray,        # int32 [num_slots * B], written: ids per (slot, bag)
    out_values: np.ndarray,     # int64 [>= routed ids], written: ids local to their shard (dynamic: raw)
    out_weights: np.ndarray,    # float32 like out_values or [0], written
) -> tuple[int, int, int]:
    """Route every id; returns ``(routed ids, first bad unit, first bad id)``, the unit being
    -1 when every id lies inside its table."""
    weighted = id_weights.shape[0] > 0
    lengths[:] = 0
    bad_unit, bad_id = -1, 0
    capacity = out_values.shape[0]
    target = np.empty(capacity, dtype=np.int64)  # per routed id: slot * B + bag
    local = np.empty(capacity, dtype=np.int64)   # the id within its shard
    origin = np.empty(capacity, dtype=np.int64)  # its position in the batch
    k = 0
    for u in range(unit_source.shape[0]):
        first, count = unit_routes[u], unit_routes[u + 1] - unit_routes[u]
        shards = unit_shards[u]
        block = unit_rows[u] // shards if shards > 0 else 0  # rows per map shard
        for b in range(batch_size):
            bag = unit_source[u] * batch_size + b
            for p in range(bag_offsets[bag], bag_offsets[bag + 1]):
                row = values[p]
                if shards > 0:
                    r = _route_of(shard_of_jit(row, shards) * block, route_rows, first, count)
                    local[k] = row
                else:
                    if row < 0 or row >= unit_rows[u]:
                        if bad_unit < 0:
                            bad_unit, bad_id = u, row
                        row = 0
                    r = _route_of(row, route_rows, first, count)
                    local[k] = row - route_rows[r]
                target[k] = route_slot[r] * batch_size + b
                origin[k] = p
                lengths[target[k]] += 1
                k += 1
    cursor = np.empty(num_slots * batch_size, dtype=np.int64)
    total = 0
    for i in range(num_slots * batch_size):
        cursor[i] = total
        total += lengths[i]
    for i in range(k):  # scatter in routing order: within a (slot, bag), ids keep their order
        at = cursor[target[i]]
        out_values[at] = local[i]
        if weighted:
            out_weights[at] = id_weights[origin[i]]
        cursor[target[i]] = at + 1
    return total, bad_unit, bad_id
