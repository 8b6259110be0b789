"""Convert Criteo Kaggle / Terabyte TSV files into a neorec Parquet dataset.

Input lines are ``label \\t I1..I13 \\t C1..C26``: integer counts (possibly negative) and
hexadecimal 32-bit hashes; an empty field is a missing value. Output has the schema of
the ``criteo`` synthetic profile (``label`` float32, ``I*`` float32 nullable, ``C*`` int64
nullable). Every ``eval_every``-th row (by position over all inputs) goes to the eval
split, the rest to train. The data is streamed in blocks; hex parsing is vectorized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ingest.errors import DataError
from ingest.schema import Dataset, DatasetSchema, SparseFeature

DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
HASH_CARDINALITY = 1 << 32

_HEX_VALUE = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_VALUE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_VALUE[_c] = 10 + _i


@dataclass(frozen=True)
class ConvertOptions:
    eval_every: int = 10
    row_group_rows: int = 65_536
    block_bytes: int = 16 << 20


def convert(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
) -> Dataset:
    """Write the dataset into ``out_dir``; errors name the input file, line and column."""
    if options.eval_every < 2:
        raise ValueError("eval_every must be at least 2")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = DatasetSchema(
        label="label", dense=DENSE, sparse=tuple(SparseFeature(c, HASH_CARDINALITY) for c in SPARSE)
    )
    arrow_schema = pa.schema(
        [pa.field("label", pa.float32(), nullable=False)]
        + [pa.field(c, pa.float32()) for c in DENSE]
        + [pa.field(c, pa.int64()) for c in SPARSE]
    )
    rows = {"train": 0, "eval": 0}
    writers = {split: _BufferedWriter(out / f"{split}-00000.parquet", arrow_schema, options.row_group_rows)
               for split in rows}
    position = 0
    try:
        for path in inputs:
            for batch, first_line in _read_blocks(Path(path), options.block_bytes):
                table = _convert_block(batch, str(path), first_line, arrow_schema)
                is_eval = (np.arange(position, position + table.num_rows) % options.eval_every) == options.eval_every - 1
                for split, mask in (("eval", is_eval), ("train", ~is_eval)):
                    part = table.filter(pa.array(mask))
                    writers[split].write(part)
                    rows[split] += part.num_rows
                position += table.num_rows
                if progress is not None:
                    progress(table.num_rows)
    finally:
        for writer in writers.values():
            writer.close()
    dataset = Dataset(
        root=out, schema=schema, splits={s: [f"{s}-00000.parquet"] for s in rows}, rows=rows, profile="criteo-tsv",
        generator={"kind": "criteo-tsv", "inputs": [str(p) for p in inputs], "eval_every": options.eval_every},
    )
    dataset.save()
    return dataset


def _read_blocks(path: Path, block_bytes: int):
    """Record batches of all-string columns and the 1-based line number of their first row."""
    names = ["label", *DENSE, *SPARSE]
    try:
        reader = pacsv.open_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=names, block_size=block_bytes),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                                 strings_can_be_null=True),
        )
        line = 1
        for batch in reader:
            yield batch, line
            line += batch.num_rows
    except pa.ArrowInvalid as err:
        raise DataError(f"not a Criteo TSV file: {err}", file=str(path)) from err


def _convert_block(batch: pa.RecordBatch, path: str, first_line: int, arrow_schema: pa.Schema) -> pa.Table:
    label = _integers(batch.column(0), path, first_line, "label")
    invalid = label.mask | ((label.data != 0) & (label.data != 1))
    if invalid.any():
        raise DataError("label must be 0 or 1", file=path, column="label", row=first_line + int(np.argmax(invalid)))
    arrays = [pa.array(label.data.astype(np.float32))]
    for j, name in enumerate(DENSE, start=1):
        parsed = _integers(batch.column(j), path, first_line, name)
        arrays.append(pa.array(parsed.data.astype(np.float32), mask=parsed.mask))
    for j, name in enumerate(SPARSE, start=1 + len(DENSE)):
        parsed = _hex(batch.column(j), path, first_line, name)
        arrays.append(pa.array(parsed.data, mask=parsed.mask))
    return pa.Table.from_arrays(arrays, schema=arrow_schema)


@dataclass
class _Parsed:
    data: np.ndarray
    mask: np.ndarray  # True where missing


def _integers(column: pa.Array, path: str, first_line: int, name: str) -> _Parsed:
    mask = column.is_null().to_numpy(zero_copy_only=False)
    try:
        data = pc.fill_null(pc.cast(column, pa.int64()), 0).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid as err:
        raise DataError(f"not an integer: {err}", file=path, column=name) from err
    return _Parsed(data.astype(np.int64), mask)


def _hex(column: pa.Array, path: str, first_line: int, name: str) -> _Parsed:
    """Hexadecimal strings of up to 15 digits → int64, without a Python loop over rows."""
    mask = column.is_null().to_numpy(zero_copy_only=False)
    column = column.cast(pa.string())
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[column.offset : column.offset + len(column) + 1]
    data_buffer = column.buffers()[2]
    chars = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    lengths[mask] = 0
    if lengths.size and lengths.max() > 15:
        bad = int(np.argmax(lengths > 15))
        raise DataError("hash has more than 15 hex digits", file=path, column=name, row=first_line + bad)
    width = int(lengths.max()) if lengths.size else 0
    values = np.zeros(len(column), dtype=np.int64)
    for k in range(width):  # one vector step per digit position, not per row
        has_digit = lengths > k
        digit = _HEX_VALUE[chars[offsets[:-1][has_digit] + k]]
        if np.any(digit < 0):
            bad = int(np.flatnonzero(has_digit)[np.argmax(digit < 0)])
            raise DataError("not a hexadecimal hash", file=path, column=name, row=first_line + bad)
        values[has_digit] = values[has_digit] * 16 + digit
    return _Parsed(values, mask | (lengths == 0))


class _BufferedWriter:
    """Writes tables to one Parquet file in row groups of ``row_group_rows``."""

    def __init__(self, path: Path, schema: pa.Schema, row_group_rows: int) -> None:
        self._writer = pq.ParquetWriter(path, schema, compression="zstd")
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._row_group_rows = row_group_rows

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= self._row_group_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending_rows:
            self._writer.write_table(pa.concat_tables(self._pending), row_group_size=self._row_group_rows)
        self._pending, self._pending_rows = [], 0

    def close(self) -> None:
        self._flush()
        self._writer.close()
