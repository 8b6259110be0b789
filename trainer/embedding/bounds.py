"""Refusing ids outside their tables before any update (the ``bounds_check`` setting,
FBGEMM's ``bounds_check_mode``).

``"fatal"`` (the default): every id of a batch is checked against its table's rows with one
pass over the batch's ids (a Numba loop on the CPU, vectorized torch ops elsewhere), and a
bad one raises an ``IndexError`` naming the feature, the table, the id and the rows. The
store-backed collection runs the check before its lookup (before any cache admission);
the fused collection's lookups (Numba kernels and torch ops) find bad ids themselves, and
this pass only names the bad id of a batch they refuse, before the update.
``"none"``: the caller vouches for its ids (benchmarks); the Numba kernels keep their own
guard.

The batch's own invariants (dtypes, shapes, lengths against ids) are checked whatever the
mode, when a :class:`~neorec.trainer.batch.KeyedJaggedTensor` is made.
"""

from __future__ import annotations

from typing import Sequence

import torch

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.kernels.id_range import first_out_of_range

BOUNDS_CHECK_MODES = ("fatal", "none")
_NO_LIMIT = torch.iinfo(torch.int64).max


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`BOUNDS_CHECK_MODES`, else ``ValueError``."""
    if mode not in BOUNDS_CHECK_MODES:
        raise ValueError(f"bounds_check must be one of {BOUNDS_CHECK_MODES}, got {mode!r}")
    return mode


class BoundsCheck:
    """The id check of one embedding collection: ``features[i]`` looks up table
    ``tables[i]`` of ``rows[i]`` rows."""

    def __init__(self, mode: str, features: Sequence[str], tables: Sequence[str], rows: Sequence[int]) -> None:
        self.mode = check_mode(mode)
        self._table_of = dict(zip(features, tables))
        self._rows_of = dict(zip(features, (int(r) for r in rows)))
        self._limits: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}

    def __call__(self, sparse: KeyedJaggedTensor, host_kernels: bool = True) -> None:
        """Raise ``IndexError`` (naming the first bad id's feature and table) if an id of a
        feature of the collection lies outside ``[0, rows)``; features the collection does
        not look up are not checked. Nothing is checked in mode ``"none"``. ``host_kernels``:
        the lookup runs the Numba kernels (then a CPU batch is checked in one Numba pass;
        the torch-ops path names a refused batch's id with torch ops, as on a GPU)."""
        if self.mode == "none" or sparse.values.numel() == 0 or not sparse.keys:
            return
        values, limits = sparse.values, self._limits_for(sparse.keys, sparse.values.device)
        batch_size = sparse.lengths.numel() // len(sparse.keys)
        on_host = host_kernels and values.device.type == "cpu"
        if on_host:  # one pass, no temporaries
            first = first_out_of_range(values.numpy(), sparse.lengths.numpy(), batch_size, limits.numpy())
            if first < 0:
                return
        per_key = sparse.lengths.view(len(sparse.keys), batch_size).sum(1, dtype=torch.int64)
        if not on_host:
            bad = (values < 0) | (values >= torch.repeat_interleave(limits, per_key, output_size=values.numel()))
            if not bool(bad.any()):
                return
            first = int(torch.argmax(bad.to(torch.uint8)))
        key = sparse.keys[int(torch.searchsorted(torch.cumsum(per_key, 0), first, right=True))]
        raise IndexError(f"id {int(values[first])} of feature {key!r} is outside its table's rows "
                         f"{self._table_of[key]}: [0, {self._rows_of[key]})")

    def _limits_for(self, keys: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """int64 ``[len(keys)]``: each key's row count (no limit for keys not looked up)."""
        cached = self._limits.get((keys, device))
        if cached is None:
            cached = torch.tensor([self._rows_of.get(k, _NO_LIMIT) for k in keys], dtype=torch.int64, device=device)
            self._limits[(keys, device)] = cached
        return cached
