"""The prefetch intrinsics: they compile to LLVM's prefetch with the intent and cache
locality they name and change nothing a kernel computes, even for an index past the
array's end; the kernels' row prefetch reads its lines into L2."""

from __future__ import annotations

import re

import numba
import numpy as np

from neorec.common.cache_prefetch import prefetch, prefetch_for_write, prefetch_to_l2
from neorec.trainer.embedding.kernels.precision import FP16, FP32
from neorec.trainer.embedding.kernels.row_prefetch import prefetch_row


@numba.njit
def _scale_with_prefetches(values, factor, ahead):
    """``values *= factor`` in place, prefetching ``ahead`` elements on for reading, for
    reading into L2 and for writing (past the end at the tail); returns the sum of the
    scaled values."""
    total = 0.0
    for i in range(values.shape[0]):
        prefetch(values, i + ahead)
        prefetch_to_l2(values, i + ahead)
        prefetch_for_write(values, i + ahead)
        values[i] *= factor
        total += values[i]
    return total


def _prefetches(function) -> set[tuple[str, str]]:
    """The (read/write, locality) arguments of every ``llvm.prefetch`` call in
    ``function``'s IR."""
    ir = "".join(function.inspect_llvm().values())
    return set(re.findall(r"call void @llvm\.prefetch\.p0\w*\([^,]+, i32 (\d), i32 (\d), i32 1\)", ir))


def test_prefetches_change_no_result_even_past_the_end():
    values = np.arange(1000, dtype=np.float32)
    total = _scale_with_prefetches(values, np.float32(2.0), 64)
    expected = 2.0 * np.arange(1000, dtype=np.float32)
    assert np.array_equal(values, expected)
    assert total == float(expected.astype(np.float64).sum())


def test_each_prefetch_asks_for_its_intent_and_cache_level():
    _scale_with_prefetches(np.ones(4, dtype=np.float32), np.float32(1.0), 1)
    assert _prefetches(_scale_with_prefetches) == {("0", "3"), ("0", "2"), ("1", "3")}


@numba.njit
def _prefetch_rows(weights, weights16, precision):
    prefetch_row(weights, weights16, precision, 64, 64)


def test_row_prefetch_reads_into_l2_in_either_precision():
    weights, weights16 = np.zeros(256, dtype=np.float32), np.zeros(256, dtype=np.uint16)
    for precision in (FP32, FP16):
        _prefetch_rows(weights, weights16, precision)
    assert _prefetches(_prefetch_rows) == {("0", "2")}
