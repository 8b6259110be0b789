"""Refusing ids outside their tables before any kernel runs (the ``bounds_check`` setting,
FBGEMM's ``bounds_check_mode``).

``"fatal"`` (the default): every id of a batch is checked against its table's rows up front,
with one vectorized pass over the batch's ids, and a bad one raises an ``IndexError``
naming the feature, the table, the id and the rows, before any lookup, cache admission or
update. ``"none"``: the caller vouches for its ids (benchmarks); the kernels keep only their
own guards.

The batch's own invariants (dtypes, shapes, lengths against ids) are checked whatever the
mode, when a :class:`~neorec.trainer.batch.KeyedJaggedTensor` is made.
"""

from __future__ import annotations

from typing import Sequence

import torch

from neorec.trainer.batch import KeyedJaggedTensor

BOUNDS_CHECK_MODES = ("fatal", "none")
_NO_LIMIT = torch.iinfo(torch.int64).max


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`BOUNDS_CHECK_MODES`, else ``ValueError``."""
    if mode not in BOUNDS_CHECK_MODES:
        raise ValueError(f"bounds_check must be one of {BOUNDS_CHECK_MODES}, got {mode!r}")
    return mode


class BoundsCheck:
    """The up-front id check of one embedding collection: ``features[i]`` looks up table
    ``tables[i]`` of ``rows[i]`` rows."""

    def __init__(self, mode: str, features: Sequence[str], tables: Sequence[str], rows: Sequence[int]) -> None:
        self.mode = check_mode(mode)
        self._table_of = dict(zip(features, tables))
        self._rows_of = dict(zip(features, (int(r) for r in rows)))
        self._limits: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}

    def __call__(self, sparse: KeyedJaggedTensor) -> None:
        """Raise ``IndexError`` (naming the first bad id's feature and table) if an id of a
        feature of the collection lies outside ``[0, rows)``; features the collection does
        not look up are not checked. Nothing is checked in mode ``"none"``."""
        if self.mode == "none" or sparse.values.numel() == 0 or not sparse.keys:
            return
        values = sparse.values
        per_key = sparse.lengths.view(len(sparse.keys), -1).sum(1, dtype=torch.int64)
        limit = torch.repeat_interleave(self._limits_for(sparse.keys, values.device), per_key,
                                        output_size=values.numel())
        bad = (values < 0) | (values >= limit)
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
