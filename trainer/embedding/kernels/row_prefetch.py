"""Prefetching an embedding row for the fused kernels (see :mod:`neorec.common.cache_prefetch`)."""

from __future__ import annotations

import numba

from neorec.common.cache_prefetch import prefetch_for_write, prefetch_to_l2
from neorec.trainer.embedding.kernels.precision import FP32


@numba.njit(inline="always")
def prefetch_row(weights, weights16, precision, start, dim, for_write):
    """Prefetch the cache lines of one row of ``dim`` weights from ``start``: float32
    ``weights`` or, in half precision, uint16 ``weights16``. ``for_write``: the kernel is
    about to update the row (each call passes a constant, folded away once inlined). A row
    only read is prefetched into L2 (the forward keeps many rows in flight)."""
    if precision == FP32:
        for d in range(0, dim, 16):
            _prefetch_line(weights, start + d, for_write)
    else:
        for d in range(0, dim, 32):
            _prefetch_line(weights16, start + d, for_write)


@numba.njit(inline="always")
def _prefetch_line(array, index, for_write):
    if for_write:
        prefetch_for_write(array, index)
    else:
        prefetch_to_l2(array, index)
