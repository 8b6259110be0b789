"""borrowed_view: the same elements as the slice it stands for, writes that reach the
source, and no reference counting in the kernel that makes it (what it is for)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from neorec.common.borrowed_view import borrowed_view, view_at


@numba.njit
def _view_sum_and_mark(values, start, length, mark):
    """The sum of ``values[start : start + length]`` through a borrowed view, whose first
    element (if any) is then set to ``mark``."""
    view = borrowed_view(values, start, length)
    total = values.dtype.type(0)
    for i in range(view.shape[0]):
        total += view[i]
    if view.shape[0] > 0:
        view[0] = mark
    return total, view.shape[0]


@numba.njit(inline="always")
def _update(row, state, grad, dim, rule):
    """Rule 0: ``row -= grad``; 1: ``row -= grad / s`` after ``s += grad[0]**2`` (one state
    value per row); 2: ``s = 0.5 s + grad``, ``row -= s`` (a state value per element)."""
    if rule == 0:
        for d in range(dim):
            row[d] -= grad[d]
    elif rule == 1:
        state[0] += grad[0] * grad[0]
        for d in range(dim):
            row[d] -= grad[d] / state[0]
    else:
        for d in range(dim):
            state[d] = 0.5 * state[d] + grad[d]
            row[d] -= state[d]


@numba.njit
def _row_updates(weights, state, grads, rows, upstream, dim, rule):
    """A kernel shaped like the optimizer update: per row, its gradient (an upstream row, or
    ones in a scratch row where ``upstream`` is negative), and views of its weights and
    state passed through a branch on the update rule."""
    scratch = np.empty(dim, dtype=np.float32)
    width = dim if rule == 2 else 1 if rule == 1 else 0
    for r in range(rows.shape[0]):
        if upstream[r] >= 0:
            grad = borrowed_view(grads, upstream[r] * dim, dim)
        else:
            grad = borrowed_view(scratch, 0, dim)
            for d in range(dim):
                grad[d] = 1.0
        _update(borrowed_view(weights, rows[r] * dim, dim), borrowed_view(state, rows[r] * width, width), grad, dim,
                rule)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint16, np.uint8])
def test_view_holds_the_slice_and_writes_reach_the_source(dtype):
    values = np.arange(50).astype(dtype)
    expected = values.copy()
    for start, length in ((0, 50), (7, 13), (49, 1), (20, 0)):
        total, size = _view_sum_and_mark(values, start, length, dtype(3))
        assert size == length
        assert total == expected[start : start + length].sum()
        if length:
            expected[start] = 3
        np.testing.assert_array_equal(values, expected)


def test_empty_view_may_start_past_the_end():
    values = np.arange(4, dtype=np.float32)
    assert _view_sum_and_mark(values, 100, 0, np.float32(9)) == (0.0, 0)
    np.testing.assert_array_equal(values, np.arange(4, dtype=np.float32))


def test_row_updates_match_slices_and_count_no_references():
    """The update-shaped kernel gives what numpy slices give, and its only reference
    counting is of its five array arguments, once per call: none per row (the same kernel
    with slices counts references inside its loop)."""
    rows = np.array([3, 0, 3, 7], dtype=np.int64)
    upstream = np.array([1, -1, 2, 0], dtype=np.int64)
    grads = np.arange(1, 13, dtype=np.float32)
    for rule in (0, 1, 2):
        weights = np.ones(8 * 4, dtype=np.float32)
        width = 4 if rule == 2 else 1 if rule == 1 else 0
        state = np.zeros(8 * width, dtype=np.float32)
        _row_updates(weights, state, grads, rows, upstream, 4, rule)
        expected_weights = np.ones((8, 4), dtype=np.float32)
        expected_state = np.zeros((8, width), dtype=np.float32)
        for row, up in zip(rows, upstream):
            grad = grads[up * 4 : up * 4 + 4] if up >= 0 else np.ones(4, dtype=np.float32)
            if rule == 0:
                expected_weights[row] -= grad
            elif rule == 1:
                expected_state[row, 0] += grad[0] * grad[0]
                expected_weights[row] -= grad / expected_state[row, 0]
            else:
                expected_state[row] = np.float32(0.5) * expected_state[row] + grad
                expected_weights[row] -= expected_state[row]
        np.testing.assert_array_equal(weights, expected_weights.reshape(-1))
        np.testing.assert_array_equal(state, expected_state.reshape(-1))
    ir = "".join(_row_updates.inspect_llvm().values())
    kernel = ir.split("define ", 2)[1]  # the kernel itself, before its Python wrapper
    assert kernel.count("call void @NRT_incref") == 5


@numba.njit
def _copy_run(values, offset, out):
    """``out[:] = values[offset : offset + out.size]`` through a view indexed from 0."""
    column = borrowed_view(values, offset, out.shape[0])
    for k in range(out.shape[0]):
        out[k] = column[k]


def test_a_run_read_through_a_view_is_copied_without_gathers():
    """Indexed ``values[offset + k]``, such a loop is vectorized with gather instructions
    on CPUs that have them (the offset might be negative); through the view it is plain
    vector loads."""
    values = np.arange(100, dtype=np.int32)
    out = np.empty(40, dtype=np.int64)
    _copy_run(values, 30, out)
    np.testing.assert_array_equal(out, np.arange(30, 70))
    asm = "".join(_copy_run.inspect_asm().values())
    assert "gather" not in asm and "scatter" not in asm


@numba.njit
def _write_by_address(addresses, targets, places, values, like):
    """``values[k]`` to element ``places[k]`` of the array at ``addresses[targets[k]]``."""
    for k in range(values.shape[0]):
        view_at(addresses[targets[k]], places[k] + 1, like)[places[k]] = values[k]


@numba.njit
def _sum_at(address, length, like):
    view = view_at(address, length, like)
    total = like.dtype.type(0)
    for i in range(view.shape[0]):
        total += view[i]
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32, np.uint8])
def test_view_at_an_address_reads_and_writes_the_array_there(dtype):
    arrays = [np.zeros(n, dtype=dtype) for n in (5, 3, 8)]
    addresses = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
    targets = np.array([2, 0, 1, 2, 0], dtype=np.int64)
    places = np.array([7, 4, 0, 1, 0], dtype=np.int64)
    values = np.array([1, 2, 3, 4, 5], dtype=dtype)
    _write_by_address(addresses, targets, places, values, arrays[0][:0])
    expected = [np.zeros(n, dtype=dtype) for n in (5, 3, 8)]
    for t, p, v in zip(targets, places, values):
        expected[t][p] = v
    for got, want in zip(arrays, expected):
        np.testing.assert_array_equal(got, want)
    view = arrays[2][1:]  # a view's address is its first element's
    assert _sum_at(view.ctypes.data, view.size, view[:0]) == view.sum()
