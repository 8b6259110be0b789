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

    def whole(self) -> "ReadTask":
        """The whole plan as one task."""
        return ReadTask(self.epoch, 0, self.num_batches, self.batch_size, self.ranges)

    def tasks(self, batches_per_task: int) -> list["ReadTask"]:
        """The plan cut into consecutive tasks of ``batches_per_task`` batches (the last
        may hold fewer): units of work a reader service can be asked for."""
        return self.whole().split(batches_per_task)


@dataclass(frozen=True)
class ReadTask:
    """Batches ``[first_step, first_step + num_batches)`` of a rank's epoch.

    ``ranges`` hold the task's rows in order; they fill its batches one after the other
    and padding completes the last ones (all of them, for a task past the rank's rows).
    """

    epoch: int
    first_step: int
    num_batches: int
    batch_size: int
    ranges: tuple[RowRange, ...]

    @property
    def num_rows(self) -> int:
        return sum(r.num_rows for r in self.ranges)

    def batch_rows(self, index: int) -> tuple[RowRange, ...]:
        """The rows of the task's ``index``-th batch, in order."""
        return cut_ranges(self.ranges, index * self.batch_size, (index + 1) * self.batch_size)

    def after(self, done: int) -> "ReadTask":
        """The task without its first ``done`` batches."""
        return ReadTask(
            self.epoch,
            self.first_step + done,
            self.num_batches - done,
            self.batch_size,
            cut_ranges(self.ranges, done * self.batch_size, self.num_rows),
        )

    def split(self, batches_per_task: int) -> list["ReadTask"]:
        """Consecutive tasks of ``batches_per_task`` batches covering this one."""
        if batches_per_task <= 0:
            raise ValueError(f"batches_per_task must be positive, got {batches_per_task}")
        size = self.batch_size
        return [
            ReadTask(
                self.epoch,
                self.first_step + first,
                min(batches_per_task, self.num_batches - first),
                size,
                cut_ranges(self.ranges, first * size, (first + batches_per_task) * size),
            )
            for first in range(0, self.num_batches, batches_per_task)
        ]


def cut_ranges(ranges: Sequence[RowRange], begin: int, end: int) -> tuple[RowRange, ...]:
    """The rows at positions ``[begin, end)`` of the stream ``ranges`` form, as ranges."""
    out = []
    position = 0
    for r in ranges:
        lo, hi = max(begin - position, 0), min(end - position, r.num_rows)
        if hi > lo:
            out.append(RowRange(r.file_index, r.row_group, r.start + lo, r.start + hi))
        position += r.num_rows
        if position >= end:
            break
    return tuple(out)


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
    total = sum(g.num_rows for g in groups)
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
    stream = [RowRange(groups[i].file_index, groups[i].row_group, 0, groups[i].num_rows) for i in order]
    ranges = cut_ranges(stream, begin, end)
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
