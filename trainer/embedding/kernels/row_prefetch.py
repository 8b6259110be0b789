"""Prefetching an embedding row for the fused kernels (see :mod:`neorec.common.cache_prefetch`)."""

from __future__ import annotations

import numba

from neorec.common.cache_prefetch import prefetch_to_l2
from neorec.trainer.embedding.kernels.precision import FP32


@numba.njit(inline="always")
def prefetch_row(weights, weights16, precision, start, dim):
    """Prefetch the cache lines of one row of ``dim`` weights from ``start`` into L2:
    float32 ``weights`` or, in half precision, uint16 ``weights16``.

    For the forward, which only reads the row, and for the update, which writes it too: a
    line read from memory that no other core holds arrives exclusive, so the update's
    write needs no further request, and the kernels keep many rows in flight, which L1's
    few outstanding-miss slots would hold up. Against ``prefetchw`` of the rows to be
    updated, one thread's row-wise Adagrad step is ~10-15% faster; a read into L1 is not
    (BENCHMARKS.md, ``neorec bench tbe``)."""
    if precision == FP32:
        for d in range(0, dim, 16):
            prefetch_to_l2(weights, start + d)
    else:
        for d in range(0, dim, 32):
            prefetch_to_l2(weights16, start + d)
