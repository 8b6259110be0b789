"""A task's rows decoded as chunks, in read order: what the in-process reader and the reader
service both cut into batches.

A run of rows is decoded in chunks of at most :data:`CHUNK_ROWS`, fewer when the rows hold
many ids (:func:`chunk_rows`). An unpermuted window's
chunk is a slice of its row group. A permuted window's chunk (row-level shuffling) is
decoded from the Arrow tables of the window's row groups
(:class:`~neorec.ingest.take.WindowTables` of the raw columns), picking its rows, so each
row is still decoded and checked once, an error names the file, row group and row the bad
value came from, and no copy of the raw rows is written out for a whole window and read
back.
A permuted window's chunks are decoded up to :data:`LOCKSTEP_CHUNKS` together, column by
column (:func:`~neorec.ingest.decoder.decode_sources`): every chunk picks rows from every row
group of the window, so each column is read from memory once for all of them rather than
once a chunk; when they take a good share of the window's rows, each flat column is read
in one pass that routes every row to its chunk (:class:`~neorec.ingest.take.PickedTogether`).
With an executor, the columns are spread over its threads (the gathers and numpy's work
run without the GIL), and the next chunks decode while these are delivered.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import pyarrow as pa

from neorec.ingest.batch import BatchPieces, HostBatch
from neorec.ingest.decoder import DecodeOptions, Where, decode_sources, decode_table, run_in_order
from neorec.ingest.errors import DataError
from neorec.ingest.rows import RowGroupInfo, RowSpan, Window
from neorec.ingest.schema import DatasetSchema, SparseFeature
from neorec.ingest.take import PickedTogether, WindowTables
from neorec.ingest.wire import decode_batch, serialize_pieces

T = TypeVar("T")

CHUNK_ROWS = 65_536
"""Most rows decoded at once. Larger chunks allocate arrays beyond what the allocator keeps
for reuse (glibc hands blocks of more than 32 MiB back to the kernel at once), and the
page faults of fresh memory then cost more than the decoding."""
LOCKSTEP_CHUNKS = 4
"""Most chunks of a permuted window decoded together, column by column: each picks from
every row group of the window, whose columns together outgrow the caches, so a column is
best read once for several chunks; more chunks at once would hold more memory."""
CHUNK_ID_BYTES = 24 << 20
"""Most bytes of a chunk's ids (int64) at the rows' mean ids per row, below 32 MiB so that
a chunk whose rows hold more ids than the mean still fits: multi-hot rows of ~175 ids
fill 32 MiB in 24k rows, so their chunks are cut shorter than :data:`CHUNK_ROWS` (see
:func:`chunk_rows`)."""


class ChunkDecoder:
    """Decodes the rows of one split's tasks as chunks.

    ``load(group)`` returns the Arrow table of one row group (its caller may cache or share
    reads: a permuted window's chunks all read every group of the window);
    ``paths[file_index]`` names the files for errors. With an ``executor`` of ``workers``
    threads (which may run other tasks too, this decoder's callers among them), a permuted
    window's columns are decoded on up to ``workers`` of them, and its next chunks while
    these are delivered.
    """

    def __init__(self, load: Callable[[RowGroupInfo], pa.Table], paths: Sequence[str], schema: DatasetSchema,
                 options: DecodeOptions, executor: Executor | None = None, workers: int = 1) -> None:
        self.load = load
        self.paths = paths
        self.schema = schema
        self.options = options
        self.executor = executor
        self.workers = max(1, workers)

    def _load(self, group: RowGroupInfo) -> pa.Table:
        """The row group's table, which must hold the rows its metadata promised when the
        read was planned (the takes of a permuted window index it without bounds checks)."""
        table = self.load(group)
        if table.num_rows != group.num_rows:
            raise DataError(f"the row group holds {table.num_rows} rows, {group.num_rows} when the read was "
                            f"planned: the file changed", file=self.paths[group.file_index], row_group=group.row_group)
        return table

    def chunks(self, span: RowSpan) -> Iterator[tuple[RowSpan, HostBatch]]:
        """``span``'s rows decoded, as ``(piece, rows)`` pairs in read order."""
        window = span.window
        if not window.permuted and len(window.groups) == 1:
            group = window.groups[0]
            table = self._load(group)
            for piece in span.pieces(chunk_rows([table], self.schema)):
                yield piece, decode_table(table.slice(piece.start, piece.num_rows), self.schema, self.options,
                                          file=self.paths[group.file_index], row_group=group.row_group,
                                          first_row=piece.start)
            return
        loaded = [self._load(g) for g in window.groups]
        tables = WindowTables(loaded, window.group_starts())
        pieces = span.pieces(chunk_rows(loaded, self.schema))
        together = [pieces[at : at + LOCKSTEP_CHUNKS] for at in range(0, len(pieces), LOCKSTEP_CHUNKS)]
        if self.executor is None:
            for group in together:
                yield from zip(group, self._gathered(tables, group))
            return
        # the next group decodes on the executor while one is delivered
        decoding = self.executor.submit(self._gathered, tables, together[0])
        try:
            for at, group in enumerate(together):
                decoded = _outcome(decoding, self._gathered, tables, group)
                if at + 1 < len(together):
                    decoding = self.executor.submit(self._gathered, tables, together[at + 1])
                yield from zip(group, decoded)
        finally:
            decoding.cancel()

    def _gathered(self, tables: WindowTables, pieces: Sequence[RowSpan]) -> list[HostBatch]:
        """The rows of ``pieces`` (of one permuted window), gathered from ``tables`` (the
        window's row groups) and decoded together, column by column, the columns spread
        over the executor's threads and this one."""
        window = pieces[0].window
        order = window.order()
        starts = tables.starts
        first = window.groups[0]

        def where(positions: np.ndarray) -> Where:
            def locate(i: int) -> tuple[str, int, int]:
                p = int(positions[i])
                g = int(np.searchsorted(starts, p, side="right")) - 1
                group = window.groups[g]
                return self.paths[group.file_index], group.row_group, p - int(starts[g])

            return Where(self.paths[first.file_index], first.row_group, locate=locate)

        picks = [order[piece.start : piece.stop] for piece in pieces]
        picked = sum(p.size for p in picks)
        together = PickedTogether(tables, picks) if PickedTogether.worth_it(picked, window.num_rows) else None
        return decode_sources([tables.picked(positions) for positions in picks], [where(p) for p in picks],
                              self.schema, self.options, self._run, together)

    def _run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs`` on this thread, helped by up to ``workers - 1`` of the executor's."""
        if self.executor is None or self.workers == 1:
            run_in_order(jobs)
            return
        shared = _SharedJobs(jobs)
        for _ in range(self.workers - 1):
            self.executor.submit(shared.take)
        shared.take()
        shared.wait()


class _SharedJobs:
    """Jobs that several threads take, each the next not yet taken. ``wait`` waits for the
    jobs taken, not for the helpers: a helper queued behind busy threads finds none left
    when it starts, so a thread of the executor may wait without holding up the queue."""

    def __init__(self, jobs: Sequence[Callable[[], None]]) -> None:
        self._pending = iter(jobs)  # a list iterator hands each job out once, under the GIL
        self._left = len(jobs)
        self._done = threading.Condition()
        self._error: BaseException | None = None

    def take(self) -> None:
        for job in self._pending:
            try:
                job()
            except BaseException as err:  # raised by wait, in the thread that waits
                self._error = self._error or err
            finally:
                with self._done:
                    self._left -= 1
                    self._done.notify_all()

    def wait(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self._left == 0)
        if self._error is not None:
            raise self._error


def _outcome(future: Future, function: Callable[..., T], *args: Any) -> T:
    """``future``'s result, which is ``function(*args)``: computed in this thread if the
    future has not started, so that a thread of the executor never waits for a task
    queued behind it."""
    return function(*args) if future.cancel() else future.result()


def chunk_rows(tables: Sequence[pa.Table], schema: DatasetSchema) -> int:
    """Rows per chunk for rows of ``tables`` (raw row groups of ``schema``'s columns):
    :data:`CHUNK_ROWS`, or the largest power of two of rows whose ids, at the tables' mean
    ids per row, fit in :data:`CHUNK_ID_BYTES`."""
    rows = sum(t.num_rows for t in tables)
    ids = sum(_values_in(t.column(f.name)) if f.multi_hot else t.num_rows for t in tables for f in schema.sparse)
    if ids * 8 * CHUNK_ROWS <= CHUNK_ID_BYTES * rows:
        return CHUNK_ROWS
    fitting = max(1, CHUNK_ID_BYTES * rows // (ids * 8))
    return 1 << (fitting.bit_length() - 1)


def _values_in(column: pa.ChunkedArray) -> int:
    """Values of a list column, from its offsets (nothing else is read)."""
    return sum(chunk.offsets[-1].as_py() - chunk.offsets[0].as_py() for chunk in column.chunks if len(chunk))


def compile_decoding() -> None:
    """Decode small tables of the usual column types (float32 and float64 numbers, int64
    and int32 ids, lists of int64 and int32 ids with 32- and 64-bit offsets), with nulls,
    in order, picked from a window and routed from it, and send a batch through the wire
    format and check it as a reader service and its client do, so that this process
    compiles (or loads from Numba's cache) the decoding kernels a run calls. Launchers
    call it before starting processes that decode at once (see
    :mod:`neorec.trainer.run.warmup`); columns of other types compile on first use."""
    schema = DatasetSchema(label="y", dense=("f32", "f64", "i64", "i32"),
                           sparse=(SparseFeature("s64", 4), SparseFeature("s32", 4),
                                   *(SparseFeature(name, 4, multi_hot=True) for name in _LIST_TYPES)))
    options = DecodeOptions.for_schema(schema)
    valid = np.array([True, False, True])
    columns = {"y": pa.array([0.0, 1.0, 0.0], type=pa.float32()),
               **{name: pa.array([1, 2, 3], type=kind, mask=~valid) for name, kind in
                  (("f32", pa.float32()), ("f64", pa.float64()), ("i64", pa.int64()), ("i32", pa.int32()),
                   ("s64", pa.int64()), ("s32", pa.int32()))},
               **{name: pa.array([[1, 2], None, [3]], type=kind) for name, kind in _LIST_TYPES.items()}}
    table = pa.table(columns)
    _check_through_the_wire(decode_table(table, schema, options), options.table_rows)
    no_nulls = pa.table({name: column.fill_null(0) if name in ("s64", "s32") else column
                         for name, column in columns.items()})
    for tables in ([table, table], [no_nulls]):
        starts = np.arange(len(tables) + 1, dtype=np.int64) * 3
        positions = np.arange(starts[-1], dtype=np.int64)[::-1].copy()
        positions.flags.writeable = False  # as a window's read order is (Window.order)
        window = WindowTables(tables, starts)
        decode_table(window.picked(positions), schema, options)
        decode_sources([window.picked(positions)], [Where()], schema, options,
                       together=PickedTogether(window, [positions]))


def _check_through_the_wire(chunk: HostBatch, table_rows: Sequence[int]) -> None:
    """Send a batch of two pieces of ``chunk`` and a padding sample through the wire format
    and check it, as a reader service and its client do with every batch."""
    size = chunk.batch_size
    window = Window((RowGroupInfo(0, 0, size),))
    parts = tuple((RowSpan(window, piece.lo, piece.hi), piece) for piece in chunk.pieces([0, 1, size]))
    batch = BatchPieces(0, 0, size + 1, parts, HostBatch.empty(chunk.keys, chunk.dense.shape[1]))
    decode_batch(serialize_pieces(batch, table_rows, {window: 0}), chunk.keys, [window]).check(table_rows)


_LIST_TYPES = {"l64": pa.list_(pa.int64()), "l32": pa.list_(pa.int32()), "ll64": pa.large_list(pa.int64())}
