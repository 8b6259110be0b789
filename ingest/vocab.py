"""Categorical values → ids: a vocabulary counted on the train split, or hashing.

Values are compared as strings (an integer column's ``7`` is ``"7"``), so a vocabulary
saved with one dataset encodes the next the same way whatever the files' inferred types.
Id 0 is reserved: missing, unseen, and (vocabulary) rarer than ``min_count`` or beyond
``max_rows``. A vocabulary orders values by count (descending), ties by value, so it is a
pure function of the train split's values. Everything is vectorized over a batch: counts
are merged with Arrow's group-by, ids found with ``index_in``, strings hashed by a Numba
kernel over the column's buffers.
"""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from neorec.common.hashing import mix64_jit
from neorec.ingest.decoder import open_parquet
from neorec.ingest.errors import DataError
from neorec.ingest.schema import PARQUET_WRITE_OPTIONS

MERGE_EVERY = 16
"""Batch counts merged into the running counts this many batches at a time."""
FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)


def as_strings(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column's values as strings (nulls stay null)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    return values if pa.types.is_string(values.type) else pc.cast(values, pa.string())


class ValueCounter:
    """Counts of a column's values over batches, in memory proportional to its distinct
    values (merged every :data:`MERGE_EVERY` batches)."""

    def __init__(self) -> None:
        self._merged: pa.Table | None = None
        self._pending: list[pa.Table] = []

    def add(self, values: pa.Array) -> None:
        """Count ``values`` (strings; nulls are not counted)."""
        counts = pc.value_counts(values.drop_null())
        self._pending.append(pa.table({"value": counts.field("values"), "count": counts.field("counts")}))
        if len(self._pending) >= MERGE_EVERY:
            self._merge()

    def _merge(self) -> None:
        parts = ([self._merged] if self._merged is not None else []) + self._pending
        self._pending = []
        if parts:
            merged = pa.concat_tables(parts).group_by("value").aggregate([("count", "sum")])
            self._merged = merged.rename_columns(["value", "count"])

    def vocabulary(self, min_count: int = 1, max_rows: int = 0) -> "Vocabulary":
        """The values seen at least ``min_count`` times, most frequent first (ties by value),
        at most ``max_rows - 1`` of them (id 0 is reserved) when ``max_rows``."""
        self._merge()
        table = self._merged if self._merged is not None else pa.table(
            {"value": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
        table = table.filter(pc.greater_equal(table["count"], min_count))
        table = table.sort_by([("count", "descending"), ("value", "ascending")])
        if max_rows:
            table = table.slice(0, max_rows - 1)
        return Vocabulary(table["value"].combine_chunks(), table["count"].combine_chunks())


class Vocabulary:
    """``values[i]`` has id ``i + 1`` (``counts[i]``: its count in the train split)."""

    def __init__(self, values: pa.Array, counts: pa.Array) -> None:
        self.values = values
        self.counts = counts

    @property
    def rows(self) -> int:
        """Rows of the table it feeds: its values and the reserved id 0."""
        return len(self.values) + 1

    def encode(self, values: pa.Array) -> np.ndarray:
        """int64 ids of ``values`` (strings): ``1 + position``, 0 when missing or unknown."""
        index = pc.index_in(values, value_set=self.values)
        return pc.fill_null(pc.add(index.cast(pa.int64()), 1), 0).to_numpy(zero_copy_only=False)

    def save(self, path: Path) -> None:
        pq.write_table(pa.table({"value": self.values, "count": self.counts}), path, **PARQUET_WRITE_OPTIONS)

    @classmethod
    def load(cls, path: Path) -> "Vocabulary":
        """The vocabulary saved at ``path``; a :class:`DataError` naming it when it cannot be
        read (a page whose checksum fails, a file that is not a vocabulary)."""
        try:
            table = open_parquet(path).read(columns=["value", "count"])
        except (OSError, ValueError, KeyError, pa.ArrowException) as err:
            raise DataError(f"cannot read this vocabulary: {' '.join(str(err).split())}", file=str(path)) from None
        return cls(table["value"].combine_chunks(), table["count"].combine_chunks())


def hash_encode(values: pa.Array, rows: int, seed: int) -> np.ndarray:
    """int64 ids in ``[1, rows)`` of ``values`` (strings) hashed with ``seed``; 0 when missing.
    ``rows`` 0: the whole 64-bit hash, as int64 of any sign (raw ids for a dynamic table)."""
    values = values.cast(pa.large_string()) if not pa.types.is_large_string(values.type) else values
    validity, offsets, data = values.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int64)[values.offset : values.offset + len(values) + 1]
    chars = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    ids = np.empty(len(values), dtype=np.int64)
    _hash_strings(offsets, chars, np.uint64(seed), np.uint64(rows - 1 if rows else 0), ids)
    if values.null_count:
        ids[values.is_null().to_numpy(zero_copy_only=False)] = 0
    return ids


@numba.njit(cache=True, nogil=True)
def _hash_strings(offsets, chars, seed, buckets, out):  # pragma: no cover - compiled
    """FNV-1a over each string's bytes, mixed with the seed by splitmix64's finalizer, in
    ``[1, buckets]`` (``buckets`` 0: all 64 bits)."""
    for i in range(out.size):
        h = FNV_OFFSET
        for k in range(offsets[i], offsets[i + 1]):
            h = (h ^ np.uint64(chars[k])) * FNV_PRIME
        out[i] = np.int64(mix64_jit(h ^ seed)) if buckets == 0 else np.int64(mix64_jit(h ^ seed) % buckets) + 1
