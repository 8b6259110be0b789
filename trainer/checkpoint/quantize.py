"""Per-row uniform quantization of embedding rows, with the range searched to minimise the
squared error (Check-N-Run, Eisenman et al., NSDI'22).

Each row of ``x`` (float32 ``[n, d]``) is stored as ``b``-bit codes ``q`` with a float32
``scale`` and ``offset`` per row, read back as ``offset + q * scale``. Plain min/max
quantization spends the levels on the row's extremes; clipping the range tighter costs
error on the few clipped values and gains resolution on all the others. For every row the
quantizer tries a grid of clipped ranges (the min/max range among them) and keeps the one
with the least squared error, so it is never worse than min/max.

Codes of 8, 4 and 2 bits are packed into bytes (two or four per byte, low bits first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BITS = (8, 4, 2)
TRIM_STEPS = 8
"""Candidate clipping points per end of the range: the extreme itself and 7 points moving
towards the median, a 2-D grid of 64 ranges per row."""
MAX_TRIM = 0.5
"""The farthest a candidate clips an end: halfway from the extreme to the row's median."""


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
    rows = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    n, dim = rows.shape
    levels = (1 << bits) - 1
    if n == 0:
        return QuantizedRows(bits, dim, np.zeros((0, packed_width(dim, bits)), np.uint8), np.zeros(0, np.float32),
                             np.zeros(0, np.float32))
    low, high = rows.min(dim=1).values, rows.max(dim=1).values
    if search:
        low, high = _search_range(rows, low, high, levels)
    scale = (high - low) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round((rows - low[:, None]) / safe[:, None]), 0, levels).to(torch.uint8)
    return QuantizedRows(bits, dim, pack(codes.numpy(), bits), scale.numpy().astype(np.float32),
                         low.numpy().astype(np.float32))


def _search_range(rows: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                  levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the (low, high) of the candidate grid with the least squared error."""
    median = rows.median(dim=1).values
    fractions = torch.linspace(0.0, MAX_TRIM, TRIM_STEPS)
    best_error = torch.full_like(low, float("inf"))
    best_low, best_high = low.clone(), high.clone()
    for a in fractions:
        lo = low + a * (median - low)
        for b in fractions:
            hi = high - b * (high - median)
            scale = (hi - lo) / levels
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = torch.clamp(torch.round((rows - lo[:, None]) / safe[:, None]), 0, levels)
            error = ((lo[:, None] + codes * scale[:, None] - rows) ** 2).sum(dim=1)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_low = torch.where(better, lo, best_low)
            best_high = torch.where(better, hi, best_high)
    return best_low, best_high


def packed_width(dim: int, bits: int) -> int:
    """Bytes per row of ``dim`` codes of ``bits`` bits."""
    per_byte = 8 // bits
    return -(-dim // per_byte)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[n, d]`` codes below ``2**bits`` → uint8 ``[n, packed_width(d, bits)]``."""
    per_byte = 8 // bits
    n, dim = codes.shape
    padded = np.zeros((n, packed_width(dim, bits) * per_byte), dtype=np.uint8)
    padded[:, :dim] = codes
    grouped = padded.reshape(n, -1, per_byte)
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
