"""A row's initial value, as a pure function of (seed, table, row).

A table on the store tier is never materialised: a row that was never written has its
initial value, computed when it is first read. Tables held in memory start from the same
function, so training through the store and training in memory give the same numbers,
and a shard computes just its own rows (and columns).
"""

from __future__ import annotations

import numpy as np

from neorec.common.hashing import combine, splitmix64, unit_floats


def initial_rows(seed: int, table: int, rows: np.ndarray, table_rows: int, dim: int,
                 columns: tuple[int, int] | None = None) -> np.ndarray:
    """float32 ``[len(rows), c1 - c0]``: rows ``rows`` (int64) of table number ``table``,
    columns ``[c0, c1)`` (default: all ``dim``), uniform in ``±sqrt(1 / table_rows)`` (the
    DLRM reference's init), each element hashed from (seed, table, row, column)."""
    c0, c1 = columns if columns is not None else (0, dim)
    key = np.uint64(combine(seed, table))
    elements = np.asarray(rows, dtype=np.uint64)[:, None] * np.uint64(dim) + np.arange(c0, c1, dtype=np.uint64)
    uniform = unit_floats(splitmix64(elements ^ key))
    bound = float(np.sqrt(1.0 / table_rows))
    return ((uniform * 2.0 - 1.0) * bound).astype(np.float32)


def initial_block(seed: int, table: int, row_offset: int, rows: int, table_rows: int, dim: int,
                  columns: tuple[int, int] | None = None, chunk_rows: int = 1 << 16) -> np.ndarray:
    """Rows ``[row_offset, row_offset + rows)`` of a table, as :func:`initial_rows`, computed
    ``chunk_rows`` at a time (bounded temporaries for large tables)."""
    c0, c1 = columns if columns is not None else (0, dim)
    out = np.empty((rows, c1 - c0), dtype=np.float32)
    for lo in range(0, rows, chunk_rows):
        hi = min(lo + chunk_rows, rows)
        out[lo:hi] = initial_rows(seed, table, np.arange(row_offset + lo, row_offset + hi, dtype=np.int64),
                                  table_rows, dim, columns)
    return out
