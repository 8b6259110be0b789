"""``neorec data convert``: import specs for the public click and rating logs, over the
importer (:mod:`neorec.ingest.importer`). The files are yours to download: their licenses do not
allow redistributing them.

- ``criteo``: Criteo Kaggle ``train.txt`` / Terabyte ``day_N`` TSV (label, 13 counts, 26
  hashed categoricals); the files are read in the order of their names with numbers
  compared by value (``day_2`` before ``day_10``, however the shell listed them: file
  order is time order), and the last ``eval_fraction`` of the rows is the eval split, or
  ``--eval-files``, some of the files (e.g. Terabyte's ``day_23``).
- ``avazu``: the Avazu CTR ``train`` CSV (``click``, ``hour``, 21 categoricals); split by
  ``hour``.
- ``movielens``: a MovieLens directory, 100k (``u.data``, ``u.user``, ``u.item``), 1M/10M
  (``ratings.dat``, ``users.dat``, ``movies.dat``) or 20M/25M/32M (``ratings.csv``,
  ``movies.csv``): a click is a rating of 4 or more; features user, item, the user's
  gender/age/occupation/zip (where the set has them) and the item's genres (multi-valued);
  split by timestamp.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.fs as pafs

from neorec.ingest.errors import DataError, MissingColumnError, WrongWidthError
from neorec.ingest.import_spec import (CategoricalSpec, DenseSpec, ImportSpec, InputSpec, LabelSpec, MultiValuedSpec,
                                OutputSpec, SpecError, SplitSpec)
from neorec.ingest.sources import (BLOCK_BYTES, Block, FileSource, SourceFile, TextLayout, csv_batches, expand,
                                   natural_key, place, text_layout)

PRESETS = ("criteo", "avazu", "movielens")
CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
AVAZU_CATEGORICAL = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
                     "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
                     *(f"C{i}" for i in range(14, 22))]
RATING_COLUMNS = ["user", "item", "rating", "timestamp"]
MOVIELENS_GENRES_100K = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                         "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
                         "Sci-Fi", "Thriller", "War", "Western"]


@dataclass(frozen=True)
class PresetOptions:
    eval_fraction: float | None = None
    """The newest rows' share that forms the eval split (None: 0.1, or ``eval_files``)."""
    eval_files: tuple[str, ...] = ()
    min_count: int = 1
    hash_rows: int = 0
    """Hash categoricals into this many rows instead of counting a vocabulary (0: vocabulary)."""


def preset(name: str, files: Sequence[str], options: PresetOptions = PresetOptions()) -> tuple[ImportSpec, object]:
    """The import spec of preset ``name`` for ``files``, and its block source: the spec's
    files (:class:`PresetFiles`), or MovieLens's ratings joined with users and items."""
    if options.hash_rows and options.min_count != 1:
        raise SpecError("--min-count caps a vocabulary and --hash-rows hashes the values instead: give one of them")
    if options.eval_files and options.eval_fraction is not None:
        raise SpecError("--eval-files makes those files the eval split and --eval-fraction the newest rows: give one "
                        "of them")
    eval_fraction = 0.1 if options.eval_fraction is None else options.eval_fraction
    categorical = dict(encoding="hash", hash_rows=options.hash_rows) if options.hash_rows else \
        dict(min_count=options.min_count)
    if options.eval_files:
        split = SplitSpec(kind="files", eval_files=list(options.eval_files))
    else:
        split = SplitSpec(kind="ordered", eval_fraction=eval_fraction)
    if name == "criteo":
        spec = ImportSpec(
            input=InputSpec(files=_in_day_order(files), format="tsv", header=False,
                            column_names=["label", *CRITEO_DENSE, *CRITEO_SPARSE]),
            label=LabelSpec("label"), dense=DenseSpec(CRITEO_DENSE),
            categorical=CategoricalSpec(CRITEO_SPARSE, **categorical), split=split)
        return _checked(spec), PresetFiles(spec, "Criteo", _criteo_unlabelled)
    if name == "avazu":
        if not options.eval_files:
            split = SplitSpec(kind="chronological", time_column="hour", eval_fraction=eval_fraction)
        spec = ImportSpec(input=InputSpec(files=list(files), format="csv"), label=LabelSpec("click"),
                          categorical=CategoricalSpec(AVAZU_CATEGORICAL, **categorical), split=split)
        return _checked(spec), PresetFiles(spec, "Avazu", _avazu_unlabelled)
    if name == "movielens":
        if len(files) != 1 or not Path(files[0]).is_dir():
            raise DataError("give the MovieLens directory (holding u.data, ratings.dat or ratings.csv)",
                            file=" ".join(files))
        if options.eval_files:
            raise SpecError("--eval-files: MovieLens is split by timestamp (the newest ratings are the eval "
                            "split); give --eval-fraction")
        source = MovieLensSource(Path(files[0]))
        spec = ImportSpec(
            input=InputSpec(files=[str(source.ratings)]), label=LabelSpec("rating", ">= 4"),
            categorical=CategoricalSpec(["user", "item", *source.user_columns], **categorical),
            multivalued=MultiValuedSpec({"genres": ""}),
            split=SplitSpec(kind="chronological", time_column="timestamp", eval_fraction=eval_fraction),
            output=OutputSpec())
        return _checked(spec), source
    raise DataError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")


def _checked(spec: ImportSpec) -> ImportSpec:
    spec.validate()
    return spec


class PresetFiles(FileSource):
    """The files of a preset's spec, read as any spec's; a refusal that ``unlabelled`` says
    a data set's unlabelled test file makes (one without the label) says so."""

    def __init__(self, spec: ImportSpec, data_set: str, unlabelled: Callable[[DataError], bool]) -> None:
        super().__init__(spec)
        self.data_set = data_set
        self.unlabelled = unlabelled

    def blocks(self, columns: list[str]) -> Iterator[Block]:
        try:
            yield from super().blocks(columns)
        except DataError as err:
            if not self.unlabelled(err):
                raise
            raise err.with_hint(f"this looks like {self.data_set}'s unlabelled test file, which cannot be imported "
                                "for training (it has no label)") from None


def _criteo_unlabelled(err: DataError) -> bool:
    """Whether a Criteo file's first line lacks a field: test.txt's 39 fields (no label)."""
    return isinstance(err, WrongWidthError) and err.line == 1 and err.actual == err.expected - 1 == 39


def _avazu_unlabelled(err: DataError) -> bool:
    """Whether an Avazu file has no ``click`` column: test.csv's."""
    return isinstance(err, MissingColumnError) and err.missing == "click"


class MovieLensSource:
    """The ratings of a MovieLens directory, each row joined with its user's and its item's
    columns (in the ratings' order: a lookup by index, not a hash join)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        if (directory / "u.data").is_file():
            self.kind = "100k"
            self.ratings = directory / "u.data"
        elif (directory / "ratings.dat").is_file():
            self.kind = "1m"
            self.ratings = directory / "ratings.dat"
        elif (directory / "ratings.csv").is_file():
            self.kind = "csv"
            self.ratings = directory / "ratings.csv"
        else:
            raise DataError("not a MovieLens directory: no u.data, ratings.dat or ratings.csv", file=str(directory))
        self.users = self._users()
        self.items = self._items()
        self.user_columns = [c for c in self.users.column_names if c != "user"] if self.users is not None else []

    def blocks(self, columns: list[str]) -> Iterator[Block]:
        first = 0
        layout = _layout(self.ratings, self._ratings_reading())
        for batch in self._rating_batches():
            table = pa.Table.from_batches([batch])
            joined = {name: table[name] for name in table.column_names}
            if self.users is not None:
                at = pc.index_in(table["user"], value_set=self.users["user"])
                joined.update({c: self.users[c].take(at) for c in self.user_columns})
            at = pc.index_in(table["item"], value_set=self.items["item"])
            joined["genres"] = self.items["genres"].take(at)
            out = pa.table({c: joined[c] for c in columns}).combine_chunks()
            yield Block(out.to_batches()[0] if out.num_rows else pa.RecordBatch.from_pylist([], out.schema),
                        str(self.ratings), first, layout)
            first += table.num_rows

    # ---------------------------------------------------------------------- the files
    def _ratings_reading(self) -> "_Reading":
        """How the ratings file is read."""
        if self.kind == "100k":
            return _delimited_reading("\t", RATING_COLUMNS)
        if self.kind == "1m":
            return _double_colon_reading()
        return _csv_reading(["userId", "movieId", "rating", "timestamp"])

    def _rating_batches(self) -> Iterator[pa.RecordBatch]:
        if self.kind == "1m":
            yield from _double_colon(self.ratings, RATING_COLUMNS)
            return
        # by the header's names (ratings.csv); the numbers are parsed (a bad one named by its line) by the importer
        for batch in _batches(self.ratings, self._ratings_reading()):
            yield pa.RecordBatch.from_arrays(batch.columns, names=RATING_COLUMNS)

    def _users(self) -> pa.Table | None:
        if self.kind == "100k":
            table = _read_all(_delimited(self.directory / "u.user", "|",
                                         ["user", "age", "gender", "occupation", "zip"], latin1=True))
        elif self.kind == "1m" and (self.directory / "users.dat").is_file():
            table = _read_all(_double_colon(self.directory / "users.dat",
                                            ["user", "gender", "age", "occupation", "zip"]))
        else:
            return None
        return table.select(["user", "gender", "age", "occupation", "zip"])

    def _items(self) -> pa.Table:
        if self.kind == "100k":
            flags = [f"g{i}" for i in range(len(MOVIELENS_GENRES_100K))]
            reading = _delimited_reading("|", ["item", "title", "released", "video", "url", *flags], latin1=True)
            table = _read_all(_batches(self.directory / "u.item", reading))
            layout = _layout(self.directory / "u.item", reading)
            matrix = np.stack([_genre_flags(table[f], genre, layout)
                               for f, genre in zip(flags, MOVIELENS_GENRES_100K)], axis=1)
            rows, which = np.nonzero(matrix == 1)
            offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=table.num_rows))])
            genres = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                              pa.array(np.array(MOVIELENS_GENRES_100K, dtype=object)[which],
                                                       pa.string()))
            return pa.table({"item": table["item"], "genres": genres})
        if self.kind == "1m":
            table = _read_all(_double_colon(self.directory / "movies.dat", ["item", "title", "genres"]))
        else:
            table = _read_all(_csv(self.directory / "movies.csv", ["movieId", "title", "genres"]))
            table = table.rename_columns(["item", "title", "genres"])
        genres = pc.split_pattern(pc.replace_substring(table["genres"], "(no genres listed)", ""), "|")
        return pa.table({"item": table["item"], "genres": genres})


class _Reading(NamedTuple):
    """How a file of the MovieLens directory is read."""

    read: pacsv.ReadOptions
    parse: pacsv.ParseOptions
    convert: pacsv.ConvertOptions


def _delimited_reading(delimiter: str, names: list[str], latin1: bool = False) -> _Reading:
    """A headerless file of one-character delimiters, every column a string."""
    return _Reading(pacsv.ReadOptions(column_names=names, block_size=BLOCK_BYTES,
                                      encoding="latin-1" if latin1 else "utf8"),
                    pacsv.ParseOptions(delimiter=delimiter, quote_char=False),
                    pacsv.ConvertOptions(column_types={n: pa.string() for n in names}))


def _csv_reading(columns: list[str]) -> _Reading:
    """The ``columns`` (in this order, as text) of a CSV file with a header (``ratings.csv``,
    ``movies.csv``), wherever the header puts them; one it lacks is named."""
    return _Reading(pacsv.ReadOptions(block_size=BLOCK_BYTES), pacsv.ParseOptions(),
                    pacsv.ConvertOptions(include_columns=columns, column_types={c: pa.string() for c in columns}))


def _double_colon_reading() -> _Reading:
    """A MovieLens ``.dat`` file (Latin-1), each line read whole as column ``line``."""
    return _Reading(pacsv.ReadOptions(column_names=["line"], block_size=BLOCK_BYTES, encoding="latin-1"),
                    pacsv.ParseOptions(delimiter="\x1f", quote_char=False),
                    pacsv.ConvertOptions(column_types={"line": pa.string()}))


def _delimited(path: Path, delimiter: str, names: list[str], latin1: bool = False) -> Iterator[pa.RecordBatch]:
    """The batches of a headerless file of one-character delimiters, every column a string."""
    yield from _batches(path, _delimited_reading(delimiter, names, latin1))


def _csv(path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The batches of :func:`_csv_reading`'s ``columns`` of a CSV file with a header."""
    yield from _batches(path, _csv_reading(columns))


def _genre_flags(flags: pa.ChunkedArray, genre: str, layout: TextLayout) -> np.ndarray:
    """int64 ``[n]``: one genre's column of ``u.item`` (text ``0`` or ``1``); another value is
    a :class:`DataError` naming its line and the genre."""
    bad = pc.invert(pc.is_in(flags, value_set=pa.array(["0", "1"]))).to_numpy(zero_copy_only=False)
    if bad.any():
        row = int(np.argmax(bad))
        raise DataError(f"a genre flag must be 0 or 1, got {flags[row].as_py()!r}", file=layout.file.name,
                        column=genre, **place(layout, row))
    return pc.cast(flags, pa.int64()).to_numpy(zero_copy_only=False)


def _double_colon(path: Path, names: list[str]) -> Iterator[pa.RecordBatch]:
    """A MovieLens ``.dat`` file (``a::b::c``, Latin-1), split without a Python loop: each
    line read whole, then split on ``::``; a line of more or fewer fields is named."""
    first = 0
    reading = _double_colon_reading()
    for batch in _batches(path, reading):
        parts = pc.split_pattern(batch.column(0), "::")
        lengths = pc.list_value_length(parts).to_numpy(zero_copy_only=False)
        if (lengths != len(names)).any():
            at = int(np.argmax(lengths != len(names)))
            raise DataError(f"expected {len(names)} fields separated by '::', got {lengths[at]}", file=str(path),
                            **place(_layout(path, reading), first + at))
        first += batch.num_rows
        yield pa.RecordBatch.from_arrays([pc.list_element(parts, i) for i in range(len(names))], names=names)


LATIN1_BOM = b"\xef\xbb\xbf".decode("latin-1")
"""A UTF-8 byte order mark as a Latin-1 file's first characters (Arrow drops it only from
UTF-8 text)."""


def _local(path: Path) -> SourceFile:
    return SourceFile(str(path), str(path), pafs.LocalFileSystem())


def _layout(path: Path, reading: _Reading) -> TextLayout:
    """Where the rows of a file of the MovieLens directory lie on its lines."""
    return text_layout(_local(path), reading.read, reading.parse)


def _batches(path: Path, reading: _Reading) -> Iterator[pa.RecordBatch]:
    """The record batches of a file of the MovieLens directory (bad ones named), without the
    byte order mark a Latin-1 file may begin with."""
    if not path.is_file():
        raise DataError("missing from the MovieLens directory", file=str(path))
    read = reading.read
    batches = csv_batches(_local(path), read, reading.parse, reading.convert, "a MovieLens file")
    first = next(batches, None)
    if first is None:
        return
    if read.encoding == "latin-1" and first.num_rows and (first.column(0)[0].as_py() or "").startswith(LATIN1_BOM):
        unmarked = pc.replace_substring_regex(first.column(0), f"^{LATIN1_BOM}", "", max_replacements=1)
        first = first.set_column(0, first.schema.field(0), unmarked)
    yield first
    yield from batches


def _in_day_order(patterns: Sequence[str]) -> list[str]:
    """The files ``patterns`` name (globs expanded), by their file names with numbers by
    value (``day_2`` before ``day_10``, wherever each lies), then their paths."""
    files = expand(patterns)
    return [f.name for f in sorted(files, key=lambda f: (natural_key(posixpath.basename(f.path)),
                                                         natural_key(f.path)))]


def _read_all(batches: Iterator[pa.RecordBatch]) -> pa.Table:
    return pa.Table.from_batches(list(batches))
