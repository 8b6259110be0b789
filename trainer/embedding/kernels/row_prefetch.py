"""Prefetching an embedding row for the fused kernels (see :mod:`neorec.common.cache_prefetch`)."""

from __future__ import annotations

import numba

from neorec.common.cache_prefetch import prefetch, prefetch_for_write
from neorec.trainer.embedding.kernels.precision import FP32


@numba.njit(inline="always")
def prefetch_row(weights, weights16, precision, start, dim):
    """Prefetch the cache lines of one row of ``dim`` weights from ``start``: float32
    ``weights`` or, in half precision, uint16 ``weights16`` (for reading it)."""
    if precision == FP32:
        for d in range(0, dim, 16):
            prefetch(weights, start + d)
    else:
        for d in range(0, dim, 32):
            prefetch(weights16, start + d)


@numba.njit(inline="always")
def prefetch_row_for_write(weights, weights16, precision, start, dim):
    """:func:`prefetch_row` for a row the kernel is about to update."""
    if precision == FP32:
        for d in range(0, dim, 16):
            prefetch_for_write(weights, start + d)
    else:
        for d in range(0, dim, 32):
            prefetch_for_write(weights16, start + d)
