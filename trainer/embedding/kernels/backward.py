"""Backward fused with the sparse optimizer: no dense weight gradient is ever formed.

Two phases:

1. :func:`group_by_row` sorts, table by table, the batch's ids by row (stable, so a row's
   contributions stay in (feature, sample, position) order) and lays out, in that order,
   where each id's upstream gradient row is and its scale, and the runs of ids of one row.
2. :func:`apply_updates` gives every run to one thread, which sums the row's gradient
   contributions in that fixed order and applies the optimizer to the row. A row's only
   id, unscaled, gives its upstream row as the gradient, uncopied (the sum of it alone,
   but for a zero's sign: ``0.0 + -0.0`` is ``0.0``, which the update cannot tell apart
   except on a weight of exactly ``-0.0``).

So the result is bit-identical whatever the number of threads. Half-precision rows are
updated in float32 and rounded back once per step. Both phases read their inputs in order
except the rows and the upstream gradient rows, which they prefetch ahead.
"""

from __future__ import annotations

import numba
import numpy as np

from neorec.trainer.embedding.kernels.precision import FP32, decode_row, encode_row
from neorec.common.borrowed_view import borrowed_view
from neorec.common.cache_prefetch import prefetch, prefetch_for_write
from neorec.trainer.embedding.kernels.row_prefetch import prefetch_row

SGD = 0
ADAGRAD = 1
ROWWISE_ADAGRAD = 2
ADAM = 3

PREFETCH_ROWS = 16
"""How many runs ahead the update prefetches the row (weights, state, touched flag)."""
PREFETCH_IDS = 24
"""How many ids ahead the update prefetches their upstream gradient rows."""


RADIX_BITS = 11
"""Digit width of the radix sort that groups a table's ids by row (2048 buckets: two
passes for tables of up to 4M rows)."""
RADIX_MIN_IDS = 256
"""Tables with fewer ids in the batch are grouped by a comparison sort instead."""


def group_by_row(
    values: np.ndarray,          # int64 [N]: the batch's ids, key-major
    upstream_of_id: np.ndarray,  # int64 [N] (from the forward)
    scale_of_id: np.ndarray,     # float32 [N] or [0] (from the forward)
    bag_offsets: np.ndarray,     # int64 [K * B + 1]: bag i is values[bag_offsets[i]:bag_offsets[i + 1]]
    batch_size: int,             # B
    feature_source: np.ndarray,  # int64 [F]: the batch key of each module feature
    table_features: np.ndarray,  # int64 [T + 1]: table t's features are [table_features[t], table_features[t + 1])
    output_width: int,           # C: the forward's output is [B, C], row-major
    grad_row_stride: int,        # S >= C: the upstream gradient's rows begin S floats apart
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ids of the module's features in row order, table by table (a table's ids in its
    features' order first, each feature's ids in batch order): returns

    - ``id_upstream`` int64 [M] and ``id_scale`` float32 [M] (or [0] if ``scale_of_id`` is):
      each id's upstream gradient offset (in a gradient of row stride S: a sample's row of
      the output, ``b * C + column`` in the forward, is at ``b * S + column``) and scale,
      in that order;
    - ``run_ends`` and ``run_rows`` int64 [M]: the runs of ids of one row, each table's at
      its ids' place: table t's run k (of ``table_runs[t + 1] - table_runs[t]``) is row
      ``run_rows[table_starts[t] + k]``, and its ids end at ``run_ends[table_starts[t] + k]``
      and start where run k - 1's ends (at ``table_starts[t]`` for k = 0); the entries past
      a table's last run are not written;
    - ``table_starts`` int64 [T + 1]: table t's ids are ``[table_starts[t], table_starts[t + 1])``;
    - ``table_runs`` int64 [T + 1]: numbering the runs of all tables in order, table t's
      are ``[table_runs[t], table_runs[t + 1])`` (see :func:`_run_place`).

    Each table's runs are written where its ids are, as its sorted ids are laid out, so
    that no second pass over the batch's ids places them (the update maps a run's number to
    its place, :func:`_run_place`). The arrays are allocated here, not in the kernel: a
    kernel that returns arrays calls back into Python to build them, and a Ctrl-C landing
    in that call surfaces as a ``SystemError`` instead of ``KeyboardInterrupt``.
    """
    feature_ids = bag_offsets[(feature_source + 1) * batch_size] - bag_offsets[feature_source * batch_size]
    table_starts = np.concatenate(([0], np.cumsum(feature_ids)))[table_features]
    num_ids = int(table_starts[-1])
    id_upstream = np.empty(num_ids, dtype=np.int64)
    id_scale = np.empty(num_ids if scale_of_id.shape[0] > 0 else 0, dtype=np.float32)
    run_ends = np.empty(num_ids, dtype=np.int64)
    run_rows = np.empty(num_ids, dtype=np.int64)
    table_runs = np.zeros(table_starts.shape[0], dtype=np.int64)
    _group_by_row(values, upstream_of_id, scale_of_id, bag_offsets, batch_size, feature_source, table_features,
                  output_width, grad_row_stride, table_starts, id_upstream, id_scale, run_ends, run_rows, table_runs)
    return id_upstream, id_scale, run_ends, run_rows, table_starts, table_runs


@numba.njit(parallel=True, cache=True, nogil=True)
def _group_by_row(values, upstream_of_id, scale_of_id, bag_offsets, batch_size, feature_source, table_features,
                  output_width, grad_row_stride, table_starts, id_upstream, id_scale, run_ends, run_rows,
                  table_runs) -> None:
    """:func:`group_by_row` into its arrays (``table_runs`` zeros)."""
    num_tables = table_starts.shape[0] - 1
    scaled = scale_of_id.shape[0] > 0
    row_gap = grad_row_stride - output_width
    for t in numba.prange(num_tables):
        lo = table_starts[t]
        hi = table_starts[t + 1]
        if hi == lo:
            continue
        # one sort of (row, index among this table's ids) packed in an int64: rows are
        # < 2**31 and a batch has < 2**32 ids, so the order is by row, then batch order
        # (the table's upstream offsets and scales are gathered in batch order first, so
        # that laying them out in row order reads a table-sized array, not the batch's)
        keys = np.empty(hi - lo, dtype=np.int64)
        table_upstream = np.empty(hi - lo, dtype=np.int64)
        table_scale = np.empty(hi - lo if scaled else 0, dtype=np.float32)
        largest_row = 0
        i = 0
        for f in range(table_features[t], table_features[t + 1]):
            source = feature_source[f]
            first = bag_offsets[source * batch_size]
            n = bag_offsets[(source + 1) * batch_size] - first
            # views indexed from 0, so that LLVM sees contiguous runs (common/borrowed_view)
            rows = borrowed_view(values, first, n)
            upstream = borrowed_view(upstream_of_id, first, n)
            scales = borrowed_view(scale_of_id, first, n if scaled else 0)
            feature_keys = borrowed_view(keys, i, n)
            feature_upstream = borrowed_view(table_upstream, i, n)
            feature_scales = borrowed_view(table_scale, i, n if scaled else 0)
            for q in range(n):
                row = rows[q]
                feature_keys[q] = (row << 32) | (i + q)
                largest_row = max(largest_row, row)
                feature_upstream[q] = upstream[q]
                if scaled:
                    feature_scales[q] = scales[q]
            if row_gap:  # the gradient's rows are further apart than the output's
                for q in range(n):
                    feature_upstream[q] += feature_upstream[q] // output_width * row_gap
            i += n
        if hi - lo < RADIX_MIN_IDS:
            keys.sort()
        else:
            keys = _radix_sort_rows(keys, largest_row)
        table_id_upstream = borrowed_view(id_upstream, lo, hi - lo)
        table_id_scale = borrowed_view(id_scale, lo, hi - lo if scaled else 0)
        table_run_ends = borrowed_view(run_ends, lo, hi - lo)
        table_run_rows = borrowed_view(run_rows, lo, hi - lo)
        # without a branch: every id writes its run's row and, as the run's end so far,
        # its own end; a run's last id writes last
        runs = 0
        previous = -1
        for i in range(hi - lo):
            row = keys[i] >> 32
            j = keys[i] & 0xFFFFFFFF
            table_id_upstream[i] = table_upstream[j]
            if scaled:
                table_id_scale[i] = table_scale[j]
            runs += row != previous
            previous = row
            table_run_rows[runs - 1] = row
            table_run_ends[runs - 1] = lo + i + 1
        table_runs[t + 1] = runs
    for t in range(num_tables):
        table_runs[t + 1] += table_runs[t]


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
    touched_offsets: np.ndarray,  # int64 [T]: each table's first bit in `touched` (a multiple of 8)
    dims: np.ndarray,           # int64 [T]
    id_upstream: np.ndarray,    # int64 [M]: upstream gradient offset of each id, in row order
    id_scale: np.ndarray,       # float32 [M] or [0] (all ones): each id's scale, same order
    run_ends: np.ndarray,       # int64 [M]: where each run's ids end  } each table's runs at its ids' place
    run_rows: np.ndarray,       # int64 [M]: each run's row            } (see group_by_row)
    table_starts: np.ndarray,   # int64 [T + 1]: table t's ids are [table_starts[t], table_starts[t + 1])
    table_runs: np.ndarray,     # int64 [T + 1]: table t's runs are runs [table_runs[t], table_runs[t + 1])
    grad_out: np.ndarray,       # float32 [(B - 1) * S + C] ([0] if B = 0): the upstream gradient [B, C],
                                # row stride S
    optimizer: int,
    learning_rates: np.ndarray,  # float32 [T]
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    adagrad_decay: float,       # (0, 1]: the Adagrad sums of squares are multiplied by it before each update
    step: int,                  # 1-based optimizer step (Adam bias correction)
    touched: np.ndarray,        # uint8 bitmap (neorec.trainer.embedding.touched): every updated row's bit is set
    max_chunks: int,            # work is split into at most this many chunks (a few per thread)
) -> None:
    """One optimizer step on the row of every run (the layout of :func:`group_by_row`).

    The runs are cut into chunks where two neighbouring runs' rows have their touched bits
    in different bytes, so that no two threads write one byte."""
    scaled = id_scale.shape[0] > 0
    decays = weight_decay != 0.0  # then _update_row adds to the gradient: it must be a copy
    max_dim = 0
    for t in range(dims.shape[0]):
        max_dim = max(max_dim, dims[t])
    adam_step_size = np.float32(np.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step))
    num_runs = table_runs[-1]
    chunks = min(num_runs, max_chunks)
    for c in numba.prange(chunks):
        grad = np.empty(max_dim, dtype=np.float32)
        row_copy = np.empty(max_dim, dtype=np.float32)  # a half-precision row, in float32
        first = _chunk_start(c, chunks, num_runs, table_starts, table_runs, run_rows, touched_offsets)
        last = _chunk_start(c + 1, chunks, num_runs, table_starts, table_runs, run_rows, touched_offsets)
        if first == last:
            continue
        t = _table_of(first, table_runs)  # the table of run r, and of the run whose row is prefetched
        t_ahead = t
        # the chunk's ids, [next_id, ids_end): its runs' ids follow one another, across tables too
        next_id = _run_start(first, t, table_starts, table_runs, run_ends)
        ids_end = run_ends[_run_place(last - 1, _table_of(last - 1, table_runs), table_starts, table_runs)]
        for k in range(next_id, min(next_id + PREFETCH_IDS, ids_end)):
            _prefetch_upstream(grad_out, id_upstream[k], dims[t])
        for r in range(first, last):
            ahead = r + PREFETCH_ROWS
            if ahead < last:
                while ahead >= table_runs[t_ahead + 1]:
                    t_ahead += 1
                _prefetch_row_and_state(weights, weights16, precision, state1, touched, table_offsets, state_offsets,
                                        state_width, touched_offsets, dims, t_ahead,
                                        run_rows[_run_place(ahead, t_ahead, table_starts, table_runs)])
            while r >= table_runs[t + 1]:
                t += 1
            place = _run_place(r, t, table_starts, table_runs)
            first_id, next_id = next_id, run_ends[place]
            dim = dims[t]
            row = run_rows[place]
            if next_id - first_id == 1 and not scaled and not decays:
                # the row's one id, unscaled: its upstream row is the gradient (read, not copied)
                k = first_id
                if k + PREFETCH_IDS < ids_end:
                    _prefetch_upstream(grad_out, id_upstream[k + PREFETCH_IDS], dim)
                row_grad = borrowed_view(grad_out, id_upstream[k], dim)
            else:
                row_grad = borrowed_view(grad, 0, dim)
                for d in range(dim):
                    row_grad[d] = 0.0
                for k in range(first_id, next_id):
                    if k + PREFETCH_IDS < ids_end:  # a later id's row, whatever its run
                        _prefetch_upstream(grad_out, id_upstream[k + PREFETCH_IDS], dim)
                    o = id_upstream[k]
                    upstream = borrowed_view(grad_out, o, dim)
                    if scaled:
                        scale = id_scale[k]
                        for d in range(dim):
                            row_grad[d] += scale * upstream[d]
                    else:
                        for d in range(dim):
                            row_grad[d] += upstream[d]
            bit = touched_offsets[t] + row
            touched[bit >> 3] |= np.uint8(1 << (bit & 7))
            w0 = table_offsets[t] + row * dim
            s0 = state_offsets[t] + row * state_width[t]
            s1 = borrowed_view(state1, s0, state_width[t])
            s2 = borrowed_view(state2, s0, state_width[t] if optimizer == ADAM else 0)
            if precision == FP32:
                _update_row(borrowed_view(weights, w0, dim), s1, s2, row_grad, dim, optimizer, learning_rates[t],
                            np.float32(eps), beta1, beta2, np.float32(weight_decay), np.float32(adagrad_decay),
                            adam_step_size)
                continue
            bits = borrowed_view(weights16, w0, dim)
            decode_row(bits, row_copy, dim, precision)
            _update_row(row_copy, s1, s2, row_grad, dim, optimizer, learning_rates[t],
                        np.float32(eps), beta1, beta2, np.float32(weight_decay), np.float32(adagrad_decay),
                        adam_step_size)
            held = row if slot_base[t] < 0 else slot_rows[slot_base[t] + row]
            element = ((noise_origin[t, 0] << 40) + (noise_origin[t, 1] + held) * noise_origin[t, 3]
                       + noise_origin[t, 2])
            encode_row(row_copy, bits, dim, precision, stochastic_seed, step, element)


@numba.njit(inline="always")
def _prefetch_row_and_state(weights, weights16, precision, state1, touched, table_offsets, state_offsets,
                            state_width, touched_offsets, dims, t, row):
    """Prefetch what the update of ``row`` of table ``t`` modifies: its weights (into L2,
    see :func:`prefetch_row`) and, for writing, its state and its touched bit's byte."""
    prefetch_row(weights, weights16, precision, table_offsets[t] + row * dims[t], dims[t])
    if state1.shape[0] > 0:
        prefetch_for_write(state1, state_offsets[t] + row * state_width[t])
    prefetch_for_write(touched, (touched_offsets[t] + row) >> 3)


@numba.njit(inline="always")
def _chunk_start(c, chunks, num_runs, table_starts, table_runs, run_rows, touched_offsets):
    """The first run of chunk ``c`` of ``chunks``: run ``c * num_runs // chunks``, or the
    first after it whose touched bit is in another byte than its predecessor's (at most 7
    runs on); ``num_runs`` for ``c == chunks``."""
    r = c * num_runs // chunks
    while 0 < r < num_runs and (_touched_byte(r, table_starts, table_runs, run_rows, touched_offsets)
                                == _touched_byte(r - 1, table_starts, table_runs, run_rows, touched_offsets)):
        r += 1
    return r


@numba.njit(inline="always")
def _touched_byte(r, table_starts, table_runs, run_rows, touched_offsets):
    """The byte of ``touched`` that holds run ``r``'s row's bit."""
    t = _table_of(r, table_runs)
    return (touched_offsets[t] + run_rows[_run_place(r, t, table_starts, table_runs)]) >> 3


@numba.njit(inline="always")
def _table_of(r, table_runs):
    """The table of run ``r`` (``table_runs`` as :func:`group_by_row` returns it)."""
    return np.searchsorted(table_runs, r, side="right") - 1


@numba.njit(inline="always")
def _run_start(r, t, table_starts, table_runs, run_ends):
    """Where the ids of run ``r``, of table ``t``, start: at the table's first id, or where
    the run before it ends."""
    if r == table_runs[t]:
        return table_starts[t]
    return run_ends[_run_place(r - 1, t, table_starts, table_runs)]


@numba.njit(inline="always")
def _run_place(r, t, table_starts, table_runs):
    """Where run ``r``, of table ``t``, lies in ``run_ends`` and ``run_rows``."""
    return table_starts[t] + r - table_runs[t]


@numba.njit(inline="always")
def _prefetch_upstream(grad_out, offset, dim):
    """Prefetch the upstream gradient row of ``dim`` floats at ``offset``."""
    for d in range(0, dim, 16):
        prefetch(grad_out, offset + d)


@numba.njit(inline="always")
def _update_row(weights, state1, state2, grad, dim, optimizer, lr, eps, beta1, beta2, weight_decay,
                adagrad_decay, adam_step_size):
    """Apply ``optimizer`` to one row (``weights[:dim]``, its state ``state1``/``state2``:
    views of the row) given its summed gradient ``grad[:dim]``, which it only reads unless
    ``weight_decay`` is not 0 (so a row of one id passes its upstream row itself). The
    Adagrad sums are multiplied by ``adagrad_decay`` first unless it is 1 (plain Adagrad,
    untouched)."""
    if weight_decay != 0.0:
        for d in range(dim):
            grad[d] += weight_decay * weights[d]
    if optimizer == SGD:
        for d in range(dim):
            weights[d] -= lr * grad[d]
    elif optimizer == ADAGRAD:
        for d in range(dim):
            if adagrad_decay != 1.0:
                state1[d] *= adagrad_decay
            state1[d] += grad[d] * grad[d]
            weights[d] -= lr * grad[d] / (np.sqrt(state1[d]) + eps)
    elif optimizer == ROWWISE_ADAGRAD:
        if adagrad_decay != 1.0:
            state1[0] *= adagrad_decay
        state1[0] += _square_sum(grad, dim) / np.float32(dim)
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


@numba.njit(inline="always")
def _square_or_zero(x, i, n):
    """``x[i] ** 2``, or 0 where ``i`` is past ``n``."""
    return x[i] * x[i] if i < n else np.float32(0.0)


@numba.njit(inline="always")
def _square_sum(x, n):
    """sum of ``x[:n]**2`` in 8 interleaved partial sums, element ``d`` in sum ``d % 8``
    (the tail of a width not a multiple of 8 too), added pairwise: a fixed order (the same
    result whatever the thread count) without one chain of n dependent adds. It is the
    order of FBGEMM's 8-lane CPU kernel, whose row-wise Adagrad weights ours equal bit for
    bit at any width."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    d = 0
    while d + 8 <= n:
        s0 += x[d] * x[d]
        s1 += x[d + 1] * x[d + 1]
        s2 += x[d + 2] * x[d + 2]
        s3 += x[d + 3] * x[d + 3]
        s4 += x[d + 4] * x[d + 4]
        s5 += x[d + 5] * x[d + 5]
        s6 += x[d + 6] * x[d + 6]
        s7 += x[d + 7] * x[d + 7]
        d += 8
    if d < n:  # the tail: lane k takes element d + k if there is one (+0.0 leaves a lane as it is)
        s0 += _square_or_zero(x, d, n)
        s1 += _square_or_zero(x, d + 1, n)
        s2 += _square_or_zero(x, d + 2, n)
        s3 += _square_or_zero(x, d + 3, n)
        s4 += _square_or_zero(x, d + 4, n)
        s5 += _square_or_zero(x, d + 5, n)
        s6 += _square_or_zero(x, d + 6, n)
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
