"""The id range check of a batch on the CPU: one pass over the ids, no temporaries (the
``bounds_check = "fatal"`` setting; :mod:`neorec.trainer.embedding.bounds`)."""

from __future__ import annotations

import numba
import numpy as np


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
        for bag in range(key * batch_size, (key + 1) * batch_size):
            count += lengths[bag]
        end = min(position + count, values.size)
        limit = limits[key]
        for i in range(position, end):
            if values[i] < 0 or values[i] >= limit:
                return i
        position = end
    return -1
