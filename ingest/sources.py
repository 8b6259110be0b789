"""Reading a user's files as record batches: CSV/TSV streamed in blocks, Parquet row group
by row group, from local paths (globs expanded) or any pyarrow filesystem URI
(``s3://bucket/logs/*.csv`` included). Each batch comes with its file and the number of its
first row, so an error can name both: a delimited file's rows by the line they begin on
(:class:`TextLayout`), found only when an error is made, by reading the file again."""

from __future__ import annotations

import copy
import fnmatch
import glob
import io
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from neorec.common.wording import counted
from neorec.ingest.errors import DataError, WrongWidthError, no_column

if TYPE_CHECKING:
    from neorec.ingest.import_spec import ImportSpec

BLOCK_BYTES = 16 << 20
"""CSV bytes parsed at a time (one batch): memory stays bounded whatever the file's size."""
LINE_SCAN_BYTES = 1 << 30
"""How far into a file (uncompressed) a bad row's line is looked for, to name it."""
MISSING = [""]
"""The only text of a delimited file that is a missing value: an empty field (quoted or
not). Arrow's other default spellings (``NA``, ``null``, ``NaN``, …) are values."""
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
class TextLayout:
    """How the data rows of a delimited ``file`` lie on its lines: after ``skipped`` rows
    (blank lines included) and, if ``header``, a header row; blank lines between rows
    skipped; a ``quote`` (None: none) opening a field may hold line breaks."""

    file: SourceFile
    skipped: int = 0
    header: bool = False
    quote: str | None = None
    delimiter: str = ","

    def line_of(self, row: int) -> int | None:
        """The 1-based line data row ``row`` (0-based) begins on; None where that lies
        beyond the first :data:`LINE_SCAN_BYTES` or the file cannot be read again. A scan
        of the file: for an error's message only."""
        skip, header = self.skipped, self.header
        for number, blank in _records(self.file, self.quote, self.delimiter):
            if skip:
                skip -= 1
            elif blank:
                continue
            elif header:
                header = False
            elif row == 0:
                return number
            else:
                row -= 1
        return None


@dataclass(frozen=True)
class Block:
    """Rows ``[first_row, first_row + batch.num_rows)`` (0-based, data rows) of ``file``;
    ``layout``: where they lie on its lines (None: a file without lines, Parquet)."""

    batch: pa.RecordBatch
    file: str
    first_row: int
    layout: TextLayout | None = None

    def where(self, index: int) -> dict[str, int]:
        """The place of the block's row ``index`` (:func:`place`)."""
        return place(self.layout, self.first_row + index)


def place(layout: TextLayout | None, row: int) -> dict[str, int]:
    """The place of data row ``row`` (0-based) as :class:`DataError`'s keywords: the
    ``line`` it begins on, else (no ``layout``, or too far into the file) its 1-based data
    ``row``."""
    line = layout.line_of(row) if layout is not None else None
    return {"line": line} if line is not None else {"row": row + 1}


def expand(patterns: Sequence[str]) -> list[SourceFile]:
    """The files ``patterns`` name, in order (a glob's matches sorted, numbers by value:
    ``day_2`` before ``day_10``); a pattern matching nothing, or naming a directory, is a
    :class:`DataError` naming it, and so is a file named twice (its rows would be imported
    twice), however it is spelled."""
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
    seen: dict[object, str] = {}
    for source in out:
        same: object = source.identity
        if isinstance(source.filesystem, pafs.LocalFileSystem):
            stat = os.stat(source.path)
            same = (stat.st_dev, stat.st_ino)  # hard links too
        if same in seen:
            raise DataError(f"named twice (also as {seen[same]}): its rows would be imported twice", file=source.name)
        seen[same] = source.name
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
    (only: :data:`MISSING`) is missing. ``columns``: read only these (all when None)."""
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
                                   null_values=MISSING, strings_can_be_null=True,
                                   quoted_strings_can_be_null=True)
    layout = text_layout(file, read, parse)
    if layout.header:
        _check_header(file, delimiter)
    first = 0
    for batch in csv_batches(file, read, parse, convert, format):
        yield Block(batch, file.name, first, layout)
        first += batch.num_rows


def _check_header(file: SourceFile, delimiter: str) -> None:
    """A :class:`DataError` naming a column ``file``'s header line names twice (the reader
    would read one of them, silently)."""
    header = next((line for _, line in _lines(file)), b"")
    names = [name.strip(b'"').decode(errors="replace") for name in header.split(delimiter.encode())]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise DataError(f"the header names column {twice!r} twice", file=file.name, line=1)


def text_layout(file: SourceFile, read: pacsv.ReadOptions, parse: pacsv.ParseOptions) -> TextLayout:
    """Where the rows of ``file`` read with these options lie on its lines."""
    return TextLayout(file, read.skip_rows, _has_header(read), parse.quote_char or None, parse.delimiter)


def _has_header(read: pacsv.ReadOptions) -> bool:
    """Whether the reader takes the column names from the file's first row (after the skipped ones)."""
    return not (read.column_names or read.autogenerate_column_names)


def csv_batches(file: SourceFile, read: pacsv.ReadOptions, parse: pacsv.ParseOptions,
                convert: pacsv.ConvertOptions, what: str) -> Iterator[pa.RecordBatch]:
    """The record batches of a delimited file (compressed or not), ``read.block_size`` bytes
    at a time. A file that cannot be read as ``what`` is a :class:`DataError` naming it; a
    row with the wrong number of fields, one naming its row too (``parse`` with an
    ``invalid_row_handler`` of this function's own); a quote never closed in a row's last
    field, one naming the line it opens on (Arrow reads the rest of the file into that
    field, a row of the right width: found once the file is read, when it has more line
    breaks than rows)."""
    if file.name.lower().endswith(ARCHIVES):
        raise DataError("an archive: extract its files, and name those", file=file.name)
    invalid: list[pacsv.InvalidRow] = []

    def remember(row: pacsv.InvalidRow) -> str:
        invalid.append(row)
        return "error"

    parse = copy.copy(parse)
    parse.invalid_row_handler = remember
    rows = 0
    try:
        _check_text(file)
        with file.filesystem.open_input_stream(file.path, compression="detect") as stream, \
                pacsv.open_csv(counted := _LineBreakCounter(stream), read_options=read, parse_options=parse,
                               convert_options=convert) as reader:
            for batch in reader:
                rows += batch.num_rows
                yield batch
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as err:  # KeyError: a named column the file lacks
        if invalid:
            raise _wrong_width(file, invalid[0], read) from None
        missing = _missing_column(file, err, convert, read, parse) or _not_utf8(file, err, read, parse)
        if missing is not None:
            raise missing from None
        raise DataError(f"cannot read it as {what}: {_first_line(err)}", file=file.name) from None
    if parse.quote_char and counted.lines > rows + read.skip_rows + _has_header(read):  # values over several lines
        line = _unclosed_quote(file, parse.quote_char, parse.delimiter)
        if line is not None:
            raise DataError("a quote opened in this row is never closed: the rest of the file was read into one "
                            "field", file=file.name, line=line)


class _LineBreakCounter:
    """A readable stream passing ``stream``'s bytes on (to Arrow's reader), counting the
    lines among them (:attr:`lines`)."""

    def __init__(self, stream: pa.NativeFile) -> None:
        self.stream = stream
        self.line_breaks = 0
        self.last = b""
        self.closed = False

    @property
    def lines(self) -> int:
        """The lines read so far: a last line without a line break counts too."""
        return self.line_breaks + (self.last not in (b"", b"\n"))

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        if data:
            self.line_breaks += data.count(b"\n")
            self.last = data[-1:]
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def _unclosed_quote(file: SourceFile, quote: str, delimiter: str) -> int | None:
    """The 1-based line a row begins on whose quoted field is still open at the end of
    ``file`` (None when every quote closes): a scan of the whole file, line by line."""
    opened, quoted = 0, False
    for number, _, inside, quoted in _quote_states(_lines(file, limit=None), quote, delimiter):
        if not inside:
            opened = number
    return opened if quoted else None


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


def _missing_column(file: SourceFile, err: Exception, convert: pacsv.ConvertOptions, read: pacsv.ReadOptions,
                    parse: pacsv.ParseOptions) -> DataError | None:
    """The error naming the column to read that ``file`` lacks, when that is what ``err``
    (Arrow's) says, with the columns it has (its header read again)."""
    columns = convert.include_columns or []
    wanted = next((c for c in columns if isinstance(err, pa.ArrowKeyError) and repr(c) in str(err)), None)
    if wanted is None:
        return None
    try:
        with file.filesystem.open_input_stream(file.path, compression="detect") as stream, \
                pacsv.open_csv(stream, read_options=read, parse_options=parse) as reader:
            names = reader.schema.names
    except (pa.ArrowException, OSError):
        return None
    return no_column(wanted, names, file.name)


def _not_utf8(file: SourceFile, err: Exception, read: pacsv.ReadOptions, parse: pacsv.ParseOptions) -> DataError | None:
    """The error naming the first line of ``file`` that is not UTF-8, and its column, when
    that is what ``err`` (Arrow's) says: its lines read again (up to :data:`LINE_SCAN_BYTES`)."""
    if "invalid UTF8" not in str(err) or read.encoding.replace("-", "").lower() != "utf8":
        return None
    names = list(read.column_names)
    for number, line in _lines(file):
        fields = line.split(parse.delimiter.encode())
        if not names and number > read.skip_rows:
            names = [f.decode(errors="replace").strip('"') for f in fields]
        try:
            line.decode()
        except UnicodeDecodeError as bad:
            column = next((names[i] for i, f in enumerate(fields) if i < len(names) and not _is_utf8(f)), None)
            return DataError(f"not UTF-8 text (byte {line[bad.start:bad.start + 1]!r}); delimited files are read as "
                             f"UTF-8: convert it first (e.g. iconv -f latin1 -t utf-8)", file=file.name, column=column,
                             line=number)
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _wrong_width(file: SourceFile, row: pacsv.InvalidRow, read: pacsv.ReadOptions) -> DataError:
    """The error of a row with the wrong number of fields, naming its line: the first line
    of its text (a row whose quoted field is never closed runs on over the lines after
    it)."""
    first_line, *more = row.text.rstrip("\r\n").split("\n", 1)
    problem = f"{counted(row.actual_columns, 'field')}, expected {row.expected_columns}"
    if more and '"' in row.text:
        problem += "; a quote opened in this row runs over the lines after it: is it closed?"
    return WrongWidthError(problem, actual=row.actual_columns, expected=row.expected_columns, file=file.name,
                           line=_line_of(file, first_line, read.encoding))


def _line_of(file: SourceFile, text: str, encoding: str) -> int | None:
    """The 1-based number of the first line of ``file`` that reads ``text`` (None: none
    does within its first :data:`LINE_SCAN_BYTES`, or the file cannot be read again). A
    scan of the file: for an error's message only."""
    try:
        wanted = text.rstrip("\r\n").encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return None
    return next((number for number, line in _lines(file) if line == wanted), None)


def _lines(file: SourceFile, limit: int | None = LINE_SCAN_BYTES) -> Iterator[tuple[int, bytes]]:
    """The 1-based number and the text (its line break removed) of each line of ``file``
    within its first ``limit`` bytes (None: all of it); none once it cannot be read again."""
    scanned = 0
    try:
        with file.filesystem.open_input_stream(file.path, compression="detect") as stream:
            for number, line in enumerate(io.BufferedReader(stream, 1 << 20), 1):
                scanned += len(line)
                if limit is not None and scanned > limit:
                    return
                yield number, line.rstrip(b"\r\n")
    except OSError:
        return


def _records(file: SourceFile, quote: str | None, delimiter: str) -> Iterator[tuple[int, bool]]:
    """The 1-based line each row (record) of a delimited file begins on, and whether it is
    a blank line (:func:`_lines`' lines); a row may run over several lines inside a ``quote``."""
    for number, text, inside, _ in _quote_states(_lines(file), quote, delimiter):
        if not inside:
            yield number, not text


def _quote_states(lines: Iterable[tuple[int, bytes]], quote: str | None,
                  delimiter: str) -> Iterator[tuple[int, bytes, bool, bool]]:
    """Each of ``lines`` (number, text) with whether it begins, and whether it ends, inside
    a quoted field (never, without a ``quote``)."""
    quoted = False
    marks = (ord(quote), ord(delimiter)) if quote else None
    for number, text in lines:
        begins = quoted
        if marks is not None and (quoted or marks[0] in text):
            quoted = _ends_quoted(text, *marks, quoted)
        yield number, text, begins, quoted


def _ends_quoted(line: bytes, quote: int, delimiter: int, quoted: bool) -> bool:
    """Whether a line of a delimited file ends inside a quoted field, given whether it
    begins in one. Arrow's rules: a quote opens a field only as its first character; two
    quotes inside one are a quote."""
    at_start, i = not quoted, 0
    while i < len(line):
        char = line[i]
        if quoted and char == quote and line[i + 1:i + 2] == bytes((quote,)):
            i += 1
        elif quoted:
            quoted = char != quote
        elif char == quote and at_start:
            quoted = True
        at_start = not quoted and char == delimiter
        i += 1
    return quoted


def _parquet_blocks(file: SourceFile, columns: Sequence[str] | None) -> Iterator[Block]:
    with file.filesystem.open_input_file(file.path) as handle:
        parquet = pq.ParquetFile(handle, page_checksum_verification=True)  # of pages that carry one
        first = 0
        for batch in parquet.iter_batches(columns=list(columns) if columns is not None else None):
            yield Block(batch, file.name, first)
            first += batch.num_rows


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


class FileSource:
    """The files of an import spec's ``[input]``, read as blocks (the importer's source of rows
    unless it is given another)."""

    def __init__(self, spec: ImportSpec) -> None:
        self.spec = spec
        self.files = expand(spec.input.files)

    def blocks(self, columns: list[str]) -> Iterator[Block]:
        """Categorical, dense, label and time columns are read as strings (the numbers and
        times parsed when used: a type inferred from a file's first block, e.g. int64 for
        ratings or times all whole there, or null for a column empty there, would refuse the
        values of a later one)."""
        given = self.spec.input
        split = self.spec.split
        time = (split.time_column,) if split.kind == "chronological" else ()
        strings = [c for c in (*self.spec.feature_columns, *self.spec.dense.columns, self.spec.label.column, *time)
                   if c in columns]
        for file in self.files:
            yield from read_blocks(file, given.format, header=given.header, column_names=given.column_names,
                                   delimiter=given.separator, columns=columns, string_columns=strings)
