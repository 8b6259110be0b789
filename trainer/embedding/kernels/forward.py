"""Pooled forward over all tables of a fused module in one parallel kernel.

Weights of all tables live in one flat array (float32, or fp16/bf16 bit patterns);
table ``t`` occupies ``weights[table_offsets[t] : table_offsets[t] + rows[t] * dims[t]]``
row-major. Pooling is in float32 whatever the storage.
"""

from __future__ import annotations

import numba
import numpy as np

from neorec.trainer.embedding.kernels.precision import FP32, decode
from neorec.trainer.embedding.kernels.row_prefetch import prefetch_row

PREFETCH_IDS = 32
"""How many ids ahead the forward prefetches rows."""
MAX_BAGS_PER_JOB = 256
"""A parallel job pools a run of at most this many consecutive bags of one feature."""
JOBS_PER_THREAD = 8
"""Jobs are made small enough that each thread gets about this many (load balance)."""


def bags_per_job(num_bags: int, threads: int) -> int:
    """Bags a job of :func:`pooled_forward` pools: at most :data:`MAX_BAGS_PER_JOB`, fewer when
    ``num_bags`` would otherwise give a thread fewer than :data:`JOBS_PER_THREAD` jobs."""
    return max(1, min(MAX_BAGS_PER_JOB, num_bags // max(1, threads * JOBS_PER_THREAD)))


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
    bags_per_job: int,           # consecutive bags of one feature pooled by one parallel job
    out: np.ndarray,             # float32 [B * sum(dims of features)] (row-major [B, C]), written
    upstream_of_id: np.ndarray,  # int64 [N], written: where in ``out`` each id's bag starts (the
                                 # id's upstream gradient row in the backward); ids of features
                                 # outside the module untouched
    scale_of_id: np.ndarray,     # float32 [N] or [0], written when not empty: the factor of each
                                 # id's row in its bag (its weight, over the bag's size if mean)
) -> int:
    """Sum (or mean) of each bag's rows; returns the number of out-of-range ids (0 if valid).

    Each bag is summed by one thread in id order, so the result does not depend on the
    thread count. A job walks a feature's bags in order, so its ids are read in order and
    prefetched ahead across bag boundaries.
    """
    width = out.shape[0] // max(batch_size, 1)
    weighted = id_weights.shape[0] > 0
    scaled = scale_of_id.shape[0] > 0
    jobs_per_feature = -(-batch_size // bags_per_job)
    bad = 0  # a reduction over the threads: the count of out-of-range ids
    for job in numba.prange(feature_table.shape[0] * jobs_per_feature):
        f = job // jobs_per_feature
        first_bag = (job - f * jobs_per_feature) * bags_per_job
        t = feature_table[f]
        dim = dims[t]
        base = table_offsets[t]
        table_rows = rows[t]
        source = feature_source[f] * batch_size
        feature_end = bag_offsets[source + batch_size]  # ids of one feature are contiguous
        for b in range(first_bag, min(first_bag + bags_per_job, batch_size)):
            o = b * width + out_columns[f]
            pooled = out[o : o + dim]  # slices indexed by the loop counter vectorize
            start = bag_offsets[source + b]
            end = bag_offsets[source + b + 1]
            count = np.float32(end - start) if mean_pooling[t] else np.float32(1.0)
            for d in range(dim):
                pooled[d] = 0.0
            for p in range(start, end):
                ahead = p + PREFETCH_IDS
                if ahead < feature_end and 0 <= values[ahead] < table_rows:
                    prefetch_row(weights, weights16, precision, base + values[ahead] * dim, dim)
                upstream_of_id[p] = o
                w = id_weights[p] if weighted else np.float32(1.0)
                if scaled:
                    scale_of_id[p] = w / count
                idx = values[p]
                if idx < 0 or idx >= table_rows:
                    bad += 1
                    continue
                row = base + idx * dim
                if precision == FP32:
                    row_weights = weights[row : row + dim]
                    for d in range(dim):
                        pooled[d] += w * row_weights[d]
                else:
                    row_bits = weights16[row : row + dim]
                    for d in range(dim):
                        pooled[d] += w * decode(row_bits[d], precision)
            if mean_pooling[t] and end > start:
                for d in range(dim):
                    pooled[d] /= count
    return bad
