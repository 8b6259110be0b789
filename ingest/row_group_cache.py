"""Recently read Parquet row groups, shared by a reader service's concurrent reads.

Tasks end at batch boundaries and row groups do not, so the row group where one task
ends is usually where the next one starts, and a worker serving both (a client streams
consecutive tasks from each worker at once) would read and decompress it twice. The
cache keeps the Arrow tables of the last row groups read, up to a byte budget, and
lets a second reader of a row group being read wait for the first one's result.

Entries are per epoch: an epoch reads every row once, so within it a row group is read
again only for its other pieces, which is the waste the cache removes. Across epochs it
never serves a table, so that a small data set is not read from memory epoch after epoch
(which would make a worker look faster than decoding is). For the same reason a window's
tables are dropped as soon as this worker has decoded all of the window's rows for the
epoch (:meth:`RowGroupCache.rows_decoded`): no read of the epoch needs them again, and
their memory goes to the next row groups at once instead of sitting in the budget until
the least recently used entries make room (a service that kept them grew by the whole
budget first, every page of it mapped and faulted in afresh).

Only Parquet reading is shared: each task still decodes and checks just its own rows,
so what a request returns, and which errors it raises, do not depend on the cache.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

if TYPE_CHECKING:
    import pyarrow as pa

DEFAULT_CAPACITY_BYTES = 512 << 20


class _Key(NamedTuple):
    """A cached table: one row group's columns of one file version, for one epoch."""

    path: str
    mtime_ns: int
    size: int  # with mtime_ns: a rewritten file is another key
    row_group: int
    columns: tuple[str, ...]
    epoch: int

    def of(self, groups: Sequence[tuple[str, int]], columns: tuple[str, ...], epoch: int) -> bool:
        """Whether this is a table of row groups ``groups`` (``(path, row_group)`` pairs)."""
        return (self.path, self.row_group) in groups and (self.columns, self.epoch) == (columns, epoch)


class RowGroupCache:
    """Arrow tables by row group, least recently used evicted beyond ``capacity_bytes``.

    The table just read is always kept, even when it alone exceeds the budget.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._tables: OrderedDict[_Key, Future] = OrderedDict()
        self._sizes: dict[_Key, int] = {}  # bytes of each table read (not of those in flight)
        self._decoded: dict[tuple, list[tuple[int, int]]] = {}
        """Runs of rows of a window decoded so far (disjoint, ascending), by window, columns and epoch."""

    def read(
        self, path: str, row_group: int, columns: tuple[str, ...], epoch: int, load: Callable[[], pa.Table]
    ) -> pa.Table:
        """Row group ``row_group`` of the file at ``path`` (its ``columns``) for a read of
        ``epoch``: cached, being read by another thread, or read now by ``load()``, whose
        errors propagate to every thread waiting for it (and are not cached)."""
        stat = os.stat(path)
        key = _Key(path, stat.st_mtime_ns, stat.st_size, row_group, columns, epoch)
        with self._lock:
            future = self._tables.get(key)
            reader = future is None
            if reader:
                future = self._tables[key] = Future()
                self.misses += 1
            else:
                self._tables.move_to_end(key)
                self.hits += 1
        if reader:
            try:
                table = load()
            except BaseException as err:
                with self._lock:
                    del self._tables[key]
                future.set_exception(err)
                raise
            with self._lock:
                self._sizes[key] = table.nbytes
                self._evict(keep=key)
            future.set_result(table)
        return future.result()

    def rows_decoded(self, groups: Sequence[tuple[str, int]], columns: tuple[str, ...], epoch: int, start: int,
                     stop: int, window_rows: int) -> None:
        """Note that rows ``[start, stop)`` (in the window's read order) were decoded for
        ``epoch`` from the window whose row groups are ``groups`` (``(path, row_group)``
        pairs) and which holds ``window_rows`` rows; once every row of it has been, drop its
        tables. A client asks for each row of an epoch once, so they are not needed again.
        Rows decoded twice (a task retried after its stream broke) count once; a read that
        comes after the drop reads its row groups again."""
        window = (tuple(groups), columns, epoch)
        with self._lock:
            decoded = _merged(self._decoded.pop(window, []), start, stop)
            if sum(b - a for a, b in decoded) < window_rows:
                self._decoded[window] = decoded
                return
            for key in [k for k in self._tables if k.of(window[0], columns, epoch)]:
                if key in self._sizes:  # a table still being read stays for its waiters
                    del self._tables[key], self._sizes[key]

    def _evict(self, keep: _Key) -> None:
        """Drop the least recently used tables read, except ``keep``, until the rest fit,
        and the counts of windows left with no table (lock held)."""
        total = sum(self._sizes.values())
        evicted = False
        for key in list(self._tables):
            if total <= self.capacity_bytes:
                break
            if key in self._sizes and key != keep:
                total -= self._sizes.pop(key)
                del self._tables[key]
                evicted = True
        if evicted:
            for window in [w for w in self._decoded if not any(k.of(*w) for k in self._tables)]:
                del self._decoded[window]  # its tables are gone: a count that would never complete


def _merged(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """``runs`` (disjoint ``[a, b)`` pairs, ascending) with ``[start, stop)`` added, runs
    that overlap or touch merged into one."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*runs, (start, stop)]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
