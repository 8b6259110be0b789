"""Pooled forward over all tables of a fused module in one parallel kernel.

Weights of all tables live in one flat array (float32, or fp16/bf16 bit patterns);
table ``t`` occupies ``weights[table_offsets[t] : table_offsets[t] + rows[t] * dims[t]]``
row-major. Pooling is in float32 whatever the storage.
"""

from __future__ import annotations

import numba
import numpy as np

from trainer.kernels.precision import FP32, decode
from trainer.kernels.prefetch import prefetch_row

PREFETCH_IDS = 16
"""How many ids ahead the forward prefetches rows."""


@numba.njit(parallel=True, cache=True, nogil=True)
def pooled_forward(
    weights: np.ndarray,         # float32 [sum(rows * dims)], or [0] when weights16 holds them
    weights16: np.ndarray,       # uint16 fp16/bf16 bit patterns [sum(rows * dims)], or [0]
    precision: int,              # precision.FP32, FP16 or BF16
    table_offsets: np.ndarray,   # int64 [T]
    dims: np.ndarray,            # int64 [T]
    rows: np.ndarray,            # int64 [T]
    feature_table: np.ndarray,   # int64 [F]: table of each module feature
    feature_source: np.ndarray,  # int64 [F]: index of the feature in the batch's keys
    out_columns: np.ndarray,     # int64 [F]: first output column of each feature
    mean_pooling: np.ndarray,    # bool [T]
    bag_offsets: np.ndarray,     # int64 [F_batch * B + 1]
    values: np.ndarray,          # int64 [N]
    id_weights: np.ndarray,      # float32 [N] or [0] when unweighted
    batch_size: int,
    out: np.ndarray,             # float32 [B * sum(dims of features)] (row-major [B, C]), written
    bag_of_id: np.ndarray,       # int32 [N], written: module bag (f * B + b) of each id
                                 # of the module's features (others untouched)
) -> int:
    """Sum (or mean) of each bag's rows; returns the number of out-of-range ids (0 if valid).

    Each bag is summed by one thread in id order, so the result does not depend on the
    thread count.
    """
    num_bags = feature_table.shape[0] * batch_size
    width = out.shape[0] // max(batch_size, 1)
    weighted = id_weights.shape[0] > 0
    bad = 0  # a reduction over the threads: the count of out-of-range ids
    for bag in numba.prange(num_bags):
        f = bag // batch_size
        b = bag - f * batch_size
        t = feature_table[f]
        dim = dims[t]
        base = table_offsets[t]
        o = b * width + out_columns[f]
        pooled = out[o : o + dim]  # slices indexed by the loop counter vectorize
        source_bag = feature_source[f] * batch_size + b
        start = bag_offsets[source_bag]
        end = bag_offsets[source_bag + 1]
        feature_end = bag_offsets[(feature_source[f] + 1) * batch_size]
        for d in range(dim):
            pooled[d] = 0.0
        for p in range(start, end):
            ahead = p + PREFETCH_IDS
            if ahead < feature_end and 0 <= values[ahead] < rows[t]:  # ids of one feature are contiguous
                prefetch_row(weights, weights16, precision, base + values[ahead] * dim, dim)
            idx = values[p]
            bag_of_id[p] = bag
            if idx < 0 or idx >= rows[t]:
                bad += 1
                continue
            row = base + idx * dim
            w = id_weights[p] if weighted else np.float32(1.0)
            if precision == FP32:
                row_weights = weights[row : row + dim]
                for d in range(dim):
                    pooled[d] += w * row_weights[d]
            else:
                row_bits = weights16[row : row + dim]
                for d in range(dim):
                    pooled[d] += w * decode(row_bits[d], precision)
        if mean_pooling[t] and end > start:
            count = np.float32(end - start)
            for d in range(dim):
                pooled[d] /= count
    return bad
