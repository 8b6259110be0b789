"""What ``neorec data import`` reads and how it encodes it: an import spec (TOML).

::

    [input]
    files = ["logs/*.csv"]           # paths, globs, or URIs of any pyarrow filesystem
    format = "csv"                   # csv, tsv or parquet; default: by the files' names
                                     # (.csv, .tsv or .tab, .parquet or .pq; none: csv)
    header = true                    # false: give column_names
    column_names = []

    [label]
    column = "rating"
    transform = ">= 4"               # a comparison making 0/1, or "" (already 0/1)

    [dense]
    columns = ["age"]
    transform = "none"               # none, log1p, standardize (mean/std of the train split)
    fill = 0.0                       # missing values

    [categorical]
    columns = ["user", "item"]
    encoding = "vocab"               # vocab (train split only), hash, or raw (64-bit hashes for
                                     # dynamic tables)
    min_count = 1                    # vocab: rarer values map to 0 with the unseen
    max_rows = 0                     # vocab: a cap on the table (0: none)
    hash_rows = 1048576              # hash: rows of each table

    [multivalued]
    columns = { genres = "|" }       # delimiter of a string column; "" for a list column

    [split]
    kind = "chronological"           # chronological (by time_column), ordered (the files' order is
                                     # time order: the last rows are eval), random, or files
    time_column = "timestamp"       # numbers, or ISO 8601 timestamps or dates (with or without an offset)
    eval_fraction = 0.2
    seed = 0
    eval_files = []                  # kind = "files": these files are the eval split

    [output]
    row_group_rows = 65536

Every value is checked when the spec is read; an error names the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from neorec.common.errors import UserError
from neorec.ingest.sections import build_section

FORMATS = ("csv", "tsv", "parquet")
DENSE_TRANSFORMS = ("none", "log1p", "standardize")
ENCODINGS = ("vocab", "hash", "raw")
SPLITS = ("chronological", "ordered", "random", "files")
LABEL_TRANSFORM = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*(-?\d+(\.\d*)?)\s*")
"""A label transform: a comparison with a number (``>= 4``)."""


class SpecError(UserError, ValueError):
    """An import spec value is missing, unknown or invalid; the message names the key."""

    lasting = True


COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
"""Suffixes of compressed files, which Arrow reads as they are (spelled so, lower case):
the format is the suffix before."""
FORMAT_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet"}
"""A file name's suffix (any case) → the format it says."""


def format_of_names(files: list[str]) -> str:
    """The format the names of ``files`` (paths, globs or URIs) say by their suffixes
    (:data:`FORMAT_SUFFIXES`; a compressed file's by the suffix before its compression's, a
    URI's without its query); csv when none says one; a :class:`SpecError` when they say two."""
    said: dict[str, str] = {}
    for name in files:
        stem = re.split(r"[?#]", name, maxsplit=1)[0] if "://" in name else name
        stem = next((stem[:-len(c)] for c in COMPRESSED if stem.endswith(c)), stem)
        kind = next((f for suffix, f in FORMAT_SUFFIXES.items() if stem.lower().endswith(suffix)), None)
        if kind is not None:
            said.setdefault(kind, name)
    if len(said) > 1:
        named = ", ".join(f"{kind} ({name})" for kind, name in said.items())
        raise SpecError(f"input.format: the files' names say {named}: give the format")
    return next(iter(said), "csv")


@dataclass
class InputSpec:
    files: list[str] = field(default_factory=list)
    format: str = ""
    """csv, tsv or parquet; "": as the files' names say (:func:`format_of_names`)."""
    header: bool = True
    column_names: list[str] = field(default_factory=list)
    delimiter: str = ""
    """Default: ``,`` for csv, a tab for tsv."""

    def __post_init__(self) -> None:
        if not self.format and self.files:
            self.format = format_of_names(self.files)

    def validate(self) -> None:
        if not self.files:
            raise SpecError("input.files: name at least one file")
        _one_of("input.format", self.format, FORMATS)
        if not self.header and not self.column_names and self.format != "parquet":
            raise SpecError("input.column_names: a file without a header needs its column names")
        if len(self.delimiter) > 1 or self.delimiter in ('"', "\n", "\r"):
            raise SpecError(f"input.delimiter: one character that is not a quote or a line break (',', '\\t', ';'), "
                            f"got {self.delimiter!r}")

    @property
    def separator(self) -> str:
        return self.delimiter or ("\t" if self.format == "tsv" else ",")


@dataclass
class LabelSpec:
    column: str = "label"
    transform: str = ""

    def validate(self) -> None:
        if self.transform and not LABEL_TRANSFORM.fullmatch(self.transform):
            raise SpecError(f"label.transform: a comparison with a number such as '>= 4', got {self.transform!r}")


@dataclass
class DenseSpec:
    columns: list[str] = field(default_factory=list)
    transform: str = "none"
    fill: float = 0.0

    def validate(self) -> None:
        _one_of("dense.transform", self.transform, DENSE_TRANSFORMS)


@dataclass
class CategoricalSpec:
    columns: list[str] = field(default_factory=list)
    encoding: str = "vocab"
    min_count: int = 1
    max_rows: int = 0
    hash_rows: int = 1 << 20

    def validate(self) -> None:
        _one_of("categorical.encoding", self.encoding, ENCODINGS)
        if self.min_count < 1:
            raise SpecError(f"categorical.min_count: must be >= 1, got {self.min_count}")
        if self.max_rows < 0 or self.max_rows == 1:
            raise SpecError(f"categorical.max_rows: 0 (no cap) or at least 2, got {self.max_rows}")
        if self.hash_rows < 2:
            raise SpecError(f"categorical.hash_rows: must be >= 2, got {self.hash_rows}")
        for key, value, unset in (("min_count", self.min_count, 1), ("max_rows", self.max_rows, 0)):
            if self.encoding != "vocab" and value != unset:
                raise SpecError(f"categorical.{key}: it caps a vocabulary, and encoding = {self.encoding!r} gives "
                                f"every value an id; leave it out (or encode with 'vocab')")


@dataclass
class MultiValuedSpec:
    columns: dict[str, str] = field(default_factory=dict)
    """Column → the delimiter of its values in a string ("" for a list column)."""


@dataclass
class SplitSpec:
    kind: str = "random"
    time_column: str = ""
    eval_fraction: float = 0.1
    seed: int = 0
    eval_files: list[str] = field(default_factory=list)

    def validate(self) -> None:
        _one_of("split.kind", self.kind, SPLITS)
        if self.kind != "files" and not 0 < self.eval_fraction < 1:
            raise SpecError(f"split.eval_fraction: must lie in (0, 1), got {self.eval_fraction}")
        if self.kind == "chronological" and not self.time_column:
            raise SpecError("split.time_column: a chronological split needs the column that orders the rows")
        if self.kind == "files" and not self.eval_files:
            raise SpecError("split.eval_files: a split by files needs the eval split's files")


@dataclass
class OutputSpec:
    row_group_rows: int = 65_536
    file_rows: int = 1 << 22

    def validate(self) -> None:
        if self.row_group_rows < 1 or self.file_rows < self.row_group_rows:
            raise SpecError("output: row_group_rows must be >= 1 and file_rows >= row_group_rows")


@dataclass
class ImportSpec:
    input: InputSpec = field(default_factory=InputSpec)
    label: LabelSpec = field(default_factory=LabelSpec)
    dense: DenseSpec = field(default_factory=DenseSpec)
    categorical: CategoricalSpec = field(default_factory=CategoricalSpec)
    multivalued: MultiValuedSpec = field(default_factory=MultiValuedSpec)
    split: SplitSpec = field(default_factory=SplitSpec)
    output: OutputSpec = field(default_factory=OutputSpec)

    def validate(self) -> None:
        for section in (self.input, self.label, self.dense, self.categorical, self.split, self.output):
            section.validate()
        if not self.categorical.columns and not self.multivalued.columns:
            raise SpecError("categorical.columns / multivalued.columns: name at least one categorical column")
        roles: dict[str, str] = {}
        named = [(self.label.column, "label"), *((c, "dense") for c in self.dense.columns),
                 *((c, "categorical") for c in self.categorical.columns),
                 *((c, "multivalued") for c in self.multivalued.columns)]
        for column, role in named:
            if column in roles:
                raise SpecError(f"column {column!r} is both {roles[column]} and {role}")
            roles[column] = role

    @property
    def feature_columns(self) -> list[str]:
        """The sparse features, in the dataset's order: categorical, then multi-valued."""
        return [*self.categorical.columns, *self.multivalued.columns]

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "ImportSpec":
        spec = build_section(cls, obj, "", SpecError)
        spec.validate()
        return spec


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"{key}: must be one of {', '.join(allowed)}; got {value!r}")
