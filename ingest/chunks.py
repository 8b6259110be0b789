"""A task's rows decoded as chunks, in read order: what the in-process reader and the reader
service both cut into batches.

A run of rows is decoded in chunks of at most :data:`CHUNK_ROWS`. An unpermuted window's
chunk is a slice of its row group. A permuted window's chunk (row-level shuffling) is
gathered from the Arrow tables of the window's row groups before decoding (Arrow's take
on the raw columns, one column per task of an executor when one is given: it runs without
the GIL), so each row is still decoded and checked once, and an error names the file, row
group and row the bad value came from.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from neorec.ingest.batch import HostBatch
from neorec.ingest.decoder import DecodeOptions, decode_table
from neorec.ingest.rows import RowGroupInfo, RowSpan
from neorec.ingest.schema import DatasetSchema

CHUNK_ROWS = 65_536
"""Rows decoded at once. Larger chunks allocate arrays beyond what the allocator keeps for
reuse (glibc hands blocks of more than 32 MiB back to the kernel at once), and the page
faults of fresh memory then cost more than the decoding."""

class ChunkDecoder:
    """Decodes the rows of one split's tasks as chunks.

    ``load(group)`` returns the Arrow table of one row group (its caller may cache or share
    reads: a permuted window's chunks all read every group of the window);
    ``paths[file_index]`` names the files for errors. With an ``executor``, a permuted
    window's columns are gathered in parallel (Arrow's take runs without the GIL).
    """

    def __init__(self, load: Callable[[RowGroupInfo], pa.Table], paths: Sequence[str], schema: DatasetSchema,
                 options: DecodeOptions, executor: Executor | None = None) -> None:
        self.load = load
        self.paths = paths
        self.schema = schema
        self.options = options
        self.executor = executor

    def chunks(self, span: RowSpan) -> Iterator[tuple[RowSpan, HostBatch]]:
        """``span``'s rows decoded, as ``(piece, rows)`` pairs in read order."""
        window = span.window
        if not window.permuted and len(window.groups) == 1:
            group = window.groups[0]
            table = self.load(group)
            for piece in span.pieces(CHUNK_ROWS):
                yield piece, decode_table(table.slice(piece.start, piece.num_rows), self.schema, self.options,
                                          file=self.paths[group.file_index], row_group=group.row_group,
                                          first_row=piece.start)
            return
        positions = window.order()[span.start : span.stop]
        starts = window.group_starts()
        taken = self._take(pa.concat_tables([self.load(g) for g in window.groups]), pa.array(positions))
        first = window.groups[0]
        for lo in range(0, span.num_rows, CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, span.num_rows)

            def locate(i: int, lo: int = lo) -> tuple[str, int, int]:
                p = int(positions[lo + i])
                g = int(np.searchsorted(starts, p, side="right")) - 1
                group = window.groups[g]
                return self.paths[group.file_index], group.row_group, p - int(starts[g])

            yield span.sub(lo, hi), decode_table(taken.slice(lo, hi - lo), self.schema, self.options,
                                                    file=self.paths[first.file_index], row_group=first.row_group,
                                                    locate=locate)

    def _take(self, table: pa.Table, indices: pa.Array) -> pa.Table:
        if self.executor is None:
            return table.take(indices)
        columns = list(self.executor.map(lambda column: column.take(indices), table.columns))
        return pa.Table.from_arrays(columns, schema=table.schema)
