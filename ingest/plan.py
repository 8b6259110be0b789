"""Epoch planning from Parquet metadata: which rows each trainer rank reads, in which order.

The unit of work is a row group of a file. For every epoch the row groups of a split
are shuffled from ``(seed, epoch)`` into one row stream; the stream is cut into
``world_size`` contiguous, equal parts of whole batches, one per rank. The plan is a
function of (files' metadata, seed, epoch, rank, world size, batch size) alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq

from ingest.batch import RowRange

REMAINDER_POLICIES = ("drop", "pad")


@dataclass(frozen=True)
class RowGroupInfo:
    file_index: int
    row_group: int
    num_rows: int


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of one epoch.

    ``ranges`` are read in order and cut into ``num_batches`` batches of ``batch_size``
    samples; with the ``pad`` policy the last batches may hold ``padded_samples`` padding
    samples in all. ``dropped_rows`` counts rows of the whole epoch (all ranks) not read.
    """

    epoch: int
    rank: int
    world_size: int
    batch_size: int
    ranges: tuple[RowRange, ...]
    num_batches: int
    padded_samples: int
    dropped_rows: int

    @property
    def num_rows(self) -> int:
        return sum(r.num_rows for r in self.ranges)


def row_groups_of(files: Sequence[pq.ParquetFile]) -> list[RowGroupInfo]:
    """Row groups of opened ``files`` from their Parquet footers (no data is read)."""
    groups = []
    for file_index, parquet_file in enumerate(files):
        meta = parquet_file.metadata
        for rg in range(meta.num_row_groups):
            groups.append(RowGroupInfo(file_index, rg, meta.row_group(rg).num_rows))
    return groups


def epoch_order(num_groups: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order in which row groups are read in ``epoch`` (int64 ``[num_groups]``)."""
    if not shuffle:
        return np.arange(num_groups, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_groups)


def plan_epoch(
    groups: Sequence[RowGroupInfo],
    *,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    batch_size: int,
    remainder: str = "drop",
    shuffle: bool = True,
) -> RankPlan:
    """Plan rank ``rank``'s batches of ``epoch``.

    Every rank gets the same number of batches. ``remainder="drop"`` reads only whole
    batches (the rest of the epoch's rows is dropped and counted); ``"pad"`` reads every
    row and pads the last batches.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if remainder not in REMAINDER_POLICIES:
        raise ValueError(f"remainder must be one of {REMAINDER_POLICIES}, got {remainder!r}")
    order = epoch_order(len(groups), seed, epoch, shuffle)
    sizes = np.array([groups[i].num_rows for i in order], dtype=np.int64)
    total = int(sizes.sum())
    if remainder == "drop":
        num_batches = total // (world_size * batch_size)
        span = num_batches * batch_size
        begin, end = rank * span, (rank + 1) * span
        dropped = total - world_size * span
    else:
        num_batches = -(-total // (world_size * batch_size))
        span = num_batches * batch_size
        begin, end = min(rank * span, total), min((rank + 1) * span, total)
        dropped = 0
    ranges = _ranges_between(groups, order, sizes, begin, end)
    return RankPlan(
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        ranges=ranges,
        num_batches=num_batches,
        padded_samples=span - (end - begin),
        dropped_rows=dropped,
    )


def _ranges_between(
    groups: Sequence[RowGroupInfo], order: np.ndarray, sizes: np.ndarray, begin: int, end: int
) -> tuple[RowRange, ...]:
    """Row ranges covering stream positions ``[begin, end)`` of the ordered row groups."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ranges = []
    first = int(np.searchsorted(starts, begin, side="right")) - 1
    for k in range(max(first, 0), len(order)):
        g_begin, g_end = int(starts[k]), int(starts[k + 1])
        if g_begin >= end:
            break
        lo, hi = max(begin, g_begin) - g_begin, min(end, g_end) - g_begin
        if hi > lo:
            g = groups[int(order[k])]
            ranges.append(RowRange(g.file_index, g.row_group, lo, hi))
    return tuple(ranges)
