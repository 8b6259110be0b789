"""Reading a user's files as record batches: CSV/TSV streamed in blocks, Parquet row group
by row group, from local paths (globs expanded) or any pyarrow filesystem URI
(``s3://bucket/logs/*.csv`` included). Each batch comes with its file and the number of its
first row, so an error can name both."""

from __future__ import annotations

import fnmatch
import glob
from dataclasses import dataclass
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from neorec.ingest.errors import DataError

BLOCK_BYTES = 16 << 20
"""CSV bytes parsed at a time (one batch): memory stays bounded whatever the file's size."""


@dataclass(frozen=True)
class SourceFile:
    """A file to read: ``path`` on ``filesystem``, ``name`` as the user wrote it."""

    name: str
    path: str
    filesystem: pafs.FileSystem


@dataclass(frozen=True)
class Block:
    """Rows ``[first_row, first_row + batch.num_rows)`` (0-based, data rows) of ``file``."""

    batch: pa.RecordBatch
    file: str
    first_row: int


def expand(patterns: Sequence[str]) -> list[SourceFile]:
    """The files ``patterns`` name, in order (a glob's matches sorted); a pattern matching
    nothing is a :class:`DataError` naming it."""
    out: list[SourceFile] = []
    for pattern in patterns:
        if "://" in pattern:
            filesystem, path = pafs.FileSystem.from_uri(pattern)
            if any(c in path for c in "*?["):
                selector = pafs.FileSelector(path.rsplit("/", 1)[0], recursive=False)
                matches = sorted(info.path for info in filesystem.get_file_info(selector)
                                 if info.type == pafs.FileType.File and fnmatch.fnmatch(info.path, path))
            else:
                matches = [path] if filesystem.get_file_info(path).type == pafs.FileType.File else []
            out += [SourceFile(f"{pattern.split('://')[0]}://{m}", m, filesystem) for m in matches]
        else:
            matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
            matches = [m for m in matches if pafs.LocalFileSystem().get_file_info(m).type == pafs.FileType.File]
            out += [SourceFile(m, m, pafs.LocalFileSystem()) for m in matches]
        if not matches:
            raise DataError("no such file (or no file matches)", file=pattern)
    return out


def read_blocks(file: SourceFile, format: str, *, header: bool = True, column_names: Sequence[str] = (),
                delimiter: str = ",", columns: Sequence[str] | None = None,
                string_columns: Sequence[str] = ()) -> Iterator[Block]:
    """The rows of ``file`` in blocks. CSV/TSV values are parsed by type inference, except
    ``string_columns``, kept as strings (ids: ``007`` must not become 7); an empty field
    is missing. ``columns``: read only these (all when None)."""
    try:
        if format == "parquet":
            yield from _parquet_blocks(file, columns)
            return
        yield from _csv_blocks(file, header, column_names, delimiter, columns, string_columns)
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as err:  # KeyError: a named column the file lacks
        raise DataError(f"cannot read it as {format}: {_first_line(err)}", file=file.name) from None


def _csv_blocks(file: SourceFile, header: bool, column_names: Sequence[str], delimiter: str,
                columns: Sequence[str] | None, string_columns: Sequence[str]) -> Iterator[Block]:
    read = pacsv.ReadOptions(column_names=list(column_names) or None, block_size=BLOCK_BYTES,
                             skip_rows=1 if header and column_names else 0,
                             autogenerate_column_names=False)
    parse = pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if delimiter == "," else False)
    convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in string_columns},
                                   include_columns=list(columns) if columns is not None else None,
                                   strings_can_be_null=True, quoted_strings_can_be_null=True)
    stream = file.filesystem.open_input_stream(file.path, compression="detect")
    with pacsv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert) as reader:
        first = 0
        for batch in reader:
            yield Block(batch, file.name, first)
            first += batch.num_rows


def _parquet_blocks(file: SourceFile, columns: Sequence[str] | None) -> Iterator[Block]:
    with file.filesystem.open_input_file(file.path) as handle:
        parquet = pq.ParquetFile(handle)
        first = 0
        for batch in parquet.iter_batches(columns=list(columns) if columns is not None else None):
            yield Block(batch, file.name, first)
            first += batch.num_rows


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
