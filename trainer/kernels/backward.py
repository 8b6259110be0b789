"""Backward fused with the sparse optimizer: no dense weight gradient is ever formed.

Two phases:

1. :func:`group_by_row` sorts, table by table, the positions of the batch's ids by row
   (stable, so a row's contributions stay in (feature, sample, position) order) and marks
   where each row's run starts.
2. :func:`apply_updates` gives every distinct row to one thread, which sums the row's
   gradient contributions in that fixed order and applies the optimizer to the row.

So the result is bit-identical whatever the number of threads. Half-precision rows are
updated in float32 and rounded back once per step.
"""

from __future__ import annotations

import numba
import numpy as np

from trainer.kernels.precision import FP32, decode, encode_row
from ingest.prefetch import prefetch
from trainer.kernels.prefetch import prefetch_row

SGD = 0
ADAGRAD = 1
ROWWISE_ADAGRAD = 2
ADAM = 3

PREFETCH_ROWS = 4
"""How many rows ahead the update prefetches."""
PREFETCH_IDS = 8
"""How many ids ahead (in row order) the update prefetches their upstream gradient rows."""
UPSTREAM_CACHED_BYTES = 8 << 20
"""An upstream gradient up to this size is taken to stay in the CPU's caches: its rows are
not prefetched (the prefetch's index arithmetic would cost more than it saves)."""


RADIX_BITS = 11
"""Digit width of the radix sort that groups a table's ids by row (2048 buckets: two
passes for tables of up to 4M rows)."""
RADIX_MIN_IDS = 256
"""Tables with fewer ids in the batch are grouped by a comparison sort instead."""


@numba.njit(parallel=True, cache=True, nogil=True)
def group_by_row(
    values: np.ndarray,        # int64 [N]
    positions: np.ndarray,     # int64 [M]: positions into values, grouped by table
    table_starts: np.ndarray,  # int64 [T + 1]: table t owns positions[table_starts[t]:table_starts[t+1]]
    sorted_positions: np.ndarray,  # int64 [M], written
    run_start: np.ndarray,     # bool [M], written: True where a new row's run begins
) -> None:
    for t in numba.prange(table_starts.shape[0] - 1):
        lo = table_starts[t]
        hi = table_starts[t + 1]
        if hi == lo:
            continue
        # one sort of (row, index in this table's positions) packed in an int64: rows are
        # < 2**31 and a batch has < 2**32 ids, so the order is by row, then position order
        keys = np.empty(hi - lo, dtype=np.int64)
        largest_row = 0
        for i in range(hi - lo):
            row = values[positions[lo + i]]
            keys[i] = (row << 32) | i
            largest_row = max(largest_row, row)
        if hi - lo < RADIX_MIN_IDS:
            keys.sort()
        else:
            keys = _radix_sort_rows(keys, largest_row)
        previous = -1
        for i in range(hi - lo):
            row = keys[i] >> 32
            sorted_positions[lo + i] = positions[lo + (keys[i] & 0xFFFFFFFF)]
            run_start[lo + i] = i == 0 or row != previous
            previous = row


@numba.njit(inline="always")
def _radix_sort_rows(keys: np.ndarray, largest_row: int) -> np.ndarray:
    """``keys`` (int64 ``row << 32 | index``, indices in increasing order) sorted by row,
    stably (least significant digit first): the same order as sorting the packed keys.
    Returns the sorted array (``keys`` or a new one)."""
    spare = np.empty_like(keys)
    count = np.empty(1 << RADIX_BITS, dtype=np.int64)
    shift = 32
    while shift == 32 or (largest_row >> (shift - 32)) > 0:
        count[:] = 0
        for i in range(keys.shape[0]):
            count[(keys[i] >> shift) & ((1 << RADIX_BITS) - 1)] += 1
        total = 0
        for digit in range(1 << RADIX_BITS):
            total, count[digit] = total + count[digit], total
        for i in range(keys.shape[0]):
            digit = (keys[i] >> shift) & ((1 << RADIX_BITS) - 1)
            spare[count[digit]] = keys[i]
            count[digit] += 1
        keys, spare = spare, keys
        shift += RADIX_BITS
    return keys


@numba.njit(parallel=True, cache=True, nogil=True)
def apply_updates(
    weights: np.ndarray,        # float32 [sum(rows * dims)] or [0], updated in place
    weights16: np.ndarray,      # uint16 fp16/bf16 bit patterns [sum(rows * dims)] or [0], updated
    precision: int,             # precision.FP32, FP16 or BF16
    stochastic_seed: int,       # half precision: < 0 rounds to nearest even, else the rounding noise's seed
    noise_origin: np.ndarray,   # int64 [T, 4]: (table id, first row, first column, full width) of each
                                # table in its whole table, so a weight's noise does not depend on sharding
    slot_base: np.ndarray,      # int64 [T]: -1, or where table t's rows start in slot_rows (its rows are
                                # cache slots, and the noise follows the row a slot holds)
    slot_rows: np.ndarray,      # int64 [slots of such tables]: the table row each slot holds
    state1: np.ndarray,         # float32 optimizer state (see SparseOptimizer), updated
    state2: np.ndarray,         # float32 second optimizer state (Adam), same layout as state1
    table_offsets: np.ndarray,  # int64 [T]
    state_offsets: np.ndarray,  # int64 [T]: first state element of each table
    state_width: np.ndarray,    # int64 [T]: state floats per row (dim, 1 or 0)
    row_offsets: np.ndarray,    # int64 [T]: first global row of each table (for `touched`)
    dims: np.ndarray,           # int64 [T]
    feature_table: np.ndarray,  # int64 [F]
    out_columns: np.ndarray,    # int64 [F]
    mean_pooling: np.ndarray,   # bool [T]
    bag_offsets: np.ndarray,    # int64 [F_batch * B + 1]
    feature_source: np.ndarray, # int64 [F]
    values: np.ndarray,         # int64 [N]
    id_weights: np.ndarray,     # float32 [N] or [0]
    bag_of_id: np.ndarray,      # int32 [N] (from the forward)
    sorted_positions: np.ndarray,  # int64 [M]
    runs: np.ndarray,           # int64 [R + 1]: run r is sorted_positions[runs[r]:runs[r+1]]
    run_table: np.ndarray,      # int64 [R]
    grad_out: np.ndarray,       # float32 [B * sum(dims of features)] (row-major [B, C])
    batch_size: int,
    optimizer: int,
    learning_rates: np.ndarray,  # float32 [T]
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    step: int,                  # 1-based optimizer step (Adam bias correction)
    touched: np.ndarray,        # uint8 [total rows], set to 1 for every updated row
    max_chunks: int,            # work is split into at most this many chunks (a few per thread)
) -> None:
    weighted = id_weights.shape[0] > 0
    width = grad_out.shape[0] // max(batch_size, 1)
    max_dim = 0
    for t in range(dims.shape[0]):
        max_dim = max(max_dim, dims[t])
    adam_step_size = np.float32(np.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step))
    num_runs = runs.shape[0] - 1
    chunks = min(num_runs, max_chunks)
    far_upstream = grad_out.shape[0] * 4 > UPSTREAM_CACHED_BYTES
    for c in numba.prange(chunks):
        grad = np.empty(max_dim, dtype=np.float32)
        row_copy = np.empty(max_dim, dtype=np.float32)  # a half-precision row, in float32
        noise_bits = np.empty(max_dim, dtype=np.uint64)  # its stochastic rounding's noise
        last = (c + 1) * num_runs // chunks
        for r in range(c * num_runs // chunks, last):
            if r + PREFETCH_ROWS < last:
                _prefetch_run(r + PREFETCH_ROWS, weights, weights16, precision, state1, touched, table_offsets,
                              state_offsets, state_width, row_offsets, dims, feature_table, out_columns, values,
                              bag_of_id, sorted_positions, runs, run_table, grad_out, batch_size, width)
            t = run_table[r]
            dim = dims[t]
            for d in range(dim):
                grad[d] = 0.0
            row = values[sorted_positions[runs[r]]]
            for k in range(runs[r], runs[r + 1]):
                if far_upstream and k + PREFETCH_IDS < runs[last]:  # later ids' rows, whatever their run
                    _prefetch_upstream(sorted_positions[k + PREFETCH_IDS], dims, feature_table, out_columns,
                                       bag_of_id, grad_out, batch_size, width)
                p = sorted_positions[k]
                bag = bag_of_id[p]
                f = bag // batch_size
                b = bag - f * batch_size
                scale = id_weights[p] if weighted else np.float32(1.0)
                if mean_pooling[t]:
                    source_bag = feature_source[f] * batch_size + b
                    scale = scale / np.float32(bag_offsets[source_bag + 1] - bag_offsets[source_bag])
                o = b * width + out_columns[f]
                upstream = grad_out[o : o + dim]  # slices indexed by the loop counter vectorize
                for d in range(dim):
                    grad[d] += scale * upstream[d]
            touched[row_offsets[t] + row] = 1
            w0 = table_offsets[t] + row * dim
            s0 = state_offsets[t] + row * state_width[t]
            s1 = state1[s0 : s0 + state_width[t]]
            s2 = state2[s0 : s0 + state_width[t]] if optimizer == ADAM else state2
            if precision == FP32:
                _update_row(weights[w0 : w0 + dim], s1, s2, grad, dim, optimizer, learning_rates[t],
                            np.float32(eps), beta1, beta2, np.float32(weight_decay), adam_step_size)
                continue
            bits = weights16[w0 : w0 + dim]
            for d in range(dim):
                row_copy[d] = decode(bits[d], precision)
            _update_row(row_copy, s1, s2, grad, dim, optimizer, learning_rates[t],
                        np.float32(eps), beta1, beta2, np.float32(weight_decay), adam_step_size)
            held = row if slot_base[t] < 0 else slot_rows[slot_base[t] + row]
            element = ((noise_origin[t, 0] << 40) + (noise_origin[t, 1] + held) * noise_origin[t, 3]
                       + noise_origin[t, 2])
            encode_row(row_copy, bits, dim, precision, stochastic_seed, step, element, noise_bits)


@numba.njit(inline="always")
def _prefetch_run(r, weights, weights16, precision, state1, touched, table_offsets, state_offsets, state_width,
                  row_offsets, dims, feature_table, out_columns, values, bag_of_id, sorted_positions, runs, run_table,
                  grad_out, batch_size, width):
    """Prefetch what run ``r`` will touch: its row's weights, state and touched flag, and
    the upstream gradient of its first id."""
    t = run_table[r]
    dim = dims[t]
    p = sorted_positions[runs[r]]
    row = values[p]
    prefetch_row(weights, weights16, precision, table_offsets[t] + row * dim, dim)
    if state1.shape[0] > 0:
        prefetch(state1, state_offsets[t] + row * state_width[t])
    prefetch(touched, row_offsets[t] + row)
    bag = bag_of_id[p]
    f = bag // batch_size
    o = (bag - f * batch_size) * width + out_columns[f]
    for d in range(0, dim, 16):
        prefetch(grad_out, o + d)


@numba.njit(inline="always")
def _prefetch_upstream(p, dims, feature_table, out_columns, bag_of_id, grad_out, batch_size, width):
    """Prefetch the upstream gradient row of the id at position ``p``."""
    bag = bag_of_id[p]
    f = bag // batch_size
    o = (bag - f * batch_size) * width + out_columns[f]
    for d in range(0, dims[feature_table[f]], 16):
        prefetch(grad_out, o + d)


@numba.njit(inline="always")
def _update_row(weights, state1, state2, grad, dim, optimizer, lr, eps, beta1, beta2, weight_decay,
                adam_step_size):
    """Apply ``optimizer`` to one row (``weights[:dim]``, its state ``state1``/``state2``:
    views of the row) given its summed gradient ``grad[:dim]``."""
    if weight_decay != 0.0:
        for d in range(dim):
            grad[d] += weight_decay * weights[d]
    if optimizer == SGD:
        for d in range(dim):
            weights[d] -= lr * grad[d]
    elif optimizer == ADAGRAD:
        for d in range(dim):
            state1[d] += grad[d] * grad[d]
            weights[d] -= lr * grad[d] / (np.sqrt(state1[d]) + eps)
    elif optimizer == ROWWISE_ADAGRAD:
        square_sum = np.float32(0.0)
        for d in range(dim):
            square_sum += grad[d] * grad[d]
        state1[0] += square_sum / np.float32(dim)
        multiplier = lr / (np.sqrt(state1[0]) + eps)
        for d in range(dim):
            weights[d] -= multiplier * grad[d]
    else:  # ADAM; (1 - beta) is formed in float64, as torch does with its Python scalars
        b1, b2 = np.float32(beta1), np.float32(beta2)
        c1, c2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
        for d in range(dim):
            m = b1 * state1[d] + c1 * grad[d]
            v = b2 * state2[d] + c2 * grad[d] * grad[d]
            state1[d] = m
            state2[d] = v
            weights[d] -= lr * adam_step_size * m / (np.sqrt(v) + eps)
