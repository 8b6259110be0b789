"""Errors raised for bad input data, naming where the problem is."""

from __future__ import annotations

from neorec.common.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data: an unreadable file, a schema mismatch or an invalid value.

    The message always names the file and, where known, the row group, column and row.
    """

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        row_group: int | None = None,
        column: str | None = None,
        row: int | None = None,
    ) -> None:
        self.problem = problem
        self.file = file
        self.row_group = row_group
        self.column = column
        self.row = row
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row_group is not None:
            where.append(f"row group {row_group}")
        if column is not None:
            where.append(f"column {column!r}")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(f"{', '.join(where)}: {problem}" if where else problem)


class DatasetNotFoundError(DataError, FileNotFoundError):
    """A directory named as a dataset holds no ``dataset.json``."""


class UnreadableFileError(DataError):
    """A data file that cannot be opened as Parquet (truncated, not Parquet, unreadable)."""
