"""Rows of a window's row groups picked in a given order: what a permuted window's chunk is
decoded from (row-level shuffling, :mod:`neorec.ingest.chunks`).

Flat columns are not taken at all: each row group gives the kernels of
:mod:`neorec.ingest.flat_columns` the rows the chunk picks from it in ascending order and
their places, and they decode the values straight into the chunk's batch. List columns
(multi-hot features) go through a Numba gather of whole bags: Arrow's take of a
``list<int64>`` column costs several times the decoding of the same rows, while a bag is
one contiguous run of ids that can be copied at once. The gather writes the bags straight
into the decoded batch's ids, in order, one row group at a time, and reads each bag from
wherever it lies in its group, prefetching the bags a few rows ahead (the reads are random,
and without prefetching each waits for memory in turn; reading in ascending order and
writing at random places instead costs more, as the batch's ids outgrow the caches). A
null list is an empty bag, as decoding reads it anyway. A list column whose ids hold a
null anywhere goes through Arrow's take, so that decoding names the bad row exactly as
before (as does a flat column of a type the kernels do not read, or one decoded again to
name a bad value).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from neorec.common.borrowed_view import borrowed_view
from neorec.common.cache_prefetch import prefetch, prefetch_to_l2
from neorec.ingest.decoder import Bags
from neorec.ingest.flat_columns import Part, RoutedPart

PREFETCH_BAGS = 16
"""How many bags ahead of the one being copied the gather prefetches (their offsets twice
as far ahead)."""


class WindowTables:
    """A permuted window's row groups (``tables``, one schema; ``starts``: int64 ``[G + 1]``,
    where each one's rows begin in the window), prepared once for the chunks that pick
    rows of them. Raises ``ValueError`` if ``starts`` does not match the tables' row
    counts: the picks index the columns without bounds checks."""

    def __init__(self, tables: Sequence[pa.Table], starts: np.ndarray) -> None:
        if not np.array_equal(np.diff(starts), [t.num_rows for t in tables]) or starts[0] != 0:
            raise ValueError(f"row group starts {starts.tolist()} do not match the tables' rows "
                             f"{[t.num_rows for t in tables]}")
        self.starts = starts
        self.schema = tables[0].schema
        self.columns = {name: [_single(t.column(name)) for t in tables] for name in self.schema.names}
        self.bags = {  # list columns of integer ids that the bag gather copies
            field.name for field in self.schema
            if (pa.types.is_list(field.type) or pa.types.is_large_list(field.type))
            and pa.types.is_integer(field.type.value_type)
            and not any(c.values.null_count for c in self.columns[field.name])}

    def picked(self, positions: np.ndarray) -> "PickedRows":
        """The rows ``positions`` (int64 ``[B]``, numbered across the window's groups) in
        that order, as columns to decode. Every position must lie in ``[0, starts[-1])``:
        they are not checked (an out-of-range one reads past the columns)."""
        return PickedRows(self, positions)


class PickedTogether:
    """Several picks of a window's rows (positions as for :meth:`WindowTables.picked`, no
    row in two picks or twice in one), whose flat columns are decoded in one pass over
    each row group for all of them: ``routed(name)`` gives each group's column as a
    :class:`~neorec.ingest.flat_columns.RoutedPart` whose route for row ``i`` of pick
    ``k`` is ``k << shift | i`` (a row no pick takes is dropped)."""

    def __init__(self, window: WindowTables, picks: Sequence[np.ndarray]) -> None:
        self.window = window
        self.shift = max(0, max(p.size for p in picks) - 1).bit_length()
        dropped = len(picks) << self.shift
        if dropped >= 1 << 31:
            raise ValueError(f"{len(picks)} picks of up to {1 << self.shift} rows do not fit int32 routes")
        routes = np.full(int(window.starts[-1]), dropped, dtype=np.int32)
        for k, positions in enumerate(picks):
            routes[positions] = np.arange(k << self.shift, (k << self.shift) + positions.size, dtype=np.int32)
        bounds = window.starts.tolist()
        self._routes = [routes[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    @staticmethod
    def worth_it(picked: int, window_rows: int) -> bool:
        """Whether decoding picks of ``picked`` rows of a window of ``window_rows`` in one
        pass over its groups beats a pass per pick: from two fifths of the rows on, where
        a routed row costs less than a picked one (BENCHMARKS.md, ``neorec bench ingest``)."""
        return 5 * picked >= 2 * window_rows

    def routed(self, name: str) -> list[RoutedPart]:
        return [RoutedPart(chunk, routes) for chunk, routes in zip(self.window.columns[name], self._routes)]


class PickedRows:
    """Rows of a window's groups in a given order, as a
    :class:`~neorec.ingest.decoder.ColumnSource`: a flat column as one part per group, the
    rows it gives in ascending order and their places; a list column of integer ids as
    bags gathered whole; any column as Arrow's take of it (for other types, and to name a
    bad value)."""

    def __init__(self, window: WindowTables, positions: np.ndarray) -> None:
        self.window = window
        self.positions = positions
        self.num_rows = positions.size
        self.schema = window.schema
        self._picks: list[tuple[np.ndarray, np.ndarray]] | None = None  # made by the first parts() call
        self._picking = threading.Lock()  # the columns of a decode may ask at once
        # made at once, not on a first bags() call: a decode may ask for several list columns at once
        self._sources = _Sources(window.starts, positions) if window.bags else None

    def parts(self, name: str) -> list[Part]:
        return [Part(chunk, rows, places)
                for chunk, (rows, places) in zip(self.window.columns[name], self._ascending_picks()) if rows.size]

    def _ascending_picks(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row group: the rows it gives (int64, ascending, numbered within it) and their
        places (int64). Not made unless asked for: the flat columns of picks decoded
        together (:class:`PickedTogether`) need them only to name a bad value."""
        with self._picking:
            if self._picks is None:
                starts = self.window.starts
                rows = np.empty(self.num_rows, dtype=np.int64)
                places = np.empty(self.num_rows, dtype=np.int64)
                _ascending(self.positions, int(starts[-1]), rows, places)
                bounds = np.searchsorted(rows, starts).tolist()
                self._picks = [(rows[lo:hi] - start, places[lo:hi])
                               for lo, hi, start in zip(bounds[:-1], bounds[1:], starts[:-1].tolist())]
            return self._picks

    def array(self, name: str) -> pa.Array:
        chunks = self.window.columns[name]
        kind = pa.unify_schemas([pa.schema([pa.field(name, c.type)]) for c in chunks],
                                promote_options="permissive").field(name).type  # files may differ in width
        column = pa.chunked_array([c if c.type == kind else c.cast(kind) for c in chunks])
        return pc.take(column, pa.array(self.positions)).combine_chunks()

    def bags(self, name: str) -> Bags | None:
        if name not in self.window.bags:
            return None
        return _picked_bags(self.window.columns[name], self._sources)


@numba.njit(cache=True, nogil=True)
def _ascending(positions, num_rows, rows, places):  # pragma: no cover - compiled
    """``rows`` ← ``positions`` in ascending order, ``places`` ← where each one was
    (equal positions in their order): a counting sort over the window's rows."""
    first = np.zeros(num_rows + 1, dtype=np.int64)
    for k in range(positions.size):
        first[positions[k] + 1] += 1
    for r in range(num_rows):
        first[r + 1] += first[r]
    for k in range(positions.size):
        p = positions[k]
        slot = first[p]
        first[p] = slot + 1
        rows[slot] = p
        places[slot] = k


def _single(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


class _Sources:
    """For each table ``g``: the places ``slots[g]`` (int64, ascending) in the result of
    the rows it gives, and those rows ``rows[g]`` (int64, numbered within the table)."""

    def __init__(self, starts: np.ndarray, positions: np.ndarray) -> None:
        group = np.searchsorted(starts, positions, side="right") - 1
        self.size = positions.size
        self.slots = [np.flatnonzero(group == g) for g in range(starts.size - 1)]
        self.rows = [positions[slots] - start for slots, start in zip(self.slots, starts[:-1].tolist())]


def _picked_bags(chunks: Sequence[pa.Array], sources: _Sources) -> Bags:
    """The bags of the rows ``sources`` names (lists of integer ids, none null)."""
    lengths = np.zeros(sources.size, dtype=np.int32)
    parts = []
    for chunk, rows, slots in zip(chunks, sources.rows, sources.slots):
        offsets = chunk.offsets.to_numpy(zero_copy_only=False)
        ids = chunk.values.to_numpy(zero_copy_only=False)
        valid = (np.ones(0, dtype=np.bool_) if chunk.null_count == 0
                 else chunk.is_valid().to_numpy(zero_copy_only=False))
        _bag_lengths(offsets, valid, rows, slots, lengths)
        parts.append((offsets, ids, valid, rows, slots))
    starts = np.zeros(sources.size, dtype=np.int64)  # where each bag's ids go
    np.cumsum(lengths[:-1], out=starts[1:])

    def write(out: np.ndarray) -> None:
        for offsets, ids, valid, rows, slots in parts:
            _copy_bags(offsets, ids, valid, rows, starts[slots], out)

    return Bags(lengths, int(starts[-1] + lengths[-1]) if sources.size else 0, write)


@numba.njit(cache=True, nogil=True)
def _bag_lengths(offsets, valid, rows, slots, lengths):  # pragma: no cover - compiled
    """``lengths[slots[k]]``: the length of bag ``rows[k]`` (0 where ``valid`` says null;
    an empty ``valid``: no nulls)."""
    for k in range(rows.size):
        r = rows[k]
        if valid.size == 0 or valid[r]:
            lengths[slots[k]] = offsets[r + 1] - offsets[r]


@numba.njit(cache=True, nogil=True)
def _copy_bags(offsets, ids, valid, rows, places, out):  # pragma: no cover - compiled
    """Copy bag ``rows[k]``'s ids to ``out[places[k]:]`` (null bags copy nothing)."""
    n = rows.size
    for k in range(n):
        if k + 2 * PREFETCH_BAGS < n:
            prefetch(offsets, rows[k + 2 * PREFETCH_BAGS])
        if k + PREFETCH_BAGS < n:
            ahead = rows[k + PREFETCH_BAGS]
            first, end = offsets[ahead], offsets[ahead + 1]
            for q in range(first, end, 8):
                prefetch_to_l2(ids, q)
            if end > first:
                prefetch_to_l2(ids, end - 1)  # the last line, which the stride misses when the bag starts mid-line
        r = rows[k]
        if valid.size != 0 and not valid[r]:
            continue
        length = offsets[r + 1] - offsets[r]
        # views indexed from 0, so that the copy is one contiguous run (common/borrowed_view)
        source = borrowed_view(ids, offsets[r], length)
        target = borrowed_view(out, places[k], length)
        for t in range(length):
            target[t] = source[t]
