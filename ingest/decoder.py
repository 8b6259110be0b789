"""Vectorized Parquet → :class:`HostBatch` decoding, with validation that names bad input.

No Python loop runs over rows or ids: every column is turned into numpy arrays by Arrow
compute functions and numpy vector operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from neorec.ingest.batch import HostBatch
from neorec.ingest.errors import DataError
from neorec.ingest.schema import DatasetSchema

DENSE_TRANSFORMS = ("log1p", "identity")
ID_MAPPINGS = ("modulo", "strict")


@dataclass(frozen=True)
class DecodeOptions:
    """How raw columns become model inputs.

    Attributes:
        dense_transform: ``log1p`` (negative values clipped to 0, then ``log(1 + x)``, as
            DLRM does for Criteo's counts) or ``identity``. Missing dense values are 0.
        id_mapping: ``modulo`` maps id ``i`` of a feature to row ``i % table_rows``;
            ``strict`` rejects ids ``>= table_rows``. Negative ids are always rejected.
        table_rows: per sparse feature (schema order), the rows of the table it feeds.
        raw_features: features whose ids pass unchanged, any int64 (raw 64-bit ids of a
            dynamic table, mapped to rows in the trainer).
    """

    table_rows: tuple[int, ...]
    dense_transform: str = "log1p"
    id_mapping: str = "modulo"
    raw_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dense_transform not in DENSE_TRANSFORMS:
            raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got {self.dense_transform!r}")
        if self.id_mapping not in ID_MAPPINGS:
            raise ValueError(f"id_mapping must be one of {ID_MAPPINGS}, got {self.id_mapping!r}")
        if any(r <= 0 for r in self.table_rows):
            raise ValueError("every table must have at least one row")

    @classmethod
    def for_schema(cls, schema: DatasetSchema, **kwargs) -> "DecodeOptions":
        """Options whose tables hold every id of the schema (no hashing collisions)."""
        return cls(table_rows=tuple(f.cardinality for f in schema.sparse), **kwargs)


def check_file_schema(parquet_file: pq.ParquetFile, path: str, schema: DatasetSchema) -> None:
    """Raise :class:`DataError` if ``parquet_file`` lacks a column or has a wrong type."""
    arrow_schema = parquet_file.schema_arrow
    names = set(arrow_schema.names)
    for column in schema.columns:
        if column not in names:
            raise DataError("column is missing from the file", file=path, column=column)
    for column in (schema.label, *schema.dense):
        kind = arrow_schema.field(column).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            raise DataError(f"expected a numeric column, found {kind}", file=path, column=column)
    for feature in schema.sparse:
        kind = arrow_schema.field(feature.name).type
        if feature.multi_hot:
            ok = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)
            expected = "list<int64>"
        else:
            ok = pa.types.is_integer(kind)
            expected = "int64"
        if not ok:
            raise DataError(f"expected {expected}, found {kind}", file=path, column=feature.name)


def read_row_group(parquet_file: pq.ParquetFile, path: str, row_group: int, schema: DatasetSchema) -> pa.Table:
    """The schema's columns of one whole row group, as read from Parquet (not yet decoded)."""
    try:
        return parquet_file.read_row_group(row_group, columns=schema.columns)
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read row group: {err}", file=path, row_group=row_group) from err


def decode_table(
    table: pa.Table,
    schema: DatasetSchema,
    options: DecodeOptions,
    *,
    file: str = "<table>",
    row_group: int | None = None,
    first_row: int = 0,
    locate: Callable[[int], tuple[str, int, int]] | None = None,
) -> HostBatch:
    """Decode an Arrow table with ``schema``'s columns into a batch of all its rows.

    Errors name row ``first_row + i`` of ``row_group`` of ``file`` for the table's row
    ``i``, or the ``(file, row group, row)`` that ``locate(i)`` gives when the table's rows
    were gathered from several row groups."""
    where = _Where(file, row_group, first_row, locate)
    n = table.num_rows
    labels = _numeric(table, schema.label, where)
    if np.any((labels < 0) | (labels > 1)):
        raise where.error(f"labels must lie in [0, 1], found {labels[(labels < 0) | (labels > 1)][0]}",
                          schema.label, int(np.flatnonzero((labels < 0) | (labels > 1))[0]))
    dense = np.empty((n, len(schema.dense)), dtype=np.float32)
    for j, column in enumerate(schema.dense):
        dense[:, j] = _numeric(table, column, where, missing=0.0)
    if options.dense_transform == "log1p":
        # log(1 + x) rather than np.log1p: numpy vectorizes it in float32, and it is off by at
        # most one float32 ulp of 1 for tiny x, far below what a model input resolves.
        np.maximum(dense, 0.0, out=dense)
        np.log(np.add(dense, np.float32(1.0), out=dense), out=dense)
    lengths = []
    values = []
    for feature, rows in zip(schema.sparse, options.table_rows):
        bag_lengths, ids = _ids(table, feature.name, feature.multi_hot, where)
        raw = feature.name in options.raw_features
        values.append(ids if raw else _map_ids(ids, rows, options.id_mapping, where, feature.name, bag_lengths))
        lengths.append(bag_lengths)
    return HostBatch(
        dense=dense,
        labels=labels,
        keys=schema.feature_names,
        lengths=np.concatenate(lengths) if lengths else np.zeros(0, np.int32),
        values=np.concatenate(values) if values else np.zeros(0, np.int64),
    )


@dataclass(frozen=True)
class _Where:
    file: str
    row_group: int | None
    first_row: int
    locate: Callable[[int], tuple[str, int, int]] | None = None

    def error(self, problem: str, column: str, row_in_slice: int | None = None) -> DataError:
        if row_in_slice is None:
            return DataError(problem, file=self.file, row_group=self.row_group, column=column)
        if self.locate is not None:
            file, row_group, row = self.locate(row_in_slice)
            return DataError(problem, file=file, row_group=row_group, column=column, row=row)
        row = self.first_row + row_in_slice
        return DataError(problem, file=self.file, row_group=self.row_group, column=column, row=row)


def _column(table: pa.Table, name: str, where: _Where) -> pa.Array:
    if name not in table.column_names:
        raise where.error("column is missing", name)
    column = table.column(name)
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def _numeric(table: pa.Table, name: str, where: _Where, missing: float | None = None) -> np.ndarray:
    """float32 ``[n]``; nulls become ``missing`` or, when it is None, an error."""
    array = _column(table, name, where)
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        raise where.error(f"expected a numeric column, found {array.type}", name)
    if array.null_count:
        if missing is None:
            raise where.error("missing value", name, int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0]))
        array = pc.fill_null(array, missing)
    out = np.array(array.to_numpy(zero_copy_only=False), dtype=np.float32)  # writable copy
    finite = np.isfinite(out)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise where.error(f"non-finite value {out[bad]}", name, bad)
    return out


def _ids(table: pa.Table, name: str, multi_hot: bool, where: _Where) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ``[n]`` bag lengths, int64 ids); a missing single id is an empty bag."""
    array = _column(table, name, where)
    if multi_hot:
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            raise where.error(f"expected list<int64>, found {array.type}", name)
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False).astype(np.int32)
        flat = pc.list_flatten(array)
        if flat.null_count:
            bag = np.repeat(np.arange(len(lengths)), lengths)[np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0]]
            raise where.error("null id inside a list", name, int(bag))
        if not pa.types.is_integer(flat.type):
            raise where.error(f"expected integer ids, found {flat.type}", name)
        return lengths, flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if not pa.types.is_integer(array.type):
        raise where.error(f"expected int64, found {array.type}", name)
    if array.null_count:
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        ids = pc.drop_null(array).to_numpy(zero_copy_only=False)
        return valid.astype(np.int32), ids.astype(np.int64, copy=False)
    return np.ones(len(array), dtype=np.int32), array.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _map_ids(
    ids: np.ndarray, rows: int, mapping: str, where: _Where, column: str, lengths: np.ndarray
) -> np.ndarray:
    """Map raw ids into ``[0, rows)``; name the row of the first bad id."""
    if ids.size == 0:
        return ids
    low = ids.min()
    if low < 0:
        raise where.error(f"negative id {low}", column, _row_of_id(lengths, int(np.argmax(ids < 0))))
    if mapping == "modulo":
        return ids % rows if ids.max() >= rows else ids
    high = ids.max()
    if high >= rows:
        raise where.error(f"id {high} is out of range for a table of {rows} rows", column,
                          _row_of_id(lengths, int(np.argmax(ids >= rows))))
    return ids


def _row_of_id(lengths: np.ndarray, position: int) -> int:
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


def open_files(paths: Sequence[str | Path], schema: DatasetSchema) -> list[pq.ParquetFile]:
    """Open and schema-check every file; errors name the file."""
    opened = []
    for path in paths:
        try:
            parquet_file = pq.ParquetFile(path)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot open Parquet file: {err}", file=str(path)) from err
        check_file_schema(parquet_file, str(path), schema)
        opened.append(parquet_file)
    return opened
