"""Writing one split of an imported dataset (or a partition) into Parquet files of a bounded
number of rows, in row groups of a fixed number of rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from neorec.ingest.schema import PARQUET_WRITE_OPTIONS


class SplitWriter:
    """One split's rows into ``SPLIT-00000.parquet``, … of ``file_rows`` rows each, in row
    groups of ``row_group_rows``. As a context manager, it is closed when the block ends
    (:meth:`close`, or :meth:`abandon` when the block raised)."""

    def __init__(self, out: Path, split: str, schema: pa.Schema, row_group_rows: int, file_rows: int) -> None:
        self.out = out
        self.split = split
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.file_rows = file_rows
        self.files: list[str] = []
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self._pending.append(table.cast(self.schema))
            self._pending_rows += table.num_rows
            self.rows += table.num_rows
        while self._pending_rows >= self.row_group_rows:
            self._flush(self.row_group_rows)

    def _flush(self, rows: int) -> None:
        pending = pa.concat_tables(self._pending)
        group, rest = pending.slice(0, rows), pending.slice(rows)
        if self._writer is None or self._in_file >= self.file_rows:
            self._open_next()
        self._writer.write_table(group, row_group_size=rows)
        self._in_file += group.num_rows
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def _open_next(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"{self.split}-{len(self.files):05d}.parquet"
        self._writer = pq.ParquetWriter(self.out / name, self.schema, **PARQUET_WRITE_OPTIONS)
        self.files.append(name)
        self._in_file = 0

    def close(self) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "SplitWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()

    def abandon(self) -> None:
        """Close the file being written, after a failure: what closing it raises (a writer
        the disk already refused fails again) would hide the failure itself."""
        if self._writer is not None:
            try:
                self._writer.close()
            except (OSError, pa.ArrowException):
                pass
