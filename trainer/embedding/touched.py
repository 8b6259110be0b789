"""Which rows the sparse optimizer updated since the flags were last cleared: one bit per
row, what an incremental checkpoint copies.

A fused module keeps one bitmap for all its tables: table ``t``'s row ``r`` is bit
``(offsets[t] + r) % 8`` of byte ``(offsets[t] + r) // 8``, where ``offsets`` (from
:func:`bitmap_offsets`) start every table on a byte of its own. A bit per row rather than
a byte keeps the flags of a step's rows in the CPU's caches: the update kernels set one
for every row they write, at random, and a byte per row of a table of millions of rows
spread those writes over as many cache lines as the rows themselves.
"""

from __future__ import annotations

import numpy as np
import torch

BITS = 8
"""Rows per byte of the bitmap."""


def bitmap_bytes(rows: int) -> int:
    """Bytes that hold the flags of ``rows`` rows."""
    return -(-rows // BITS)


def bitmap_offsets(rows: np.ndarray) -> np.ndarray:
    """int64 ``[T + 1]``: where each of the tables of ``rows`` (int64 ``[T]``) starts in
    the bitmap, in rows (bits), each a multiple of :data:`BITS`; the last is the bitmap's
    size in bits."""
    padded = np.array([bitmap_bytes(int(n)) * BITS for n in np.asarray(rows).tolist()], dtype=np.int64)
    return np.concatenate(([0], np.cumsum(padded))).astype(np.int64)


class TouchedRows:
    """The flags of ``rows`` rows: ``bits`` (uint8 ``[ceil(rows / 8)]``, a view of a
    module's bitmap on its device), row ``r`` in bit ``r % 8`` of byte ``r // 8``."""

    def __init__(self, bits: torch.Tensor, rows: int) -> None:
        if bits.dtype != torch.uint8 or bits.numel() != bitmap_bytes(rows):
            raise ValueError(f"{rows} rows need {bitmap_bytes(rows)} uint8 bytes, got {bits.numel()} {bits.dtype}")
        self.bits = bits
        self.rows = rows

    @classmethod
    def of_table(cls, bitmap: torch.Tensor, first_bit: int, rows: int) -> "TouchedRows":
        """The flags of a table whose ``rows`` start at bit ``first_bit`` (from
        :func:`bitmap_offsets`) of a module's ``bitmap``."""
        start = first_bit // BITS
        return cls(bitmap[start : start + bitmap_bytes(rows)], rows)

    def mask(self) -> torch.Tensor:
        """bool ``[rows]`` on the bitmap's device: the rows updated."""
        if self.bits.device.type == "cpu":
            unpacked = np.unpackbits(self.bits.numpy(), count=self.rows, bitorder="little")
            return torch.from_numpy(unpacked.view(np.bool_))
        shifts = torch.arange(BITS, dtype=torch.uint8, device=self.bits.device)
        return ((self.bits[:, None] >> shifts) & 1).bool().reshape(-1)[: self.rows]

    def indices(self) -> torch.Tensor:
        """int64 ``[count]``, ascending, on the bitmap's device: the rows updated."""
        return torch.nonzero(self.mask()).flatten()

    def count(self) -> int:
        """How many rows were updated."""
        return int(torch.count_nonzero(self.mask()))

    def mark(self, rows: torch.Tensor) -> None:
        """Flag ``rows`` (int64, any order, repeats allowed)."""
        flags = self.mask()
        flags[rows.to(flags.device)] = True
        self.bits.copy_(_packed(flags))

    def clear(self) -> None:
        self.bits.zero_()


def _packed(flags: torch.Tensor) -> torch.Tensor:
    """uint8 ``[ceil(n / 8)]``: bool ``[n]`` ``flags`` packed as :class:`TouchedRows` reads them."""
    padded = torch.zeros(bitmap_bytes(flags.numel()) * BITS, dtype=torch.uint8, device=flags.device)
    padded[: flags.numel()] = flags
    weights = torch.tensor([1 << b for b in range(BITS)], dtype=torch.uint8, device=flags.device)
    return (padded.reshape(-1, BITS) * weights).sum(dim=1, dtype=torch.uint8)
