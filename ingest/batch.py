"""The host-side batch: numpy arrays in the keyed-jagged layout of the data contract.

Sparse features are one keyed jagged block, lengths not offsets, all features
concatenated feature-major: ``lengths[f * B + b]`` is the number of ids of sample ``b`` in
feature ``keys[f]`` and ``values`` holds feature 0's ids (sample by sample), then
feature 1's, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numba
import numpy as np

from neorec.ingest.rows import RowSpan, merge_spans


@dataclass(frozen=True)
class Provenance:
    """Where a batch comes from: its place in the epoch and the rows it holds, in order
    (spans of the epoch's windows, see :mod:`neorec.ingest.rows`)."""

    epoch: int
    step: int
    rows: tuple[RowSpan, ...]


@dataclass
class HostBatch:
    """``B`` samples in numpy arrays.

    Attributes:
        dense: float32 ``[B, num_dense]``.
        labels: float32 ``[B]``.
        keys: feature names, in the order of the feature-major blocks.
        lengths: int32 ``[F * B]``, feature-major.
        values: int64 ``[sum(lengths)]``.
        weights: optional float32 ``[sum(lengths)]`` per-id weights.
        num_valid: samples ``[0, num_valid)`` are real, the rest padding (empty bags,
            zero dense and label) that the loss and metrics ignore.
        provenance: set on batches delivered by a reader.
    """

    dense: np.ndarray
    labels: np.ndarray
    keys: tuple[str, ...]
    lengths: np.ndarray
    values: np.ndarray
    weights: np.ndarray | None = None
    num_valid: int = -1
    provenance: Provenance | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_valid < 0:
            self.num_valid = self.batch_size

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_features(self) -> int:
        return len(self.keys)

    def check(self, table_rows: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first problem unless the batch is well formed for
        features whose ids lie in ``[0, table_rows[f])`` (any int64 where ``table_rows[f]``
        is 0: raw ids): ``B * F`` bag lengths, none negative, adding up to the number of
        ids, and every id inside its feature's table.
        One pass over the lengths and one over the ids (:func:`_first_problem`)."""
        num_f, size = self.num_features, self.batch_size
        if len(table_rows) != num_f:
            raise ValueError(f"{len(table_rows)} table sizes for a batch of {num_f} features")
        if self.lengths.size != num_f * size or self.dense.shape[0] != size:
            raise ValueError(f"{self.lengths.size} bag lengths and {self.dense.shape[0]} dense rows for "
                             f"{num_f} features of {size} samples")
        if self.weights is not None and self.weights.size != self.values.size:
            raise ValueError(f"{self.weights.size} id weights for {self.values.size} ids")
        lengths = self.lengths.reshape(num_f, size)
        problem, at, of = _first_problem(lengths, self.values, np.asarray(table_rows, dtype=np.int64))
        if problem == _NEGATIVE_LENGTH:
            raise ValueError(f"feature {self.keys[at]!r}, sample {of}: negative bag length {lengths[at, of]}")
        if problem == _LENGTHS_MISMATCH:
            raise ValueError(f"bag lengths add up to {at} ids, the batch holds {self.values.size}")
        if problem == _ID_OUTSIDE:
            raise ValueError(f"feature {self.keys[of]!r}: id {int(self.values[at])} is outside its table's "
                             f"rows [0, {int(table_rows[of])})")

    def feature_value_offsets(self) -> np.ndarray:
        """int64 ``[F + 1]``: ``values[o[f]:o[f+1]]`` are feature ``f``'s ids."""
        totals = self.lengths.reshape(self.num_features, self.batch_size).sum(axis=1, dtype=np.int64)
        return np.concatenate([[0], np.cumsum(totals)]).astype(np.int64)

    def pieces(self, bounds: Sequence[int]) -> list["Piece"]:
        """Samples ``[bounds[j], bounds[j+1])`` as uncopied :class:`Piece` s, each copied into
        a batch of its own only when taken (:meth:`Piece.copied`): a chunk cut into batches
        never holds a second copy of all its ids at once (memory the allocator would map
        afresh for every chunk). ``bounds`` must rise strictly from 0 to ``B`` (or be
        ``[0, 0]`` for a batch of no samples). Costs one pass over the lengths: the ids of
        every piece are counted per feature at once (no prefix sum over bags)."""
        first, counts = _piece_ids(self.lengths, self.num_features, self.batch_size, np.asarray(bounds, dtype=np.int64))
        return [Piece(self, lo, hi, first[j], counts[j]) for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]

    @classmethod
    def empty(cls, keys: tuple[str, ...], num_dense: int) -> "HostBatch":
        """A batch of no samples."""
        return cls(
            dense=np.zeros((0, num_dense), dtype=np.float32),
            labels=np.zeros(0, dtype=np.float32),
            keys=keys,
            lengths=np.zeros(0, dtype=np.int32),
            values=np.zeros(0, dtype=np.int64),
        )

    @staticmethod
    def concat(parts: list["HostBatch"]) -> "HostBatch":
        """Samples of ``parts`` one after the other (keys must agree)."""
        if len(parts) == 1:
            return parts[0]
        keys = parts[0].keys
        num_f = len(keys)
        lengths = np.concatenate([p.lengths.reshape(num_f, p.batch_size) for p in parts], axis=1)
        offsets = [p.feature_value_offsets() for p in parts]
        values = np.concatenate(
            [p.values[o[f] : o[f + 1]] for f in range(num_f) for p, o in zip(parts, offsets)]
        ) if num_f else parts[0].values[:0]
        weights = None
        if parts[0].weights is not None:
            weights = np.concatenate(
                [p.weights[o[f] : o[f + 1]] for f in range(num_f) for p, o in zip(parts, offsets)]
            )
        return HostBatch(
            dense=np.concatenate([p.dense for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            keys=keys,
            lengths=lengths.reshape(-1),
            values=values,
            weights=weights,
        )

    def padded_to(self, size: int) -> "HostBatch":
        """This batch followed by ``size - B`` padding samples; ``num_valid`` stays ``B``."""
        extra = size - self.batch_size
        if extra < 0:
            raise ValueError(f"cannot pad a batch of {self.batch_size} samples to {size}")
        if extra == 0:
            return self
        num_f = self.num_features
        lengths = np.zeros((num_f, size), dtype=np.int32)
        lengths[:, : self.batch_size] = self.lengths.reshape(num_f, self.batch_size)
        dense = np.zeros((size, self.dense.shape[1]), dtype=np.float32)
        dense[: self.batch_size] = self.dense
        labels = np.zeros(size, dtype=np.float32)
        labels[: self.batch_size] = self.labels
        return HostBatch(
            dense=dense,
            labels=labels,
            keys=self.keys,
            lengths=lengths.reshape(-1),
            values=self.values,
            weights=self.weights,
            num_valid=self.batch_size,
        )


@dataclass(frozen=True)
class Piece:
    """Samples ``[lo, hi)`` of ``source``, not copied: feature ``f``'s ids are
    ``source.values[first[f] : first[f] + counts[f]]`` (``first`` and ``counts`` int64
    ``[F]``), as are its weights."""

    source: HostBatch
    lo: int
    hi: int
    first: np.ndarray
    counts: np.ndarray

    @classmethod
    def whole(cls, batch: HostBatch) -> "Piece":
        """All of ``batch`` (of any size, none included)."""
        return batch.pieces([0, batch.batch_size])[0]

    @property
    def num_samples(self) -> int:
        return self.hi - self.lo

    def bag_starts(self) -> np.ndarray:
        """int64 ``[F]``: where each feature's bag lengths of the piece start in
        ``source.lengths`` (``hi - lo`` of them)."""
        return np.arange(self.source.num_features, dtype=np.int64) * self.source.batch_size + self.lo

    def copied(self) -> HostBatch:
        """The piece as a batch of its own (all samples valid): ids and lengths copied,
        dense values and labels views; a piece that is all of its source is the source."""
        source = self.source
        if self.lo == 0 and self.hi == source.batch_size:
            return source
        spans = [slice(a, a + n) for a, n in zip(self.first.tolist(), self.counts.tolist())]
        lengths = source.lengths.reshape(source.num_features, source.batch_size)[:, self.lo : self.hi]
        return HostBatch(
            dense=source.dense[self.lo : self.hi],
            labels=source.labels[self.lo : self.hi],
            keys=source.keys,
            lengths=np.ascontiguousarray(lengths).reshape(-1),
            values=np.concatenate([source.values[p] for p in spans]) if spans else source.values[:0],
            weights=None if source.weights is None else np.concatenate([source.weights[p] for p in spans]),
        )


@dataclass(frozen=True)
class BatchPieces:
    """A batch before it is copied into one: the pieces of decoded chunks it takes, in
    order, then padding up to ``size`` samples. ``parts`` pairs each piece with the rows it
    holds; ``empty`` is a batch of no samples with the dataset's keys and dense width."""

    epoch: int
    step: int
    size: int
    parts: tuple[tuple[RowSpan, Piece], ...]
    empty: HostBatch

    @property
    def num_valid(self) -> int:
        return sum(piece.num_samples for _, piece in self.parts)

    @property
    def provenance(self) -> Provenance:
        return Provenance(epoch=self.epoch, step=self.step, rows=merge_spans(rows for rows, _ in self.parts))

    def pieces(self) -> list[Piece]:
        """The pieces in order; one of no samples (of ``empty``) for an all-padding batch."""
        return [piece for _, piece in self.parts] or [Piece.whole(self.empty)]

    def assembled(self) -> HostBatch:
        """The batch, its pieces copied into one and padded, with its provenance."""
        batch = HostBatch.concat([piece.copied() for piece in self.pieces()]).padded_to(self.size)
        batch.provenance = self.provenance
        return batch


@numba.njit(cache=True, nogil=True)
def _piece_ids(lengths, num_f, size, bounds):  # pragma: no cover - compiled
    """Where each piece's ids lie, for the pieces ``[bounds[j], bounds[j + 1])`` of a
    batch of ``num_f`` features and ``size`` samples whose bag lengths are ``lengths``
    (int32 ``[F * B]``, feature-major; ``bounds`` int64, rising from 0 to ``B``):
    ``(first, counts)``, int64 ``[pieces, F]`` each, piece ``j`` of feature ``f`` being
    ``values[first[j, f] : first[j, f] + counts[j, f]]``. One pass over the lengths, in
    memory order (a feature's bags, piece after piece)."""
    pieces = bounds.size - 1
    first = np.empty((pieces, num_f), dtype=np.int64)
    counts = np.empty((pieces, num_f), dtype=np.int64)
    start = 0
    for f in range(num_f):
        for j in range(pieces):
            bags = lengths[f * size + bounds[j] : f * size + bounds[j + 1]]  # from 0: the loop vectorizes
            total = 0
            for b in range(bags.size):
                total += bags[b]
            first[j, f] = start
            counts[j, f] = total
            start += total
    return first, counts


_WELL_FORMED, _NEGATIVE_LENGTH, _LENGTHS_MISMATCH, _ID_OUTSIDE = range(4)


@numba.njit(cache=True, nogil=True)
def _first_problem(lengths, values, table_rows):  # pragma: no cover - compiled
    """The first problem of a batch as ``(kind, at, of)``: a negative bag length
    (``_NEGATIVE_LENGTH``, feature ``at``, sample ``of``; the first in feature-major order),
    lengths adding up to ``at`` ids where ``values`` holds another number
    (``_LENGTHS_MISMATCH``), or the first id outside its feature's ``[0, table_rows[f])``
    (``_ID_OUTSIDE``, position ``at`` in ``values``, feature ``of``; a feature whose
    ``table_rows`` is 0 has raw ids, never outside); ``_WELL_FORMED`` if none. ``lengths``
    is ``[F, B]``, ``values`` ``[sum(lengths)]``, ``table_rows`` int64 ``[F]``.

    Each feature's lengths and ids are checked by their least and largest (loops the
    compiler vectorizes, unlike one that stops at the first bad element); only a feature
    that fails is walked again for its first bad element."""
    num_f, size = lengths.shape
    totals = np.zeros(num_f, dtype=np.int64)
    for f in range(num_f):
        bags = lengths[f]
        total = 0
        least = 0
        for b in range(size):
            total += bags[b]
            least = min(least, bags[b])
        if least < 0:
            for b in range(size):
                if bags[b] < 0:
                    return _NEGATIVE_LENGTH, f, b
        totals[f] = total
    if totals.sum() != values.size:
        return _LENGTHS_MISMATCH, totals.sum(), 0
    start = 0
    for f in range(num_f):
        ids = values[start : start + totals[f]]  # a slice: indexing from 0 lets the loops vectorize
        if ids.size and table_rows[f] > 0:
            least = ids[0]
            largest = ids[0]
            for k in range(ids.size):
                least = min(least, ids[k])
                largest = max(largest, ids[k])
            if least < 0 or largest >= table_rows[f]:
                for k in range(ids.size):
                    if ids[k] < 0 or ids[k] >= table_rows[f]:
                        return _ID_OUTSIDE, start + k, f
        start += totals[f]
    return _WELL_FORMED, 0, 0
