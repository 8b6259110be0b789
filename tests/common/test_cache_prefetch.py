"""The prefetch intrinsics: they compile to LLVM's prefetch with the intent they name and
change nothing a kernel computes, even for an index past the array's end; the kernels' row
prefetch keeps to the one intent its call names."""

from __future__ import annotations

import re

import numba
import numpy as np

from neorec.common.cache_prefetch import prefetch, prefetch_for_write
from neorec.trainer.embedding.kernels.precision import FP16, FP32
from neorec.trainer.embedding.kernels.row_prefetch import prefetch_row


@numba.njit
def _scale_with_prefetches(values, factor, ahead):
    """``values *= factor`` in place, prefetching ``ahead`` elements on for reading and for
    writing (past the end at the tail); returns the sum of the scaled values."""
    total = 0.0
    for i in range(values.shape[0]):
        prefetch(values, i + ahead)
        prefetch_for_write(values, i + ahead)
        values[i] *= factor
        total += values[i]
    return total


def _prefetch_intents(function) -> set[str]:
    """The read/write argument of every ``llvm.prefetch`` call in ``function``'s IR."""
    ir = "".join(function.inspect_llvm().values())
    return set(re.findall(r"call void @llvm\.prefetch\.p0\w*\([^,]+, i32 (\d), i32 3, i32 1\)", ir))


def test_prefetches_change_no_result_even_past_the_end():
    values = np.arange(1000, dtype=np.float32)
    total = _scale_with_prefetches(values, np.float32(2.0), 64)
    expected = 2.0 * np.arange(1000, dtype=np.float32)
    assert np.array_equal(values, expected)
    assert total == float(expected.astype(np.float64).sum())


def test_prefetch_asks_for_reading_and_prefetch_for_write_for_writing():
    _scale_with_prefetches(np.ones(4, dtype=np.float32), np.float32(1.0), 1)
    assert _prefetch_intents(_scale_with_prefetches) == {"0", "1"}


@numba.njit
def _prefetch_rows_for_reading(weights, weights16, precision):
    prefetch_row(weights, weights16, precision, 64, 64, False)


@numba.njit
def _prefetch_rows_for_writing(weights, weights16, precision):
    prefetch_row(weights, weights16, precision, 64, 64, True)


def test_row_prefetch_compiles_to_the_intent_of_its_call_alone():
    weights, weights16 = np.zeros(256, dtype=np.float32), np.zeros(256, dtype=np.uint16)
    for precision in (FP32, FP16):
        _prefetch_rows_for_reading(weights, weights16, precision)
        _prefetch_rows_for_writing(weights, weights16, precision)
    assert _prefetch_intents(_prefetch_rows_for_reading) == {"0"}
    assert _prefetch_intents(_prefetch_rows_for_writing) == {"1"}
