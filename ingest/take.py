"""Rows of a window's row groups taken in a given order, as one Arrow table: what a
permuted window's chunk is decoded from (row-level shuffling, :mod:`neorec.ingest.chunks`).

Flat columns go through Arrow's take, from one contiguous array per window
(:class:`WindowTables`); one with nulls as two takes, of its values and of its validity,
which together cost less than Arrow's take that minds the nulls. List
columns (multi-hot features) go through a Numba gather of whole bags: Arrow's take of a
``list<int64>`` column costs several times the decoding of the same rows, while a bag is
one contiguous run of ids that can be copied at once. The gather writes the result's bags
in order, one row group at a time, and reads each bag from wherever it lies in its group,
prefetching the bags a few rows ahead (the reads are random, and without prefetching each
waits for memory in turn). It yields a ``large_list`` column with the same bags: a null
list becomes an empty bag, as decoding reads it anyway. A list column whose ids hold a
null anywhere goes through Arrow's take, so that decoding names the bad row exactly as
before.
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from neorec.common.cache_prefetch import prefetch

PREFETCH_BAGS = 16
"""How many bags ahead of the one being copied the gather prefetches (their offsets twice
as far ahead)."""


class WindowTables:
    """A permuted window's row groups (``tables``, one schema; ``starts``: int64 ``[G + 1]``,
    where each one's rows begin in the window), prepared once for the takes of all the
    window's chunks: each flat column as one contiguous array, since Arrow's take of a
    chunked column costs about ten times its take of the same rows from one array (a
    criteo column of 262k rows in four groups: 1.8 ms against 0.14 ms for 64k rows). A
    column with nulls is kept as its values (read as if none were null) and its validity,
    taken apart. Memory: one copy of the flat columns of the window's groups when there are
    several. Raises ``ValueError`` if ``starts`` does not match the tables' row counts: the
    takes index the columns without bounds checks."""

    def __init__(self, tables: Sequence[pa.Table], starts: np.ndarray) -> None:
        if not np.array_equal(np.diff(starts), [t.num_rows for t in tables]) or starts[0] != 0:
            raise ValueError(f"row group starts {starts.tolist()} do not match the tables' rows "
                             f"{[t.num_rows for t in tables]}")
        self.starts = starts
        self.schema = tables[0].schema
        window = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        self._flat: dict[str, pa.Array] = {}  # columns taken as they are
        self._nullable: dict[str, tuple[pa.Array, pa.Array]] = {}  # (values without validity, validity)
        self._bags: dict[str, list[pa.Array]] = {}  # list columns of integer ids, per group
        for field in self.schema:
            if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
                chunks = [_single(t.column(field.name)) for t in tables]
                if pa.types.is_integer(field.type.value_type) and not any(c.values.null_count for c in chunks):
                    self._bags[field.name] = chunks
                    continue
            column = _single(window.column(field.name))
            if column.null_count and (pa.types.is_integer(field.type) or pa.types.is_floating(field.type)):
                values = pa.Array.from_buffers(column.type, len(column), [None, column.buffers()[1]],
                                               offset=column.offset)
                self._nullable[field.name] = (values, column.is_valid())
            else:
                self._flat[field.name] = column

    def take(self, positions: np.ndarray) -> pa.Table:
        """The rows ``positions`` (int64 ``[B]``, numbered across the window's groups) in
        that order. Every position must lie in ``[0, starts[-1])``: they are not checked (an
        out-of-range one reads past the columns). Memory: the returned table, besides int64
        ``[B]`` scratch."""
        indices = pa.array(positions)
        columns: dict[str, pa.Array] = {}
        sources = None
        for field in self.schema:
            name = field.name
            if name in self._bags:
                if sources is None:
                    sources = _Sources(self.starts, positions)
                columns[name] = _take_bags(self._bags[name], sources)
            elif name in self._nullable:
                values, valid = self._nullable[name]
                columns[name] = _with_validity(_take(values, indices), _take(valid, indices))
            else:
                columns[name] = _take(self._flat[name], indices)
        return pa.table({field.name: columns[field.name] for field in self.schema})


def _take(array: pa.Array, indices: pa.Array) -> pa.Array:
    """Arrow's take without its bounds check: the positions come from the window's own
    permutation of its rows."""
    return pc.take(array, indices, boundscheck=False)


def _with_validity(values: pa.Array, valid: pa.Array) -> pa.Array:
    """``values`` (fixed width, no nulls) with ``valid`` (boolean) as their validity; the
    values under the nulls are whatever the source held there (Arrow's take of a column
    with nulls writes zeros, and costs about 1.4 times the two takes)."""
    return pa.Array.from_buffers(values.type, len(values), [valid.buffers()[1], values.buffers()[1]],
                                 offset=0)


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


def _take_bags(chunks: Sequence[pa.Array], sources: _Sources) -> pa.Array:
    """The bags of the rows ``sources`` names, as a ``large_list`` array (no nulls)."""
    lengths = np.zeros(sources.size, dtype=np.int64)
    parts = []
    for chunk, rows, slots in zip(chunks, sources.rows, sources.slots):
        offsets = chunk.offsets.to_numpy(zero_copy_only=False)
        ids = chunk.values.to_numpy(zero_copy_only=False)
        valid = (np.ones(0, dtype=np.bool_) if chunk.null_count == 0
                 else chunk.is_valid().to_numpy(zero_copy_only=False))
        _bag_lengths(offsets, valid, rows, slots, lengths)
        parts.append((offsets, ids, valid, rows, slots))
    out_offsets = np.zeros(sources.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    value_type = chunks[0].type.value_type
    out_ids = np.empty(int(out_offsets[-1]), dtype=value_type.to_pandas_dtype())
    for offsets, ids, valid, rows, slots in parts:
        _copy_bags(offsets, ids, valid, rows, out_offsets[slots], out_ids)
    return pa.LargeListArray.from_arrays(pa.array(out_offsets), pa.array(out_ids, type=value_type))


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
            for q in range(offsets[ahead], offsets[ahead + 1], 8):
                prefetch(ids, q)
        r = rows[k]
        if valid.size != 0 and not valid[r]:
            continue
        start = offsets[r]
        place = places[k]
        for t in range(offsets[r + 1] - start):
            out[place + t] = ids[start + t]
