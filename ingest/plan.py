"""Epoch planning from Parquet metadata: which rows each trainer rank reads, in which order.

Every epoch the row groups of a split are arranged into a sequence of windows
(:class:`~neorec.ingest.rows.Window`) from ``(seed, epoch)``, as the shuffle mode says:

- ``rows``: the row groups in a shuffled order, taken ``window`` at a time; each window's
  rows are permuted by a seed drawn from ``(seed, epoch, window index)``, so a batch mixes
  rows of many row groups and a split of one row group is fully shuffled;
- ``row_groups``: the row groups shuffled, each its own window, rows in file order;
- ``none``: the row groups in file order, rows in file order.

The windows' rows form one stream; the stream is cut into ``world_size`` contiguous,
equal parts of whole batches, one per rank. The plan is a function of (files' metadata,
seed, epoch, rank, world size, batch size, shuffle mode, window) alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq

from neorec.common.hashing import combine, permutation
from neorec.ingest.rows import RowGroupInfo, RowSpan, Window, cut_spans

REMAINDER_POLICIES = ("drop", "pad")
SHUFFLE_MODES = ("rows", "row_groups", "none")
WINDOW_ROWS = 262_144
"""Rows a row-shuffling window holds at least, when its size in row groups is left to the
planner (:func:`auto_window`): enough to mix rows of several typical 64k-row groups while
a reader holds one window's rows in memory."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of one epoch.

    ``spans`` are read in order and cut into ``num_batches`` batches of ``batch_size``
    samples; with the ``pad`` policy the last batches may hold ``padded_samples`` padding
    samples in all. ``total_rows`` counts the rows of the whole epoch (all ranks),
    ``dropped_rows`` those of them not read.
    """

    epoch: int
    rank: int
    world_size: int
    batch_size: int
    spans: tuple[RowSpan, ...]
    num_batches: int
    padded_samples: int
    dropped_rows: int
    total_rows: int

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.spans)

    def whole(self) -> "ReadTask":
        """The whole plan as one task."""
        return ReadTask(self.epoch, 0, self.num_batches, self.batch_size, self.spans)

    def tasks(self, batches_per_task: int, first_step: int = 0) -> list["ReadTask"]:
        """The plan from step ``first_step`` on, cut into consecutive tasks of
        ``batches_per_task`` batches (the last may hold fewer): units of work a reader
        service can be asked for."""
        return self.whole().after(first_step).split(batches_per_task)


@dataclass(frozen=True)
class ReadTask:
    """Batches ``[first_step, first_step + num_batches)`` of a rank's epoch.

    ``spans`` hold the task's rows in order; they fill its batches one after the other
    and padding completes the last ones (all of them, for a task past the rank's rows).
    """

    epoch: int
    first_step: int
    num_batches: int
    batch_size: int
    spans: tuple[RowSpan, ...]

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.spans)

    def batch_rows(self, index: int) -> tuple[RowSpan, ...]:
        """The rows of the task's ``index``-th batch, in order."""
        return cut_spans(self.spans, index * self.batch_size, (index + 1) * self.batch_size)

    def after(self, done: int) -> "ReadTask":
        """The task without its first ``done`` batches."""
        if not 0 <= done <= self.num_batches:
            raise ValueError(f"cannot skip {done} of a task's {self.num_batches} batches")
        return ReadTask(
            self.epoch,
            self.first_step + done,
            self.num_batches - done,
            self.batch_size,
            cut_spans(self.spans, done * self.batch_size, self.num_rows),
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
                cut_spans(self.spans, first * size, (first + batches_per_task) * size),
            )
            for first in range(0, self.num_batches, batches_per_task)
        ]


def row_groups_of(files: Sequence[pq.ParquetFile]) -> list[RowGroupInfo]:
    """Row groups of opened ``files`` from their Parquet footers (no data is read); empty
    row groups are left out (they hold no rows to read)."""
    groups = []
    for file_index, parquet_file in enumerate(files):
        meta = parquet_file.metadata
        for rg in range(meta.num_row_groups):
            rows = meta.row_group(rg).num_rows
            if rows:
                groups.append(RowGroupInfo(file_index, rg, rows))
    return groups


def auto_window(groups: Sequence[RowGroupInfo]) -> int:
    """Row groups per row-shuffling window so that a window holds about
    :data:`WINDOW_ROWS` rows (at least one group)."""
    if not groups:
        return 1
    mean_rows = sum(g.num_rows for g in groups) / len(groups)
    return max(1, int(np.ceil(WINDOW_ROWS / max(mean_rows, 1.0))))


def epoch_windows(groups: Sequence[RowGroupInfo], seed: int, epoch: int, shuffle: str = "rows",
                  window: int = 0) -> list[Window]:
    """The windows of ``epoch`` in read order (``window``: row groups per window when
    shuffling rows; 0 picks :func:`auto_window`)."""
    if shuffle not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {shuffle!r}")
    if window < 0:
        raise ValueError(f"window must be >= 0 row groups, got {window}")
    if shuffle == "none":
        return [Window((g,)) for g in groups]
    order = [groups[i] for i in permutation(combine(seed, epoch), len(groups))]
    if shuffle == "row_groups":
        return [Window((g,)) for g in order]
    size = window or auto_window(groups)
    return [Window(tuple(order[i : i + size]), seed=combine(seed, epoch, i // size))
            for i in range(0, len(order), size)]


def plan_epoch(
    groups: Sequence[RowGroupInfo],
    *,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    batch_size: int,
    remainder: str = "drop",
    shuffle: str = "rows",
    window: int = 0,
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
    windows = epoch_windows(groups, seed, epoch, shuffle, window)
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
    stream = [RowSpan(w, 0, w.num_rows) for w in windows]
    return RankPlan(
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        spans=cut_spans(stream, begin, end),
        num_batches=num_batches,
        padded_samples=span - (end - begin),
        dropped_rows=dropped,
        total_rows=total,
    )
