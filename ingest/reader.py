"""The in-process reader: planned row ranges → exact-size batches, without transport."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import pyarrow as pa

from neorec.ingest.batch import BatchPieces, HostBatch, Piece
from neorec.ingest.chunks import ChunkDecoder
from neorec.ingest.decoder import DecodeOptions, open_files, read_row_group
from neorec.ingest.partitions import row_count_problem
from neorec.ingest.plan import RankPlan, ReadTask, plan_epoch, row_groups_of
from neorec.ingest.rows import RowGroupInfo, RowSpan
from neorec.ingest.schema import Dataset, DatasetSchema


@dataclass(frozen=True)
class ReaderConfig:
    """What determines a rank's batch sequence (besides the dataset and the epoch).

    ``shuffle``: ``rows``, ``row_groups`` or ``none`` (see :mod:`neorec.ingest.plan`);
    ``window``: row groups per row-shuffling window (0: about
    :data:`~neorec.ingest.plan.WINDOW_ROWS` rows)."""

    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    remainder: str = "drop"
    shuffle: str = "rows"
    window: int = 0


class BatchReader(Protocol):
    """What the trainer reads from: a rank's planned batches of one split, epoch by epoch.

    ``epoch(e, first_step)`` yields the planned batches of epoch ``e`` from step
    ``first_step`` on (a resumed run starts mid-epoch)."""

    def plan(self, epoch: int) -> RankPlan: ...

    def epoch(self, epoch: int, first_step: int = 0) -> Iterator[HostBatch]: ...

    def close(self) -> None: ...


class SplitPlanner:
    """Plans one rank's epochs of one split of a dataset from the files' Parquet footers;
    :class:`DataError` when they hold another number of rows than the dataset gives
    (:func:`~neorec.ingest.partitions.row_count_problem`)."""

    def __init__(self, dataset: Dataset, split: str, config: ReaderConfig) -> None:
        self.dataset = dataset
        self.config = config
        self.paths = [str(p) for p in dataset.files(split)]
        self.files = open_files(self.paths, dataset.schema)
        self.groups = row_groups_of(self.files)
        miscounted = row_count_problem(dataset, split, sum(g.num_rows for g in self.groups))
        if miscounted is not None:
            self.close()
            raise miscounted

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
            window=c.window,
        )

    def close(self) -> None:
        for parquet_file in self.files:
            parquet_file.close()


class InProcessReader:
    """Reads one split of a dataset for one rank, decoding in the calling thread.

    ``epoch(e)`` yields exactly ``plan(e).num_batches`` batches of ``batch_size`` samples,
    each with its :class:`Provenance`. The row groups of the window being read stay in
    memory until the next window (a permuted window's chunks read all of them), and a
    permuted window's chunks are gathered and decoded by a pool of Arrow's thread count.
    """

    def __init__(self, dataset: Dataset, split: str, options: DecodeOptions, config: ReaderConfig) -> None:
        self.dataset = dataset
        self.options = options
        self.planner = SplitPlanner(dataset, split, config)
        threads = pa.cpu_count()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gather") if threads > 1 else None
        self.decoder = ChunkDecoder(self._load, self.planner.paths, dataset.schema, options, self._pool, threads)
        self._window_tables: dict[RowGroupInfo, pa.Table] = {}

    def plan(self, epoch: int) -> RankPlan:
        return self.planner.plan(epoch)

    def _load(self, group: RowGroupInfo) -> pa.Table:
        table = self._window_tables.get(group)
        if table is None:
            index = group.file_index
            table = read_row_group(self.planner.files[index], self.planner.paths[index], group.row_group,
                                   self.dataset.schema)
            self._window_tables[group] = table
        return table

    def epoch(self, epoch: int, first_step: int = 0) -> Iterator[HostBatch]:
        task = self.plan(epoch).whole().after(first_step)
        try:
            yield from batches_from_chunks(task, self._chunks(task), self.dataset.schema)
        finally:
            self._window_tables.clear()

    def _chunks(self, task: ReadTask) -> Iterator[tuple[RowSpan, HostBatch]]:
        for span in task.spans:
            self._window_tables.clear()  # keep only the current window's row groups
            yield from self.decoder.chunks(span)

    def close(self) -> None:
        self.planner.close()
        if self._pool is not None:
            self._pool.shutdown()


def batch_pieces(
    task: ReadTask, chunks: Iterable[tuple[RowSpan, HostBatch]], schema: DatasetSchema
) -> Iterator[BatchPieces]:
    """Cut decoded spans (in ``task`` order) into the task's batches, padding the tail; each
    batch as the pieces of chunks it takes (copied into one by
    :meth:`~neorec.ingest.batch.BatchPieces.assembled`, or straight into a message by a
    reader service)."""
    empty = HostBatch.empty(schema.feature_names, len(schema.dense))  # start of an all-padding batch
    size = task.batch_size
    parts: list[tuple[RowSpan, Piece]] = []  # pieces of the batch being filled
    filled = 0
    step = task.first_step
    for span, chunk in chunks:
        rows = chunk.batch_size
        if rows == 0:
            continue
        bounds = [0, *range(size - filled, rows, size), rows]
        for piece in chunk.pieces(bounds):
            parts.append((span.sub(piece.lo, piece.hi), piece))
            filled += piece.num_samples
            if filled == size:
                yield BatchPieces(task.epoch, step, size, tuple(parts), empty)
                parts, filled = [], 0
                step += 1
    while step < task.first_step + task.num_batches:
        yield BatchPieces(task.epoch, step, size, tuple(parts), empty)
        parts = []
        step += 1


def batches_from_chunks(
    task: ReadTask, chunks: Iterable[tuple[RowSpan, HostBatch]], schema: DatasetSchema
) -> Iterator[HostBatch]:
    """Cut decoded spans (in ``task`` order) into the task's batches, padding the tail."""
    for pieces in batch_pieces(task, chunks, schema):
        yield pieces.assembled()
