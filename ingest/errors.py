"""Errors raised for bad input data, naming where the problem is."""

from __future__ import annotations

from neorec.common.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data: an unreadable file, a schema mismatch or an invalid value.

    The message always names the file and, where known, the row group, column and row:
    ``line N`` is the file's physical line (1-based, a header and blank lines counted:
    ``sed -n Np FILE`` shows it), ``row N`` a data row (1-based, header excluded) where
    there are no lines to count (Parquet).
    """

    lasting = True

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        row_group: int | None = None,
        column: str | None = None,
        row: int | None = None,
        line: int | None = None,
    ) -> None:
        self.problem = problem
        self.file = file
        self.row_group = row_group
        self.column = column
        self.row = row
        self.line = line
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row_group is not None:
            where.append(f"row group {row_group}")
        if column is not None:
            where.append(f"column {column!r}")
        if row is not None:
            where.append(f"row {row}")
        if line is not None:
            where.append(f"line {line}")
        super().__init__(f"{', '.join(where)}: {problem}" if where else problem)

    def with_hint(self, hint: str) -> "DataError":
        """An error of the same place whose problem ends with ``hint``."""
        return DataError(f"{self.problem}; {hint}", file=self.file, row_group=self.row_group, column=self.column,
                         row=self.row, line=self.line)


class WrongWidthError(DataError):
    """A delimited row with another number of fields than the file's first (``actual``, not
    ``expected``). Keyword defaults: unpickled, it is made from its message alone."""

    def __init__(self, problem: str, *, actual: int = 0, expected: int = 0, **where) -> None:
        super().__init__(problem, **where)
        self.actual = actual
        self.expected = expected


class MissingColumnError(DataError):
    """A column the import names that a file lacks."""

    def __init__(self, problem: str, *, missing: str = "", **where) -> None:
        super().__init__(problem, **where)
        self.missing = missing


def no_column(column: str, columns: list[str], file: str) -> MissingColumnError:
    """The error of a ``file`` (whose columns are ``columns``) that lacks ``column``."""
    return MissingColumnError(f"no column {column!r} (it has {', '.join(columns)})", missing=column, file=file)


class DatasetNotFoundError(DataError, FileNotFoundError):
    """A directory named as a dataset holds no ``dataset.json``."""


class UnreadableFileError(DataError):
    """A data file that cannot be opened as Parquet (truncated, not Parquet, unreadable)."""
