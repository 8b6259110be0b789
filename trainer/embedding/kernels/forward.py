"""Pooled forward over all tables of a fused module in one parallel kernel.

Weights of all tables live in one flat array (float32, or fp16/bf16 bit patterns);
table ``t`` occupies ``weights[table_offsets[t] : table_offsets[t] + rows[t] * dims[t]]``
row-major. Pooling is in float32 whatever the storage. :func:`pooled_forward` pools any
batch; :func:`pooled_sum_lanes` (float32 rows) and :func:`pooled_half_sum_lanes` (fp16 or
bf16) the common case of unweighted sums and widths that are multiples of 16, faster (see
:func:`sums_in_registers`).
"""

from __future__ import annotations

import numba
import numpy as np

from neorec.common.borrowed_view import borrowed_view
from neorec.trainer.embedding.kernels.precision import BF16, BLOCK, FP32, decode, decode_lanes
from neorec.trainer.embedding.kernels.registers import STREAM_ALIGNMENT, fence_streaming, stack_floats, store_streaming
from neorec.trainer.embedding.kernels.row_prefetch import prefetch_row

PREFETCH_IDS = 32
"""How many ids ahead the forward prefetches rows."""
MAX_BAGS_PER_JOB = 256
"""A parallel job pools a run of at most this many consecutive bags of one feature."""
JOBS_PER_THREAD = 8
"""Jobs are made small enough that each thread gets about this many (load balance)."""
LANES = 64
"""The most row columns :func:`pooled_sum_lanes` sums at once, in registers (four 16-float
vectors)."""
MIN_LANES = 16
"""The fewest it sums at once (one vector): it pools tables whose widths are multiples of this."""


def bags_per_job(num_bags: int, threads: int) -> int:
    """Bags a job of :func:`pooled_forward` pools: at most :data:`MAX_BAGS_PER_JOB`, fewer when
    ``num_bags`` would otherwise give a thread fewer than :data:`JOBS_PER_THREAD` jobs."""
    return max(1, min(MAX_BAGS_PER_JOB, num_bags // max(1, threads * JOBS_PER_THREAD)))


@numba.njit(inline="always")
def _job(job, jobs_per_feature, bags_per_job, batch_size, table_offsets, dims, rows, feature_table, feature_source,
         out_columns, bag_offsets):
    """What parallel job ``job`` of a forward kernel pools: bags ``[first_bag, last_bag)``
    of one module feature. Returns ``(table, dim, base, table_rows, column, first_bag,
    last_bag, source, feature_end)``: the feature's table, its width, where its weights
    begin and its rows; the feature's first output column; the bags; where the feature's
    bags begin in the batch's bags and where its ids end in the batch's ids (a feature's ids
    are contiguous). Inlined: as a called function its values come back through memory and
    the kernels lose their speed."""
    f = job // jobs_per_feature
    first_bag = (job - f * jobs_per_feature) * bags_per_job
    source = feature_source[f] * batch_size
    t = feature_table[f]
    return (t, dims[t], table_offsets[t], rows[t], out_columns[f], first_bag,
            min(first_bag + bags_per_job, batch_size), source, bag_offsets[source + batch_size])


def sums_in_registers(dims: np.ndarray, scaled: bool) -> bool:
    """Whether :func:`pooled_sum_lanes` (or, for half-precision rows,
    :func:`pooled_half_sum_lanes`) can pool a batch: every table's width (``dims``,
    int64 ``[T]``) a multiple of :data:`MIN_LANES`, and no id's row scaled (``scaled``: the
    batch has id weights or a table mean-pools)."""
    return not scaled and bool(np.all(dims % MIN_LANES == 0))


def streams_output(out: np.ndarray) -> bool:
    """Whether :func:`pooled_sum_lanes` can store ``out`` (its float32 output) with
    non-temporal stores: its first element is on a :data:`STREAM_ALIGNMENT` boundary (a
    bag's columns then are too, its widths being multiples of :data:`MIN_LANES`)."""
    return out.ctypes.data % STREAM_ALIGNMENT == 0


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
        t, dim, base, table_rows, column, first_bag, last_bag, source, feature_end = _job(
            job, jobs_per_feature, bags_per_job, batch_size, table_offsets, dims, rows, feature_table, feature_source,
            out_columns, bag_offsets)
        decoded = stack_floats(BLOCK)  # a half-precision row's columns, in float32
        for b in range(first_bag, last_bag):
            o = b * width + column
            pooled = borrowed_view(out, o, dim)  # indexed by the loop counter: vectorizes
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
                    row_weights = borrowed_view(weights, row, dim)
                    for d in range(dim):
                        pooled[d] += w * row_weights[d]
                else:  # BLOCK columns at a time decoded in vector lanes, the rest one by one
                    whole = dim - dim % BLOCK
                    for c in range(0, whole, BLOCK):
                        decode_lanes(weights16, row + c, precision == BF16, decoded, 0)
                        for d in range(BLOCK):
                            pooled[c + d] += w * decoded[d]
                    for d in range(whole, dim):
                        pooled[d] += w * decode(weights16[row + d], precision)
            if mean_pooling[t] and end > start:
                for d in range(dim):
                    pooled[d] /= count
    return bad


@numba.njit(parallel=True, cache=True, nogil=True)
def pooled_sum_lanes(
    weights: np.ndarray,         # float32 [sum(rows * dims)]
    table_offsets: np.ndarray,   # int64 [T]
    dims: np.ndarray,            # int64 [T], each a multiple of MIN_LANES (unchecked: rows are read as views)
    rows: np.ndarray,            # int64 [T]
    feature_table: np.ndarray,   # int64 [F]
    feature_source: np.ndarray,  # int64 [F]
    out_columns: np.ndarray,     # int64 [F]
    bag_offsets: np.ndarray,     # int64 [F_batch * B + 1]
    values: np.ndarray,          # int64 [N]
    batch_size: int,
    bags_per_job: int,
    out: np.ndarray,             # float32 [B * sum(dims of features)], written
    upstream_of_id: np.ndarray,  # int64 [N], written (as in pooled_forward)
    stream: bool,                # store ``out`` around the caches (see streams_output)
) -> int:
    """:func:`pooled_forward` for float32 rows, unweighted sum pooling and widths that are
    multiples of :data:`MIN_LANES` (see :func:`sums_in_registers`), with the same result
    bit for bit: each bag's columns are summed in registers, :data:`LANES` at a time
    (:data:`MIN_LANES` for a table whose width is not a multiple of :data:`LANES`: at
    width 32, two passes of 16 ran faster than one of 32), and stored once, where the
    general kernel adds every row into the output in memory (the id weights and means that
    the general kernel also handles keep LLVM from doing the same there). With ``stream``
    the sums go to memory by non-temporal stores: the output is written once and read by
    the next layer, and a plain store would first read every line it overwrites (a batch's
    output is tens of MB) and evict table rows for it. Returns the number of out-of-range
    ids."""
    return _sum_lanes(weights, _NO_BITS, FP32, table_offsets, dims, rows, feature_table, feature_source, out_columns,
                      bag_offsets, values, batch_size, bags_per_job, out, upstream_of_id, stream)


@numba.njit(parallel=True, cache=True, nogil=True)
def pooled_half_sum_lanes(
    weights16: np.ndarray,       # uint16 fp16/bf16 bit patterns [sum(rows * dims)]
    precision: int,              # precision.FP16 or BF16
    table_offsets: np.ndarray,   # int64 [T]; the rest as in pooled_sum_lanes
    dims: np.ndarray,
    rows: np.ndarray,
    feature_table: np.ndarray,
    feature_source: np.ndarray,
    out_columns: np.ndarray,
    bag_offsets: np.ndarray,
    values: np.ndarray,
    batch_size: int,
    bags_per_job: int,
    out: np.ndarray,
    upstream_of_id: np.ndarray,
    stream: bool,
) -> int:
    """:func:`pooled_sum_lanes` for half-precision rows, decoded in vector lanes
    (:func:`neorec.trainer.embedding.kernels.precision.decode_lanes`) into registers. A
    kernel of its own: with both storages' loops in one, the float32 forward ran ~4%
    slower."""
    return _sum_lanes(_NO_FLOATS, weights16, precision, table_offsets, dims, rows, feature_table, feature_source,
                      out_columns, bag_offsets, values, batch_size, bags_per_job, out, upstream_of_id, stream)


_NO_BITS = np.zeros(0, dtype=np.uint16)
_NO_FLOATS = np.zeros(0, dtype=np.float32)
"""The storage a register kernel does not read."""


@numba.njit(inline="always")
def _sum_lanes(weights, weights16, precision, table_offsets, dims, rows, feature_table, feature_source, out_columns,
               bag_offsets, values, batch_size, bags_per_job, out, upstream_of_id, stream):
    """The register kernels' parallel loop: float32 ``weights`` if ``precision`` is FP32 (the
    constant, at the float32 kernel's call), else the bit patterns of ``weights16``."""
    width = out.shape[0] // max(batch_size, 1)
    jobs_per_feature = -(-batch_size // bags_per_job)
    # the count per job: Numba cannot analyse a reduction through the inlined loops below
    bad = np.zeros(feature_table.shape[0] * jobs_per_feature, dtype=np.int64)
    for job in numba.prange(bad.shape[0]):
        t, dim, base, table_rows, column, first_bag, last_bag, source, feature_end = _job(
            job, jobs_per_feature, bags_per_job, batch_size, table_offsets, dims, rows, feature_table, feature_source,
            out_columns, bag_offsets)
        sums = stack_floats(LANES)
        decoded = stack_floats(LANES)  # a half-precision row's columns, in float32
        # one copy of the loops per lane count, each a constant (registers)
        if dim % LANES == 0:
            job_bad = _pool_bags(weights, weights16, values, out, upstream_of_id, bag_offsets, sums, LANES, dim,
                                 base, table_rows, width, column, first_bag, last_bag, source, feature_end,
                                 stream, precision, decoded)
        else:
            job_bad = _pool_bags(weights, weights16, values, out, upstream_of_id, bag_offsets, sums, MIN_LANES, dim,
                                 base, table_rows, width, column, first_bag, last_bag, source, feature_end,
                                 stream, precision, decoded)
        bad[job] = job_bad
        if stream:
            fence_streaming()
    return bad.sum()


@numba.njit(inline="always")
def _pool_bags(weights, weights16, values, out, upstream_of_id, bag_offsets, sums, lanes, dim, base, table_rows,
               width, column, first_bag, last_bag, source, feature_end, stream, precision, decoded):
    """:func:`pooled_sum_lanes`' bags ``[first_bag, last_bag)`` of one feature, ``lanes``
    columns at a time (a constant at each call, so that ``sums``, a stack array, lives in
    registers); returns the count of out-of-range ids. The rows are float32 ``weights`` if
    ``precision`` is FP32 (then the constant, so that the other branches fold away), else
    the half-precision bit patterns of ``weights16``, decoded into ``decoded`` (a stack
    array) ``lanes`` columns at a time."""
    missing = 0
    for b in range(first_bag, last_bag):
        o = b * width + column
        start = bag_offsets[source + b]
        end = bag_offsets[source + b + 1]
        for c in range(0, dim, lanes):
            for d in range(lanes):
                sums[d] = 0.0
            for p in range(start, end):
                ahead = p + PREFETCH_IDS
                if ahead < feature_end:
                    row_ahead = values[ahead]
                    if 0 <= row_ahead < table_rows:
                        prefetch_row(weights, weights16, precision, base + row_ahead * dim + c, lanes)
                upstream_of_id[p] = o
                idx = values[p]
                if idx < 0 or idx >= table_rows:
                    if c == 0:
                        missing += 1
                    continue
                if precision == FP32:
                    row = borrowed_view(weights, base + idx * dim + c, lanes)  # idx checked: in its table
                    for d in range(lanes):
                        sums[d] += row[d]
                else:
                    for d in range(0, lanes, BLOCK):  # lanes is a multiple of BLOCK
                        decode_lanes(weights16, base + idx * dim + c + d, precision == BF16, decoded, d)
                    for d in range(lanes):
                        sums[d] += decoded[d]
            if stream:
                for d in range(0, lanes, 16):
                    store_streaming(out, o + c + d, borrowed_view(sums, d, 16), 16)
            else:
                pooled = borrowed_view(out, o + c, lanes)
                for d in range(lanes):
                    pooled[d] = sums[d]
    return missing
