"""The in-process reader: planned row ranges → exact-size batches, without transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

from ingest.batch import HostBatch, Provenance, RowRange
from ingest.decoder import DecodeOptions, open_files, read_row_range
from ingest.plan import RankPlan, ReadTask, plan_epoch, row_groups_of
from ingest.schema import Dataset, DatasetSchema


@dataclass(frozen=True)
class ReaderConfig:
    """What determines a rank's batch sequence (besides the dataset and the epoch)."""

    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    remainder: str = "drop"
    shuffle: bool = True


class BatchReader(Protocol):
    """What the trainer reads from: a rank's planned batches of one split, epoch by epoch."""

    def plan(self, epoch: int) -> RankPlan: ...

    def epoch(self, epoch: int) -> Iterator[HostBatch]: ...

    def close(self) -> None: ...


class SplitPlanner:
    """Plans one rank's epochs of one split of a dataset from the files' Parquet footers."""

    def __init__(self, dataset: Dataset, split: str, config: ReaderConfig) -> None:
        self.dataset = dataset
        self.config = config
        self.paths = [str(p) for p in dataset.files(split)]
        self.files = open_files(self.paths, dataset.schema)
        self.groups = row_groups_of(self.files)

    def plan(self, epoch: int) -> RankPlan:
        c = self.config
        return plan_epoch(
            self.groups,
            seed=c.seed,
            epoch=epoch,
            rank=c.rank,
            world_size=c.world_size,
            batch_size=c.batch_size,
            remainder=c.remainder,
            shuffle=c.shuffle,
        )

    def close(self) -> None:
        for parquet_file in self.files:
            parquet_file.close()


class InProcessReader:
    """Reads one split of a dataset for one rank, decoding in the calling thread.

    ``epoch(e)`` yields exactly ``plan(e).num_batches`` batches of ``batch_size`` samples,
    each with its :class:`Provenance`.
    """

    def __init__(self, dataset: Dataset, split: str, options: DecodeOptions, config: ReaderConfig) -> None:
        self.dataset = dataset
        self.options = options
        self.planner = SplitPlanner(dataset, split, config)

    def plan(self, epoch: int) -> RankPlan:
        return self.planner.plan(epoch)

    def decode(self, row_range: RowRange) -> HostBatch:
        index = row_range.file_index
        return read_row_range(
            self.planner.files[index], self.planner.paths[index], row_range, self.dataset.schema, self.options
        )

    def epoch(self, epoch: int) -> Iterator[HostBatch]:
        task = self.plan(epoch).whole()
        chunks = ((r, self.decode(r)) for r in task.ranges)
        yield from batches_from_chunks(task, chunks, self.dataset.schema)

    def close(self) -> None:
        self.planner.close()


def batches_from_chunks(
    task: ReadTask, chunks: Iterable[tuple[RowRange, HostBatch]], schema: DatasetSchema
) -> Iterator[HostBatch]:
    """Cut decoded row ranges (in ``task`` order) into the task's batches, padding the tail."""
    empty = HostBatch.empty(schema.feature_names, len(schema.dense))  # start of an all-padding batch
    size = task.batch_size
    parts: list[tuple[RowRange, HostBatch]] = []  # pieces of the batch being filled
    filled = 0
    step = task.first_step
    for row_range, chunk in chunks:
        rows = chunk.batch_size
        bounds = [0, *range(size - filled, rows, size), rows]
        for lo, hi, piece in zip(bounds[:-1], bounds[1:], chunk.split(bounds)):
            r = row_range
            parts.append((RowRange(r.file_index, r.row_group, r.start + lo, r.start + hi), piece))
            filled += hi - lo
            if filled == size:
                yield _stamped(parts, empty, task.epoch, step, size)
                parts, filled = [], 0
                step += 1
    while step < task.first_step + task.num_batches:
        yield _stamped(parts, empty, task.epoch, step, size)
        parts = []
        step += 1


def _stamped(
    taken: list[tuple[RowRange, HostBatch]], empty: HostBatch, epoch: int, step: int, size: int
) -> HostBatch:
    parts = [chunk for _, chunk in taken] or [empty]
    batch = HostBatch.concat(parts).padded_to(size)
    batch.provenance = Provenance(epoch=epoch, step=step, rows=tuple(r for r, _ in taken))
    return batch

