"""Per-row quantization: the range search is never worse than min/max, and much better on
rows with outliers; codes pack and unpack losslessly."""

import numpy as np
import pytest

from neorec.trainer.checkpoint.quantize import pack, quantize, unpack


def _error(x: np.ndarray, bits: int, search: bool) -> np.ndarray:
    restored = quantize(x, bits, search=search).dequantize()
    return ((restored - x) ** 2).sum(axis=1)


@pytest.mark.parametrize("bits,at_most", [(8, 1.0), (4, 0.8), (2, 0.4)])
def test_searched_range_is_never_worse_than_min_max_and_better_on_heavy_tails(bits, at_most):
    rng = np.random.default_rng(0)
    normal = rng.normal(0, 0.02, (500, 64)).astype(np.float32)
    heavy = (rng.standard_t(2, (500, 64)) * 0.02).astype(np.float32)  # rows with a few large values
    for rows in (normal, heavy):
        searched, plain = _error(rows, bits, True), _error(rows, bits, False)
        assert np.all(searched <= plain * (1 + 1e-6) + 1e-12)  # min/max is one of the candidates
    assert _error(heavy, bits, True).mean() <= at_most * _error(heavy, bits, False).mean()


@pytest.mark.parametrize("bits,tolerance", [(8, 0.01), (4, 0.15), (2, 0.5)])
def test_error_shrinks_with_bits(bits, tolerance):
    x = np.random.default_rng(1).uniform(-0.1, 0.1, (200, 16)).astype(np.float32)
    q = quantize(x, bits)
    assert q.codes.shape == (200, 16 * bits // 8)
    relative = np.abs(q.dequantize() - x).max() / np.abs(x).max()
    assert relative <= tolerance


def test_constant_rows_and_no_rows_round_trip():
    x = np.full((3, 5), 0.25, dtype=np.float32)
    assert np.array_equal(quantize(x, 4).dequantize(), x)
    assert quantize(np.zeros((0, 5), np.float32), 8).dequantize().shape == (0, 5)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim", [1, 7, 16])
def test_packing_round_trips(bits, dim):
    codes = np.random.default_rng(2).integers(0, 1 << bits, (9, dim)).astype(np.uint8)
    assert np.array_equal(unpack(pack(codes, bits), bits, dim), codes)
