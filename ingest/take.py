"""Rows of a window's row groups taken in a given order, as one Arrow table: what a
permuted window's chunk is decoded from (row-level shuffling, :mod:`neorec.ingest.chunks`).

Flat columns go through Arrow's take; one with nulls as two takes, of its values and of
its validity, which together cost less than Arrow's take that minds the nulls. List
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

from neorec.common.cache_prefetch import prefetch

PREFETCH_BAGS = 16
"""How many bags ahead of the one being copied the gather prefetches (their offsets twice
as far ahead)."""


def take_rows(tables: Sequence[pa.Table], starts: np.ndarray, positions: np.ndarray) -> pa.Table:
    """The rows ``positions`` (int64 ``[B]``, numbered across ``tables`` one after the
    other; ``starts``: int64 ``[G + 1]``, where each table's rows begin) in that order.

    ``tables`` share one schema. Memory: the returned table alone (the result's columns),
    besides int64 ``[B]`` scratch arrays.
    """
    window = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    indices = pa.array(positions)
    columns: dict[str, pa.Array | pa.ChunkedArray] = {}
    plain = []  # columns Arrow takes as they are
    sources = None
    for field in window.schema:
        column = window.column(field.name)
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            chunks = [_single(t.column(field.name)) for t in tables]
            if not pa.types.is_integer(field.type.value_type) or any(c.values.null_count for c in chunks):
                columns[field.name] = column.take(indices)
                continue
            if sources is None:
                sources = _Sources(starts, positions)
            columns[field.name] = _take_bags(chunks, sources)
        elif column.null_count and (pa.types.is_integer(field.type) or pa.types.is_floating(field.type)):
            columns[field.name] = _take_nullable(column, indices)
        else:
            plain.append(field.name)
    if plain:
        taken = window.select(plain).take(indices)
        columns.update((name, taken.column(name)) for name in plain)
    return pa.table({field.name: columns[field.name] for field in window.schema})


def _take_nullable(column: pa.ChunkedArray, indices: pa.Array) -> pa.Array:
    """Arrow's take of a fixed-width column with nulls, as a take of its values (read as
    if none were null) and one of its validity, which together cost about 0.7 of Arrow's
    take that handles the nulls itself. The values under the nulls are whatever the
    source holds there (Arrow's take writes zeros)."""
    values = pa.chunked_array([pa.Array.from_buffers(c.type, len(c), [None, c.buffers()[1]], offset=c.offset)
                               for c in column.chunks], type=column.type).take(indices).combine_chunks()
    valid = pa.chunked_array([c.is_valid() for c in column.chunks], type=pa.bool_()).take(indices).combine_chunks()
    return pa.Array.from_buffers(column.type, len(indices), [valid.buffers()[1], values.buffers()[1]],
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
