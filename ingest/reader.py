"""The in-process reader: planned row ranges → exact-size batches, without transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ingest.batch import HostBatch, Provenance, RowRange
from ingest.decoder import DecodeOptions, open_files, read_row_range
from ingest.plan import RankPlan, plan_epoch, row_groups_of
from ingest.schema import Dataset


@dataclass(frozen=True)
class ReaderConfig:
    """What determines a rank's batch sequence (besides the dataset and the epoch)."""

    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    remainder: str = "drop"
    shuffle: bool = True


class InProcessReader:
    """Reads one split of a dataset for one rank, decoding in the calling thread.

    ``epoch(e)`` yields exactly ``plan(e).num_batches`` batches of ``batch_size`` samples,
    each with its :class:`Provenance`.
    """

    def __init__(self, dataset: Dataset, split: str, options: DecodeOptions, config: ReaderConfig) -> None:
        self.dataset = dataset
        self.split = split
        self.options = options
        self.config = config
        self.paths = [str(p) for p in dataset.files(split)]
        self._files = open_files(self.paths, dataset.schema)
        self._groups = row_groups_of(self._files)

    def plan(self, epoch: int) -> RankPlan:
        c = self.config
        return plan_epoch(
            self._groups,
            seed=c.seed,
            epoch=epoch,
            rank=c.rank,
            world_size=c.world_size,
            batch_size=c.batch_size,
            remainder=c.remainder,
            shuffle=c.shuffle,
        )

    def decode(self, row_range: RowRange) -> HostBatch:
        return read_row_range(
            self._files[row_range.file_index],
            self.paths[row_range.file_index],
            row_range,
            self.dataset.schema,
            self.options,
        )

    def epoch(self, epoch: int) -> Iterator[HostBatch]:
        plan = self.plan(epoch)
        chunks = ((r, self.decode(r)) for r in plan.ranges)
        empty = HostBatch.empty(self.dataset.schema.feature_names, len(self.dataset.schema.dense))
        yield from batches_from_chunks(plan, chunks, empty)


def batches_from_chunks(
    plan: RankPlan, chunks: Iterator[tuple[RowRange, HostBatch]], empty: HostBatch
) -> Iterator[HostBatch]:
    """Cut decoded row ranges (in plan order) into the plan's batches, padding the tail.

    ``empty`` is a zero-sample batch of the dataset's layout, the start of an all-padding
    batch.
    """
    size = plan.batch_size
    pending: list[_Pending] = []
    pending_rows = 0
    step = 0
    for row_range, chunk in chunks:
        pending.append(_Pending(row_range, chunk, 0))
        pending_rows += chunk.batch_size
        while pending_rows >= size:
            yield _stamped(_take(pending, size), empty, plan.epoch, step, size)
            pending_rows -= size
            step += 1
    while step < plan.num_batches:
        yield _stamped(_take(pending, min(pending_rows, size)), empty, plan.epoch, step, size)
        pending_rows = 0
        step += 1


@dataclass
class _Pending:
    """A decoded row range of which samples ``[taken, B)`` are not yet in a batch."""

    row_range: RowRange
    chunk: HostBatch
    taken: int


def _take(pending: list[_Pending], count: int) -> list[tuple[RowRange, HostBatch]]:
    """Remove ``count`` samples from the front of ``pending`` (in place)."""
    out = []
    while count > 0:
        head = pending[0]
        n = min(count, head.chunk.batch_size - head.taken)
        lo, hi = head.taken, head.taken + n
        part = head.chunk if (lo, hi) == (0, head.chunk.batch_size) else head.chunk.slice(lo, hi)
        r = head.row_range
        out.append((RowRange(r.file_index, r.row_group, r.start + lo, r.start + hi), part))
        head.taken = hi
        if hi == head.chunk.batch_size:
            pending.pop(0)
        count -= n
    return out


def _stamped(
    taken: list[tuple[RowRange, HostBatch]], empty: HostBatch, epoch: int, step: int, size: int
) -> HostBatch:
    parts = [chunk for _, chunk in taken] or [empty]
    batch = HostBatch.concat(parts).padded_to(size)
    batch.provenance = Provenance(epoch=epoch, step=step, rows=tuple(r for r, _ in taken))
    return batch
