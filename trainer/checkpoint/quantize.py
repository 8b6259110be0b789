"""Per-row uniform quantization of embedding rows, with the range searched to minimise the
squared error (Check-N-Run, Eisenman et al., NSDI'22), in one Numba kernel over the rows
(on one thread: checkpoints are quantized in the background, beside training).

Each row of ``x`` (float32 ``[n, d]``) is stored as ``b``-bit codes ``q`` with a float32
``scale`` and ``offset`` per row, read back as ``offset + q * scale``. Plain min/max
quantization spends the levels on the row's extremes; clipping the range tighter costs
error on the few clipped values and gains resolution on all the others. For every row the
quantizer tries a grid of clipped ranges (:data:`TRIMS`, the min/max range among them) and
keeps the one with the least squared error, so it is never worse than min/max.

Codes of 8, 4 and 2 bits are packed into bytes (two or four per byte, low bits first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

BITS = (8, 4, 2)
TRIMS = {
    8: np.array([0.0, 1 / 64, 1 / 32], dtype=np.float32),
    4: np.array([0.0, 1 / 32, 1 / 16, 1 / 8], dtype=np.float32),
    2: np.array([0.0, 1 / 16, 1 / 8, 1 / 4, 3 / 8], dtype=np.float32),
}
"""Candidate clipping of each end of a row's range, as a fraction of the range (a grid of
ranges per row, min/max among them): the fewer the levels, the more clipping pays."""


@dataclass
class QuantizedRows:
    """``n`` rows of ``dim`` values as ``bits``-bit codes: ``codes`` uint8 ``[n, packed]``,
    ``scale`` and ``offset`` float32 ``[n]``."""

    bits: int
    dim: int
    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 ``[n, dim]``."""
        codes = unpack(self.codes, self.bits, self.dim).astype(np.float32)
        return self.offset[:, None] + codes * self.scale[:, None]


def quantize(x: np.ndarray, bits: int, search: bool = True) -> QuantizedRows:
    """Quantize float32 ``[n, d]`` rows to ``bits`` bits each (range searched unless
    ``search`` is False: plain min/max)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    rows = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = rows.shape
    codes = np.empty((n, dim), dtype=np.uint8)
    scale = np.empty(n, dtype=np.float32)
    offset = np.empty(n, dtype=np.float32)
    _quantize_rows(rows, (1 << bits) - 1, TRIMS[bits] if search else TRIMS[bits][:1], codes, scale, offset)
    return QuantizedRows(bits, dim, pack(codes, bits), scale, offset)


@numba.njit(cache=True, nogil=True)
def _quantize_rows(rows, levels, trims, codes, scale, offset):
    """Per row: the range of the ``trims`` grid with the least squared error, and the codes
    of the row in it (written to ``codes``, ``scale``, ``offset``)."""
    n, dim = rows.shape
    for i in range(n):
        row = rows[i]
        low, high = row.min(), row.max()
        span = high - low
        best_error, best_low, best_scale = np.inf, low, span / levels
        for a in trims:
            lo = low + a * span
            for b in trims:
                step = (high - b * span - lo) / levels
                inverse = 0.0 if step <= 0 else 1.0 / step
                error = 0.0
                for d in range(dim):
                    q = min(max(np.floor((row[d] - lo) * inverse + 0.5), 0.0), levels)
                    error += (lo + q * step - row[d]) ** 2
                if error < best_error:
                    best_error, best_low, best_scale = error, lo, step
        offset[i] = best_low
        scale[i] = best_scale
        for d in range(dim):
            q = 0.0 if best_scale <= 0 else min(max(np.floor((row[d] - best_low) / best_scale + 0.5), 0.0), levels)
            codes[i, d] = np.uint8(q)


def packed_width(dim: int, bits: int) -> int:
    """Bytes per row of ``dim`` codes of ``bits`` bits."""
    per_byte = 8 // bits
    return -(-dim // per_byte)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[n, d]`` codes below ``2**bits`` → uint8 ``[n, packed_width(d, bits)]``."""
    per_byte = 8 // bits
    n, dim = codes.shape
    width = packed_width(dim, bits)
    padded = np.zeros((n, width * per_byte), dtype=np.uint8)
    padded[:, :dim] = codes
    grouped = padded.reshape(n, width, per_byte)
    out = np.zeros(grouped.shape[:2], dtype=np.uint8)
    for k in range(per_byte):
        out |= grouped[:, :, k] << (k * bits)
    return out


def unpack(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """The inverse of :func:`pack`: uint8 ``[n, dim]`` codes."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    n = packed.shape[0]
    codes = np.empty((n, packed.shape[1], per_byte), dtype=np.uint8)
    for k in range(per_byte):
        codes[:, :, k] = (packed >> (k * bits)) & mask
    return codes.reshape(n, packed.shape[1] * per_byte)[:, :dim]
