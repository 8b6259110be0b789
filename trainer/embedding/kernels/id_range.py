"""The id range check of a batch on the CPU: one pass over the ids, no temporaries (the
``bounds_check = "fatal"`` setting; :mod:`neorec.trainer.embedding.bounds`)."""

from __future__ import annotations

import numba
import numpy as np

from neorec.common.borrowed_view import borrowed_view


@numba.njit(cache=True, nogil=True)
def first_out_of_range(
    values: np.ndarray,   # int64 [N]: the batch's ids, key-major
    lengths: np.ndarray,  # int32 [K * B]: lengths[k * B + b] ids for sample b of key k
    batch_size: int,      # B
    limits: np.ndarray,   # int64 [K]: rows of each key's table
) -> int:
    """Position in ``values`` of the first id outside ``[0, limits[key])``, or -1."""
    position = 0
    for key in range(limits.size):
        count = 0
        bags = borrowed_view(lengths, key * batch_size, batch_size)  # a contiguous run (common/borrowed_view)
        for bag in range(batch_size):
            count += bags[bag]
        end = min(position + count, values.size)
        limit = limits[key]
        ids = borrowed_view(values, position, end - position)
        for i in range(end - position):
            if ids[i] < 0 or ids[i] >= limit:
                return position + i
        position = end
    return -1
