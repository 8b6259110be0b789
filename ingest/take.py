"""Rows of a window's row groups taken in a given order, as one Arrow table: what a
permuted window's chunk is decoded from (row-level shuffling, :mod:`neorec.ingest.chunks`).

Flat columns go through Arrow's take. List columns (multi-hot features) go through a Numba
gather of whole bags: Arrow's take of a ``list<int64>`` column costs several times the
decoding of the same rows, while a bag is one contiguous run of ids that can be copied at
once. The gather writes the result's bags in order, one row group at a time, and reads
each bag from wherever it lies in its group, prefetching the bags a few rows ahead (the
reads are random, and without prefetching each waits for memory in turn). It yields a
``large_list`` column with the same bags: a null list becomes an empty bag, as decoding
reads it anyway.
A column whose ids hold a null anywhere goes through Arrow's take, so that decoding
names the bad row exactly as before.
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
    is_list = [pa.types.is_list(f.type) or pa.types.is_large_list(f.type) for f in window.schema]
    flat = [name for name, listed in zip(window.column_names, is_list) if not listed]
    taken = window.select(flat).take(pa.array(positions)) if flat else None
    columns: dict[str, pa.Array | pa.ChunkedArray] = {}
    sources = None
    for name, listed in zip(window.column_names, is_list):
        if not listed:
            columns[name] = taken.column(name)
            continue
        chunks = [_single(t.column(name)) for t in tables]
        if any(c.values.null_count for c in chunks):
            columns[name] = window.column(name).take(pa.array(positions))
            continue
        if sources is None:
            sources = _Sources(starts, positions)
        columns[name] = _take_bags(chunks, sources)
    return pa.table(columns)


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
