"""Parquet → :class:`HostBatch` decoding, with validation that names bad input.

No Python loop runs over rows or ids: flat columns are decoded by the Numba kernels of
:mod:`neorec.ingest.flat_columns`, list columns by Arrow compute functions and numpy vector
operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from neorec.ingest import recycled
from neorec.ingest.batch import HostBatch
from neorec.ingest.errors import DataError, UnreadableFileError
from neorec.ingest.flat_columns import (Outputs, Part, RoutedPart, decodable, numbers_into, numbers_routed,
                                        single_ids, single_ids_routed)
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

    def id_bounds(self, schema: DatasetSchema) -> tuple[int, ...]:
        """Per sparse feature of ``schema``: its decoded ids lie in ``[0, bound)``, or any
        int64 for a raw feature (bound 0)."""
        return tuple(0 if f.name in self.raw_features else rows for f, rows in zip(schema.sparse, self.table_rows))

    @classmethod
    def for_schema(cls, schema: DatasetSchema, **kwargs) -> "DecodeOptions":
        """Options whose tables hold every id of the schema (no hashing collisions)."""
        return cls(table_rows=tuple(f.cardinality for f in schema.sparse), **kwargs)


def check_file_schema(parquet_file: pq.ParquetFile, path: str, schema: DatasetSchema) -> None:
    """Raise :class:`DataError` if ``parquet_file`` lacks a column or has a wrong type."""
    arrow_schema = parquet_file.schema_arrow
    for column in schema.columns:
        found = len(arrow_schema.get_all_field_indices(column))
        if found != 1:
            raise DataError("column is missing from the file" if not found else f"the file has {found} columns of "
                            "this name", file=path, column=column)
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


class ColumnSource(Protocol):
    """The raw columns of the rows being decoded: a table (:class:`TableColumns`) or rows
    picked from several row groups (:class:`neorec.ingest.take.PickedRows`)."""

    num_rows: int
    schema: pa.Schema
    """The columns' names and types (of the first row group, for picked rows)."""

    def parts(self, name: str) -> list[Part]:
        """A flat column's values, as parts of arrays (:mod:`neorec.ingest.flat_columns`)."""

    def array(self, name: str) -> pa.Array:
        """The column's values of the rows, in order, as one array."""

    def bags(self, name: str) -> "Bags | None":
        """A list column's bags without building its array, or None (read ``array``)."""


@dataclass(frozen=True)
class Bags:
    """A list column's bags of the rows being decoded: ``lengths`` (int32 ``[n]``, 0 for a
    null list), ``count`` ids in all, and ``write(out)``, which writes them (as int64, bag
    after bag) to ``out[:count]``."""

    lengths: np.ndarray
    count: int
    write: Callable[[np.ndarray], None]


class TableColumns:
    """The columns of an Arrow table."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.num_rows = table.num_rows
        self.schema = table.schema

    def parts(self, name: str) -> list[Part]:
        return [Part(self.array(name))]

    def array(self, name: str) -> pa.Array:
        column = self.table.column(name)
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)

    def bags(self, name: str) -> Bags | None:
        return None  # the array's bags are read in place


Jobs = Callable[[Sequence[Callable[[], None]]], None]
"""Runs a list of independent jobs (zero-argument callables), in any order or at once."""


def run_in_order(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def decode_table(
    table: pa.Table | ColumnSource,
    schema: DatasetSchema,
    options: DecodeOptions,
    *,
    file: str = "<table>",
    row_group: int | None = None,
    first_row: int = 0,
    locate: Callable[[int], tuple[str, int, int]] | None = None,
) -> HostBatch:
    """Decode an Arrow table with ``schema``'s columns (or the rows of another
    :class:`ColumnSource`) into a batch of all its rows.

    Errors name row ``first_row + i`` of ``row_group`` of ``file`` for the table's row
    ``i``, or the ``(file, row group, row)`` that ``locate(i)`` gives when the table's rows
    were gathered from several row groups. See :func:`decode_sources`."""
    source = TableColumns(table) if isinstance(table, pa.Table) else table
    return decode_sources([source], [Where(file, row_group, first_row, locate)], schema, options)[0]


def decode_sources(sources: Sequence[ColumnSource], wheres: Sequence["Where"], schema: DatasetSchema,
                   options: DecodeOptions, run: Jobs = run_in_order,
                   together: "RoutedColumns | None" = None) -> list[HostBatch]:
    """Decode several sources of ``schema``'s columns into a batch each, column by column:
    each column of every source before the next column, so that the rows of a column that
    several sources pick from (the chunks of a permuted window) are read from memory once.
    The columns are independent jobs that ``run`` may run at once (they release the GIL in
    their kernels); ``wheres[k]`` locates source ``k``'s rows for errors. With
    ``together`` (the sources' flat columns routed from the row groups they pick from),
    each flat column is decoded for every source in one pass over those row groups.

    Flat columns of integers, float32 and float64 are decoded by the kernels of
    :mod:`neorec.ingest.flat_columns`; a numeric column in which they find a value that is
    not finite is decoded again from its Arrow array, which names the first bad row. Of
    several bad columns, the first in schema order (label, dense, sparse) is named: a
    single id feature's ids are sized from its validity before any is written, so that
    every feature's ids land at their final place in the batch's ``values``."""
    sizes = [source.num_rows for source in sources]
    num_f = len(schema.sparse)
    labels = [recycled.empty(n, np.float32) for n in sizes]
    # each dense column is decoded into a row of its own, so that threads decoding different
    # columns never write to one cache line (a row of a batch's ``dense`` holds every column)
    columns = [recycled.empty((len(schema.dense), n), np.float32) for n in sizes]
    # log1p: the kernels store max(x, 0) + 1, whose log is taken once the columns are whole
    # (log(1 + x) rather than np.log1p: numpy vectorizes it in float32, and it is off by at
    # most one float32 ulp of 1 for tiny x, far below what a model input resolves)
    log1p = options.dense_transform == "log1p"
    lengths = [recycled.empty(num_f * n, np.int32) for n in sizes]
    counts = np.zeros((len(sources), num_f), dtype=np.int64)
    writers: dict[int, Callable[[Sequence[np.ndarray]], None]] = {}  # by feature: writes each source's ids
    errors: dict[int, DataError] = {}  # by the column's place in schema order

    def job(order: int, work: Callable[[], None]) -> Callable[[], None]:
        def checked() -> None:
            try:
                work()
            except DataError as err:
                errors[order] = err
        return checked

    def numbers(name: str, missing: float | None, outs: Sequence[np.ndarray], clip_add_one: bool = False) -> None:
        if together is not None and decodable(_field_type(sources[0], name, wheres[0])):
            parts = together.routed(name)
            if all(decodable(p.array.type) for p in parts) and numbers_routed(
                    parts, np.nan if missing is None else missing, Outputs(outs, together.shift), clip_add_one):
                return
        for source, where, out in zip(sources, wheres, outs):  # one by one, to name a bad value
            _numbers_into(source, name, where, missing, out, clip_add_one)

    def label_column() -> None:
        numbers(schema.label, None, labels)
        for where, out in zip(wheres, labels):
            if not np.all((out >= 0) & (out <= 1)):
                bad = int(np.flatnonzero((out < 0) | (out > 1))[0])
                raise where.error(f"labels must lie in [0, 1], found {out[bad]}", schema.label, bad)

    def dense_column(j: int) -> Callable[[], None]:
        def work() -> None:
            numbers(schema.dense[j], 0.0, [out[j] for out in columns], clip_add_one=log1p)
        return work

    def sizes_of(f: int) -> Callable[[], None]:
        feature = schema.sparse[f]

        def work() -> None:
            flags = [ln[f * n : (f + 1) * n] for ln, n in zip(lengths, sizes)]
            if (not feature.multi_hot and together is not None
                    and pa.types.is_integer(_field_type(sources[0], feature.name, wheres[0]))):
                counts[:, f], writers[f] = single_ids_routed(together.routed(feature.name), flags, together.shift)
                return
            each = []
            for k, (source, where) in enumerate(zip(sources, wheres)):
                if feature.multi_hot:
                    found = _bags(source, feature.name, where)
                    flags[k][:] = found.lengths
                    counts[k, f], write = found.count, found.write
                else:
                    counts[k, f], write = _single_ids(source, feature.name, where, flags[k])
                each.append(write)

            def write_each(outs: Sequence[np.ndarray]) -> None:
                for write_one, out in zip(each, outs):
                    write_one(out)

            writers[f] = write_each
        return work

    first_feature = 1 + len(schema.dense)
    run([job(0, label_column), *(job(1 + j, dense_column(j)) for j in range(len(schema.dense))),
         *(job(first_feature + f, sizes_of(f)) for f in range(num_f))])
    starts = np.zeros((len(sources), num_f + 1), dtype=np.int64)
    np.cumsum(counts, axis=1, out=starts[:, 1:])
    values = [recycled.empty(int(total), np.int64) for total in starts[:, -1]]

    def ids_of(f: int) -> Callable[[], None]:
        feature = schema.sparse[f]

        def work() -> None:
            ids = [v[s[f] : s[f + 1]] for v, s in zip(values, starts)]
            writers[f](ids)
            if feature.name in options.raw_features:
                return
            for k, (where, n) in enumerate(zip(wheres, sizes)):
                _map_ids(ids[k], options.table_rows[f], options.id_mapping, where, feature.name,
                         lengths[k][f * n : (f + 1) * n], sources[k])
        return work

    dense = [recycled.empty((n, len(schema.dense)), np.float32) for n in sizes]

    def dense_rows(k: int) -> Callable[[], None]:
        def work() -> None:
            if log1p:
                np.log(columns[k], out=columns[k])
            np.copyto(dense[k], columns[k].T)
        return work

    run([*(dense_rows(k) for k in range(len(sources)) if not errors),  # with an error, the batch is not made
         *(job(first_feature + f, ids_of(f)) for f in range(num_f) if first_feature + f not in errors)])
    if errors:
        raise errors[min(errors)]
    return [HostBatch(dense=d, labels=y, keys=schema.feature_names, lengths=ln, values=v)
            for d, y, ln, v in zip(dense, labels, lengths, values)]


class RoutedColumns(Protocol):
    """The flat columns of several sources at once, whose rows are picked from the same
    arrays (:class:`neorec.ingest.take.PickedTogether`): each array as a
    :class:`~neorec.ingest.flat_columns.RoutedPart` whose routes lead row ``i`` of source
    ``k`` to ``k << shift | i``."""

    shift: int

    def routed(self, name: str) -> list[RoutedPart]: ...


@dataclass(frozen=True)
class Where:
    """Where a source's rows come from, for errors: row ``first_row + i`` of ``row_group``
    of ``file`` for row ``i``, or the ``(file, row group, row)`` that ``locate(i)`` gives
    for rows gathered from several row groups."""

    file: str = "<table>"
    row_group: int | None = None
    first_row: int = 0
    locate: Callable[[int], tuple[str, int, int]] | None = None

    def error(self, problem: str, column: str, row_in_slice: int | None = None) -> DataError:
        if row_in_slice is None:
            return DataError(problem, file=self.file, row_group=self.row_group, column=column)
        if self.locate is not None:
            file, row_group, row = self.locate(row_in_slice)
            return DataError(problem, file=file, row_group=row_group, column=column, row=row)
        row = self.first_row + row_in_slice
        return DataError(problem, file=self.file, row_group=self.row_group, column=column, row=row)


def _field_type(source: ColumnSource, name: str, where: Where) -> pa.DataType:
    indices = source.schema.get_all_field_indices(name)
    if len(indices) != 1:
        raise where.error("column is missing" if not indices else f"{len(indices)} columns have this name", name)
    return source.schema.field(indices[0]).type


def _numbers_into(source: ColumnSource, name: str, where: Where, missing: float | None, out: np.ndarray,
                  clip_add_one: bool = False) -> None:
    """``out`` (float32 ``[n]``, may be strided) ← a numeric column; nulls become
    ``missing`` or, when it is None, an error, as does a value that is not finite. With
    ``clip_add_one``, each value ``x`` is stored as ``max(x, 0) + 1`` (float32)."""
    kind = _field_type(source, name, where)
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise where.error(f"expected a numeric column, found {kind}", name)
    parts = source.parts(name)
    if all(decodable(p.array.type) for p in parts):
        if numbers_into(parts, np.nan if missing is None else missing, out, clip_add_one):
            return
    out[:] = _numeric(source.array(name), name, where, missing)
    if clip_add_one:
        np.add(np.maximum(out, 0.0, out=out), np.float32(1.0), out=out)


def _numeric(array: pa.Array, name: str, where: Where, missing: float | None) -> np.ndarray:
    """float32 ``[n]``; nulls become ``missing`` or, when it is None, an error."""
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


def _single_ids(source: ColumnSource, name: str, where: Where,
                flags: np.ndarray) -> tuple[int, Callable[[np.ndarray], None]]:
    """A single-id feature's ids: see :func:`neorec.ingest.flat_columns.single_ids`."""
    kind = _field_type(source, name, where)
    if not pa.types.is_integer(kind):
        raise where.error(f"expected int64, found {kind}", name)
    return single_ids(source.parts(name), flags)


def _bags(source: ColumnSource, name: str, where: Where) -> Bags:
    """A list column's bags (a null list: an empty bag)."""
    _field_type(source, name, where)
    bags = source.bags(name)
    if bags is not None:
        return bags
    array = source.array(name)
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise where.error(f"expected list<int64>, found {array.type}", name)
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False).astype(np.int32)
    flat = pc.list_flatten(array)
    if flat.null_count:
        bag = np.repeat(np.arange(len(lengths)), lengths)[np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0]]
        raise where.error("null id inside a list", name, int(bag))
    if not pa.types.is_integer(flat.type):
        raise where.error(f"expected integer ids, found {flat.type}", name)
    ids = flat.to_numpy(zero_copy_only=False)
    return Bags(lengths, ids.size, lambda out: np.copyto(out, ids, casting="unsafe"))


def _map_ids(ids: np.ndarray, rows: int, mapping: str, where: Where, column: str, lengths: np.ndarray,
             source: ColumnSource) -> None:
    """Map raw ids (int64 ``[n]``; a uint64 column's ids of 2^63 and above wrap to negative)
    into ``[0, rows)`` in place; name the row of the first bad id."""
    if ids.size == 0:
        return
    low = ids.min()
    if low < 0:
        if not _unsigned_ids(source, column):
            raise where.error(f"negative id {low}", column, _row_of_id(lengths, int(np.argmax(ids < 0))))
        ids = ids.view(np.uint64)
    high = ids.max()
    if high < rows:
        return
    if mapping == "modulo":
        np.remainder(ids, rows, out=ids)
        return
    first = int(np.argmax(ids >= rows))
    raise where.error(f"id {ids[first]} is out of range for a table of {rows} rows", column,
                      _row_of_id(lengths, first))


def _unsigned_ids(source: ColumnSource, column: str) -> bool:
    """Whether a sparse feature's column holds unsigned integers (or lists of them)."""
    kind = source.schema.field(column).type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    return pa.types.is_unsigned_integer(kind)


def _row_of_id(lengths: np.ndarray, position: int) -> int:
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


def open_parquet(path: str | Path, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """A dataset's Parquet file, whose pages' checksums are verified as they are read (a
    page without one, as in files written before checksums were, is read unchecked)."""
    return pq.ParquetFile(path, metadata=metadata, page_checksum_verification=True)


def open_files(paths: Sequence[str | Path], schema: DatasetSchema) -> list[pq.ParquetFile]:
    """Open and schema-check every file; errors name the file."""
    opened = []
    for path in paths:
        try:
            parquet_file = open_parquet(path)
        except (OSError, ValueError) as err:
            raise UnreadableFileError(f"cannot open Parquet file: {err}", file=str(path)) from err
        check_file_schema(parquet_file, str(path), schema)
        opened.append(parquet_file)
    return opened
