"""Reading a user's files as record batches: CSV/TSV streamed in blocks, Parquet row group
by row group, from local paths (globs expanded) or any pyarrow filesystem URI
(``s3://bucket/logs/*.csv`` included). Each batch comes with its file and the number of its
first row, so an error can name both."""

from __future__ import annotations

import copy
import fnmatch
import glob
import io
import os
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from neorec.common.wording import counted
from neorec.ingest.errors import DataError

BLOCK_BYTES = 16 << 20
"""CSV bytes parsed at a time (one batch): memory stays bounded whatever the file's size."""
LINE_SCAN_BYTES = 1 << 30
"""How far into a file (uncompressed) a bad row's line is looked for, to name its row."""
ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz")
"""Archives of files, which must be extracted first (a compressed file, ``.gz`` and the
like, is read as it is)."""


@dataclass(frozen=True)
class SourceFile:
    """A file to read: ``path`` on ``filesystem``, ``name`` as the user wrote it."""

    name: str
    path: str
    filesystem: pafs.FileSystem

    @property
    def identity(self) -> str:
        """The same for every way of writing the path of the same file (a local path
        resolved: ``a/../b`` and ``./b`` are ``b``)."""
        if isinstance(self.filesystem, pafs.LocalFileSystem):
            return os.path.realpath(self.path)
        return f"{self.filesystem.type_name}://{self.path}"


@dataclass(frozen=True)
class Block:
    """Rows ``[first_row, first_row + batch.num_rows)`` (0-based, data rows) of ``file``."""

    batch: pa.RecordBatch
    file: str
    first_row: int


def expand(patterns: Sequence[str]) -> list[SourceFile]:
    """The files ``patterns`` name, in order (a glob's matches sorted, numbers by value:
    ``day_2`` before ``day_10``); a pattern matching nothing, or naming a directory, is a
    :class:`DataError` naming it."""
    out: list[SourceFile] = []
    for pattern in patterns:
        if "://" in pattern:
            filesystem, path = pafs.FileSystem.from_uri(pattern)
            if _is_glob(path):
                selector = pafs.FileSelector(path.rsplit("/", 1)[0], recursive=False)
                matches = [info.path for info in filesystem.get_file_info(selector)
                           if info.type == pafs.FileType.File and fnmatch.fnmatch(info.path, path)]
            else:
                matches = [path] if _is_file(filesystem, pattern, path) else []
            out += [SourceFile(f"{pattern.split('://')[0]}://{m}", m, filesystem) for m in in_order(matches)]
        else:
            filesystem = pafs.LocalFileSystem()
            if _is_glob(pattern):
                matches = [m for m in glob.glob(pattern) if filesystem.get_file_info(m).type == pafs.FileType.File]
            else:
                matches = [pattern] if _is_file(filesystem, pattern, pattern) else []
            out += [SourceFile(m, m, filesystem) for m in in_order(matches)]
        if not matches:
            raise DataError("no such file (or no file matches)", file=pattern)
    return out


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _is_file(filesystem: pafs.FileSystem, name: str, path: str) -> bool:
    """Whether ``path`` is a file; a directory is a :class:`DataError` naming it."""
    kind = filesystem.get_file_info(path).type
    if kind == pafs.FileType.Directory:
        raise DataError("a directory: name its files (or a glob of them, e.g. 'DIR/*')", file=name)
    return kind == pafs.FileType.File


def in_order(paths: Sequence[str]) -> list[str]:
    """``paths`` sorted by :func:`natural_key`, ties (``7``, ``07``) by the text."""
    return sorted(paths, key=lambda path: (natural_key(path), path))


def natural_key(text: str) -> list[str | int]:
    """``text`` with its runs of digits compared by value: ``day_2`` before ``day_10``."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split("([0-9]+)", text))]  # odd: digits


def read_blocks(file: SourceFile, format: str, *, header: bool = True, column_names: Sequence[str] = (),
                delimiter: str = ",", columns: Sequence[str] | None = None,
                string_columns: Sequence[str] = ()) -> Iterator[Block]:
    """The rows of ``file`` in blocks. CSV/TSV values are parsed by type inference, except
    ``string_columns``, kept as strings (ids: ``007`` must not become 7); an empty field
    is missing. ``columns``: read only these (all when None)."""
    if format != "parquet":
        yield from _csv_blocks(file, format, header, column_names, delimiter, columns, string_columns)
        return
    try:
        yield from _parquet_blocks(file, columns)
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as err:  # KeyError: a named column the file lacks
        raise DataError(f"cannot read it as {format}: {_first_line(err)}", file=file.name) from None


def _csv_blocks(file: SourceFile, format: str, header: bool, column_names: Sequence[str], delimiter: str,
                columns: Sequence[str] | None, string_columns: Sequence[str]) -> Iterator[Block]:
    read = pacsv.ReadOptions(column_names=list(column_names) or None, block_size=BLOCK_BYTES,
                             skip_rows=1 if header and column_names else 0,
                             autogenerate_column_names=False)
    parse = pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if delimiter == "," else False)
    convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in string_columns},
                                   include_columns=list(columns) if columns is not None else None,
                                   strings_can_be_null=True, quoted_strings_can_be_null=True)
    first = 0
    for batch in csv_batches(file, read, parse, convert, format):
        yield Block(batch, file.name, first)
        first += batch.num_rows


def csv_batches(file: SourceFile, read: pacsv.ReadOptions, parse: pacsv.ParseOptions,
                convert: pacsv.ConvertOptions, what: str) -> Iterator[pa.RecordBatch]:
    """The record batches of a delimited file (compressed or not), ``read.block_size`` bytes
    at a time. A file that cannot be read as ``what`` is a :class:`DataError` naming it; a
    row with the wrong number of fields, one naming its row too (``parse`` with an
    ``invalid_row_handler`` of this function's own)."""
    if file.name.lower().endswith(ARCHIVES):
        raise DataError("an archive: extract its files, and name those", file=file.name)
    invalid: list[pacsv.InvalidRow] = []

    def remember(row: pacsv.InvalidRow) -> str:
        invalid.append(row)
        return "error"

    parse = copy.copy(parse)
    parse.invalid_row_handler = remember
    try:
        _check_text(file)
        with file.filesystem.open_input_stream(file.path, compression="detect") as stream, \
                pacsv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert) as reader:
            yield from reader
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as err:  # KeyError: a named column the file lacks
        if invalid:
            raise _wrong_width(file, invalid[0], read) from None
        raise DataError(f"cannot read it as {what}: {_first_line(err)}", file=file.name) from None


SNIFFED_BYTES = 4096
"""The bytes (decompressed) a delimited file's start is read for, to tell text from binary."""


def _check_text(file: SourceFile) -> None:
    """A :class:`DataError` naming ``file`` when its first bytes hold a NUL, which no
    delimited text holds: a Parquet file (or another binary one) given as text, whose
    lines Arrow would split and decode into garbage."""
    with file.filesystem.open_input_stream(file.path, compression="detect") as stream:
        head = stream.read(SNIFFED_BYTES)
    if b"\0" in head:
        kind = "a Parquet file" if head.startswith(b"PAR1") else "a binary file (it holds NUL bytes)"
        raise DataError(f"{kind}, not delimited text: give text files here (Parquet is imported with "
                        f"input.format = 'parquet')", file=file.name)


def _wrong_width(file: SourceFile, row: pacsv.InvalidRow, read: pacsv.ReadOptions) -> DataError:
    """The error of a row with the wrong number of fields, naming its (1-based, data) row:
    the first line of its text (a row whose quoted field is never closed runs on over
    the lines after it)."""
    first_line, *more = row.text.rstrip("\r\n").split("\n", 1)
    line = _line_of(file, first_line, read.encoding)
    header = read.skip_rows + (0 if read.column_names or read.autogenerate_column_names else 1)
    problem = f"{counted(row.actual_columns, 'field')}, expected {row.expected_columns}"
    if more and '"' in row.text:
        problem += "; a quote opened in this row runs over the lines after it: is it closed?"
    return DataError(problem, file=file.name, row=line - header if line is not None else None)


def _line_of(file: SourceFile, text: str, encoding: str) -> int | None:
    """The 1-based number of the first line of ``file`` that reads ``text`` (None: none
    does within its first :data:`LINE_SCAN_BYTES`, or the file cannot be read again). A
    scan of the file: for an error's message only."""
    try:
        wanted = text.rstrip("\r\n").encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return None
    scanned = 0
    try:
        with file.filesystem.open_input_stream(file.path, compression="detect") as stream:
            for number, line in enumerate(io.BufferedReader(stream, 1 << 20), 1):
                if line.rstrip(b"\r\n") == wanted:
                    return number
                scanned += len(line)
                if scanned > LINE_SCAN_BYTES:
                    return None
    except OSError:
        return None
    return None


def _parquet_blocks(file: SourceFile, columns: Sequence[str] | None) -> Iterator[Block]:
    with file.filesystem.open_input_file(file.path) as handle:
        parquet = pq.ParquetFile(handle, page_checksum_verification=True)  # of pages that carry one
        first = 0
        for batch in parquet.iter_batches(columns=list(columns) if columns is not None else None):
            yield Block(batch, file.name, first)
            first += batch.num_rows


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
