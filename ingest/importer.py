"""``neorec data import``: any tabular click log → a neorec dataset, in bounded memory.

Passes over the input, each streaming it in blocks (:mod:`neorec.ingest.sources`):

1. (chronological split only) the time column alone, to find the row where the train
   split ends: the first ``1 - eval_fraction`` of the rows by time, ties in file order;
2. (vocabulary encoding or standardized dense values) counting, over the train split only:
   each categorical column's values, each dense column's mean and variance;
3. encoding and writing: the label made 0/1, dense values filled (and transformed),
   categorical values → ids (0 for missing and unseen), multi-valued columns → lists of ids,
   each row to its split's Parquet files (zstd, row groups of 64k rows).

Memory holds one block, the vocabularies, and for a chronological split the time column
(8 bytes a row). Every step is vectorized (Arrow compute, numpy, a Numba hash); no Python
code runs per row. Bad input is a :class:`~neorec.ingest.errors.DataError` naming the file, column
and line (found, for the error only, by reading the file again). The dataset keeps its
vocabularies (``vocab/COLUMN.parquet``) and the dense statistics, so that later data is
encoded the same way (``vocab_from``).
"""

from __future__ import annotations

import operator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from neorec.ingest.errors import DataError, no_column
from neorec.common.hashing import combine, splitmix64, unit_floats
from neorec.ingest.import_spec import LABEL_TRANSFORM, ImportSpec
from neorec.ingest.schema import RAW_CARDINALITY, Dataset, DatasetSchema, SparseFeature
from neorec.ingest.sources import MISSING, Block, FileSource, expand
from neorec.ingest.split_writer import SplitWriter
from neorec.ingest.vocab import ValueCounter, Vocabulary, as_strings, hash_encode

VOCAB_DIRECTORY = "vocab"
HASH_KEY = 0x4E52
"""Hashed ids are a function of the column's name and the value alone."""
CSV_TRUE, CSV_FALSE = pacsv.ConvertOptions().true_values, pacsv.ConvertOptions().false_values
"""The text of the booleans Arrow's CSV reader reads (as 1 and 0 where a number is due)."""
NULL_SPELLINGS = frozenset(pacsv.ConvertOptions().null_values) - {""}
"""Arrow's spellings of a missing value other than an empty field (``NA``, ``null``, ``NaN``,
…): values here (:data:`~neorec.ingest.sources.MISSING`), named as such when refused."""
COMPARISONS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt,
               "<": operator.lt}
ProgressFn = Callable[[int], None]


class BlockSource(Protocol):
    """Where the rows come from: the spec's files, or a preset's (e.g. joined) rows."""

    def blocks(self, columns: list[str]) -> Iterator[Block]:
        """Every row, in a fixed order, with (at least) ``columns``."""
        ...


@dataclass
class DenseStats:
    """Mean and standard deviation of each dense column over the train split."""

    mean: dict[str, float]
    std: dict[str, float]


@dataclass(frozen=True)
class Encoding:
    """How a spec's columns become ids and values: a vocabulary per categorical column (or
    hashing), the dense statistics."""

    vocabularies: dict[str, Vocabulary]
    dense: DenseStats | None

    def rows(self, spec: ImportSpec, column: str) -> int:
        vocabulary = self.vocabularies.get(column)
        if vocabulary is not None:
            return vocabulary.rows
        return RAW_CARDINALITY if spec.categorical.encoding == "raw" else spec.categorical.hash_rows


def import_dataset(spec: ImportSpec, out_dir: str | Path, *, source: BlockSource | None = None,
                   vocab_from: str | Path | None = None, progress: ProgressFn | None = None,
                   profile: str = "import") -> Dataset:
    """Write the dataset ``spec`` describes into ``out_dir`` (see the module docstring)."""
    block_source = None if source is None or isinstance(source, FileSource) else type(source).__name__  # joins files
    source = source or FileSource(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splitter = Splitter.build(spec, source)
    encoding = load_encoding(spec, Path(vocab_from)) if vocab_from else count(spec, source, splitter)
    schema = dataset_schema(spec, encoding)
    with ExitStack() as open_writers:
        writers = {split: open_writers.enter_context(SplitWriter(out, split, arrow_schema(schema),
                                                                 spec.output.row_group_rows, spec.output.file_rows))
                   for split in ("train", "eval")}
        for block in source.blocks(needed_columns(spec)):
            table = encode_block(spec, encoding, block)
            is_eval = splitter.is_eval(block)
            for split, mask in (("eval", is_eval), ("train", ~is_eval)):
                writers[split].write(table.filter(pa.array(mask)))
            if progress is not None:
                progress(block.batch.num_rows)
    rows = {split: writer.rows for split, writer in writers.items()}
    for split, count_ in rows.items():
        if count_ == 0:
            raise DataError(f"the {split} split is empty: change split.eval_fraction or split.eval_files "
                            f"(neorec data convert --eval-fraction / --eval-files; neorec data import "
                            f"--eval-fraction / --set split.eval_files=[...])",
                            file=_inputs(spec))
    vocab_dir = out / VOCAB_DIRECTORY
    vocab_dir.mkdir(exist_ok=True)
    for column, vocabulary in encoding.vocabularies.items():
        vocabulary.save(vocab_dir / f"{column}.parquet")
    dataset = Dataset(root=out, schema=schema, splits={s: w.files for s, w in writers.items()}, rows=rows,
                      profile=profile, generator={
                          "kind": "import", "spec": asdict(spec), "block_source": block_source,
                          "dense_transform": spec.dense.transform,
                          "dense_stats": asdict(encoding.dense) if encoding.dense else None,
                          "vocab_from": str(vocab_from) if vocab_from else None, "missing": MISSING})
    dataset.save()
    return dataset


def dataset_schema(spec: ImportSpec, encoding: Encoding) -> DatasetSchema:
    """The schema of the dataset ``spec`` encoded with ``encoding`` writes."""
    return DatasetSchema(label="label", dense=tuple(spec.dense.columns), sparse=tuple(
        SparseFeature(c, encoding.rows(spec, c), multi_hot=c in spec.multivalued.columns,
                      raw=spec.categorical.encoding == "raw")
        for c in spec.feature_columns))


# --------------------------------------------------------------------------------- splits
class Splitter:
    """Which rows of a block are eval rows (the same answer in every pass)."""

    def __init__(self, spec: ImportSpec, cutoff: tuple[float, int] | None, eval_files: set[str]) -> None:
        self.spec = spec
        self.cutoff = cutoff
        """Chronological: (the time of the last train row, how many rows of that time train);
        ordered: (unused, the train rows)."""
        self.eval_files = eval_files
        self._position = 0
        self._ties = 0

    @classmethod
    def build(cls, spec: ImportSpec, source: BlockSource) -> "Splitter":
        split = spec.split
        eval_files = _eval_files(split.eval_files, source) if split.kind == "files" else set()
        cutoff = None
        if split.kind == "chronological":
            cutoff = _cutoff(spec, source)
        elif split.kind == "ordered":  # the rows before this position train
            total = sum(b.batch.num_rows for b in source.blocks([spec.label.column]))
            cutoff = (float("nan"), _train_rows(total, spec))
        return cls(spec, cutoff, eval_files)

    def rewind(self) -> None:
        """Start again at the first row (a new pass)."""
        self._position = self._ties = 0

    def is_eval(self, block: Block) -> np.ndarray:
        """bool ``[rows]``; blocks must come in the source's order, once per pass."""
        rows = block.batch.num_rows
        split = self.spec.split
        if split.kind == "files":
            mask = np.full(rows, block.file in self.eval_files)
        elif split.kind == "ordered":
            mask = np.arange(self._position, self._position + rows) >= self.cutoff[1]
        elif split.kind == "random":
            index = np.arange(self._position, self._position + rows, dtype=np.uint64)
            mask = unit_floats(splitmix64(index ^ np.uint64(combine(split.seed, 0x5911)))) < split.eval_fraction
        else:
            last, ties_to_train = self.cutoff
            times = _times(block, split.time_column)
            tied = times == last
            tie_rank = self._ties + np.cumsum(tied) - 1
            self._ties += int(tied.sum())
            mask = ~((times < last) | (tied & (tie_rank < ties_to_train)))
        self._position += rows
        return mask


def _eval_files(patterns: list[str], source: BlockSource) -> set[str]:
    """The names, as the source's blocks give them, of the eval split's files: each must be
    one of a file source's files (the same file, however its path is written), and not all
    of them."""
    wanted = expand(patterns)
    if not isinstance(source, FileSource):
        return {f.name for f in wanted}
    inputs = {f.identity: f.name for f in source.files}
    for file in wanted:
        if file.identity not in inputs:
            raise DataError("an eval file must also be one of the files to import", file=file.name)
    names = {inputs[f.identity] for f in wanted}
    if len(names) == len(inputs):
        raise DataError("every file to import is an eval file: the train split would be empty",
                        file=" ".join(sorted(names)))
    return names


def _cutoff(spec: ImportSpec, source: BlockSource) -> tuple[float, int]:
    """The time of the last train row of a chronological split, and how many rows of that
    time are train rows (the first ones in file order). Every block's times must be of one
    kind (:func:`_time_kind`): a timestamp without an offset is in no time zone, so it
    orders against one with an offset, or a number, only by a guess."""
    column = spec.split.time_column
    parts, first = [], None
    for block in source.blocks([column]):
        values = _time_values(block, column)
        parts.append(_seconds(block, column, values))
        kind = _time_kind(values.type)
        if first is None:
            first = (kind, block.file)
        elif kind != first[0]:
            raise DataError(f"times are {kind} here, {first[0]} in {first[1]}: a chronological split orders times "
                            f"of one kind", file=block.file, column=column, **block.where(0))
    times = np.concatenate(parts or [np.zeros(0)])
    train_rows = _train_rows(times.size, spec)
    last = float(np.partition(times, train_rows - 1)[train_rows - 1])
    return last, train_rows - int((times < last).sum())


def _train_rows(total: int, spec: ImportSpec) -> int:
    """How many of ``total`` rows train (the first ones), by the spec's eval fraction."""
    if total < 2:
        raise DataError(f"{total} rows: too few to split into train and eval", file=_inputs(spec))
    return min(max(int(round(total * (1 - spec.split.eval_fraction))), 1), total - 1)


def _inputs(spec: ImportSpec) -> str:
    """The input files as the user named them (patterns included), for an error's message."""
    return " ".join(spec.input.files)


def _times(block: Block, column: str) -> np.ndarray:
    """float64 ``[rows]``: a time column's values, to be ordered (:func:`_seconds`)."""
    return _seconds(block, column, _time_values(block, column))


def _time_values(block: Block, column: str) -> pa.Array:
    """A block's time column as Arrow holds it (typed), its text read as :data:`TIME_KINDS`."""
    values = _column(block, column)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return _parsed_times(block, column, values)
    return values


def _seconds(block: Block, column: str, values: pa.Array) -> np.ndarray:
    """float64 ``[rows]``: a block's time ``values`` (:func:`_time_values`), to be ordered.
    Numbers are taken as they are; timestamps and dates (with or without an offset) become
    seconds since the epoch."""
    if values.null_count:
        raise DataError("missing time", file=block.file, column=column, **_where(block, values.is_null()))
    if pa.types.is_timestamp(values.type) or pa.types.is_date(values.type):
        nanoseconds = values.cast(pa.timestamp("ns", tz=getattr(values.type, "tz", None))).cast(pa.int64())
        return nanoseconds.to_numpy(zero_copy_only=False) / 1e9
    try:
        times = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise DataError(f"not a time (a number or timestamp): {values.type}", file=block.file, column=column) \
            from None
    bad = ~np.isfinite(times)  # NaN would order nowhere: the split would put it anywhere
    if bad.any():
        raise DataError(f"not a finite time: {times[bad][0]:g}", file=block.file, column=column, **_where(block, bad))
    return times


def _time_kind(kind: pa.DataType) -> str:
    """Which kind of time a column of type ``kind`` (:func:`_time_values`) holds, in words:
    numbers, timestamps (or dates) without an offset, or timestamps with one."""
    if pa.types.is_date(kind) or (pa.types.is_timestamp(kind) and kind.tz is None):
        return "timestamps without an offset"
    return "timestamps with an offset" if pa.types.is_timestamp(kind) else "numbers"


TIME_KINDS = (pa.float64(), pa.timestamp("ns"), pa.timestamp("ns", tz="UTC"))
"""What a time column's text may hold, all of a block alike: numbers, ISO 8601 timestamps
without an offset (or dates), ISO 8601 timestamps with one."""


def _parsed_times(block: Block, column: str, text: pa.Array) -> pa.Array:
    """A time column read as text, as the first of :data:`TIME_KINDS` that all the block's
    values read as; where none does, a :class:`DataError` naming the first value that is not
    of the kind of the block's first."""
    text = _lenient(text)
    for kind in TIME_KINDS:
        try:
            return pc.cast(text, kind)
        except pa.ArrowInvalid:
            continue
    first = text.drop_null()[:1]
    kind = next((k for k in TIME_KINDS if _parses(first, k)), TIME_KINDS[0])
    at = _first_unparsed(text, kind)
    raise DataError(f"not a time like the column's first (numbers or ISO 8601 timestamps, with an offset "
                    f"or without, all alike): {text[at].as_py()!r}", file=block.file, column=column,
                    **block.where(at))


# ------------------------------------------------------------------------------- counting
def count(spec: ImportSpec, source: BlockSource, splitter: Splitter) -> Encoding:
    """The vocabularies and dense statistics of the train split (one pass, if any is needed)."""
    vocab = spec.categorical.encoding == "vocab"
    standardize = spec.dense.transform == "standardize"
    counters = {c: ValueCounter() for c in spec.feature_columns} if vocab else {}
    sums = {c: np.zeros(3) for c in spec.dense.columns} if standardize else {}
    if counters or sums:
        for block in source.blocks(needed_columns(spec)):
            train = pa.array(~splitter.is_eval(block))
            for column, counter in counters.items():
                counter.add(_values(spec, block, column).filter(_repeat(train, spec, block, column)))
            for column, acc in sums.items():
                _accumulate(acc, block, column, _dense(spec, block, column, fill=False), np.asarray(train))
        splitter.rewind()
    vocabularies = {c: counter.vocabulary(spec.categorical.min_count, spec.categorical.max_rows)
                    for c, counter in counters.items()}
    stats = None
    if standardize:
        mean = {c: float(s[1] / s[0]) if s[0] else 0.0 for c, s in sums.items()}
        std = {c: float(np.sqrt(max(s[2] / s[0] - mean[c] ** 2, 0.0))) if s[0] else 1.0 for c, s in sums.items()}
        stats = DenseStats(mean, {c: v if v > 0 else 1.0 for c, v in std.items()})
    return Encoding(vocabularies, stats)


def _accumulate(acc: np.ndarray, block: Block, column: str, values: np.ndarray, train: np.ndarray) -> None:
    """Add a block's train values of a dense column (NaN: missing) to ``acc`` (count, sum,
    sum of squares); values too large for that (a sum beyond float64's range) are a
    :class:`DataError` naming the column and, if one value's square is, its line."""
    kept = train & ~np.isnan(values)
    with np.errstate(over="ignore", invalid="ignore"):
        squares = np.square(values)
        acc += (kept.sum(), values[kept].sum(), squares[kept].sum())
    if not np.isfinite(acc).all():
        huge = np.isinf(squares) & kept
        raise DataError("values too large to standardize: their squares sum beyond float64's range",
                        file=block.file, column=column, **(_where(block, huge) if huge.any() else {}))


def load_encoding(spec: ImportSpec, dataset_dir: Path) -> Encoding:
    """The vocabularies and dense statistics of an imported dataset, for new data."""
    other = Dataset.load(dataset_dir)
    vocabularies = {}
    if spec.categorical.encoding == "vocab":
        for column in spec.feature_columns:
            path = dataset_dir / VOCAB_DIRECTORY / f"{column}.parquet"
            if not path.is_file():
                raise DataError(f"no vocabulary of column {column!r} in that dataset", file=str(path))
            vocabularies[column] = Vocabulary.load(path)
    stats = (other.generator or {}).get("dense_stats")
    if spec.dense.transform == "standardize" and not stats:
        raise DataError("that dataset has no dense statistics (it did not standardize)", file=str(dataset_dir))
    return Encoding(vocabularies, DenseStats(**stats) if stats else None)


# ------------------------------------------------------------------------------- encoding
@dataclass
class VocabMisses:
    """Per vocabulary column: the values present, and those not in the vocabulary (which
    become id 0)."""

    present: dict[str, int]
    unseen: dict[str, int]

    def add(self, column: str, ids: np.ndarray, values: pa.Array) -> None:
        valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
        self.present[column] = self.present.get(column, 0) + int(valid.sum())
        self.unseen[column] = self.unseen.get(column, 0) + int(((ids == 0) & valid).sum())


def encode_block(spec: ImportSpec, encoding: Encoding, block: Block, misses: VocabMisses | None = None) -> pa.Table:
    """The dataset's columns for one block: ``label`` float32, dense float32, sparse int64
    (list<int64> for multi-valued columns); ``misses`` (when given) counts the values of
    vocabulary columns."""
    arrays = {"label": pa.array(_label(spec, block))}
    for column in spec.dense.columns:
        arrays[column] = pa.array(_dense_output(spec, encoding, block, column))
    for column in spec.feature_columns:
        multi = column in spec.multivalued.columns
        lists = _lists(spec, block, column) if multi else None
        values = pc.list_flatten(lists) if multi else as_strings(_column(block, column))
        vocabulary = encoding.vocabularies.get(column)
        ids = vocabulary.encode(values) if vocabulary is not None else hash_encode(
            values, 0 if spec.categorical.encoding == "raw" else spec.categorical.hash_rows,
            combine(HASH_KEY, *column.encode()))
        if misses is not None and vocabulary is not None:
            misses.add(column, ids, values)
        arrays[column] = pa.ListArray.from_arrays(pa.array(_list_offsets(lists).astype(np.int32)), pa.array(ids)) \
            if multi else pa.array(ids)
    return pa.table(arrays)


def _label(spec: ImportSpec, block: Block) -> np.ndarray:
    column = spec.label.column
    numbers = _numbers(block, column, "the label must be a number")
    if numbers.null_count:
        raise DataError("missing label", file=block.file, column=column, **_where(block, numbers.is_null()))
    values = numbers.to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(values)  # a transform would compare NaN or inf like any number
    if bad.any():
        raise DataError(f"the label must be a finite number, got {values[bad][0]:g}", file=block.file, column=column,
                        **_where(block, bad))
    if spec.label.transform:
        op, number, _ = LABEL_TRANSFORM.fullmatch(spec.label.transform).groups()
        return COMPARISONS[op](values, float(number)).astype(np.float32)
    bad = (values != 0) & (values != 1)
    if bad.any():
        raise DataError(f"the label must be 0 or 1 (or give label.transform), got {values[bad][0]:g}",
                        file=block.file, column=column, **_where(block, bad))
    return values.astype(np.float32)


def _dense(spec: ImportSpec, block: Block, column: str, fill: bool) -> np.ndarray:
    """float64 values of a dense column, missing ones ``dense.fill`` (``fill``) or NaN."""
    values = _numbers(block, column, "a dense column must hold numbers")
    out = pc.fill_null(values, spec.dense.fill).to_numpy(zero_copy_only=False).copy()
    bad = ~np.isfinite(out)
    if bad.any():
        raise DataError("not a finite number", file=block.file, column=column, **_where(block, bad))
    if not fill and values.null_count:
        out[values.is_null().to_numpy(zero_copy_only=False)] = np.nan
    return out


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _dense_output(spec: ImportSpec, encoding: Encoding, block: Block, column: str) -> np.ndarray:
    """float32 values of a dense column as the dataset holds them: filled and transformed.
    A value beyond float32's range, as read or once transformed, is a :class:`DataError`
    naming its line (as a text ``inf`` is)."""
    raw = _dense(spec, block, column, fill=True)
    with np.errstate(over="ignore"):
        values = raw
        if spec.dense.transform == "log1p":
            values = np.log1p(np.maximum(values, 0.0))
        elif spec.dense.transform == "standardize":
            values = (values - encoding.dense.mean[column]) / encoding.dense.std[column]
        out = values.astype(np.float32)
    bad = ~np.isfinite(out)
    if bad.any():
        at = int(np.argmax(bad))
        transformed = "" if values is raw else f", {values[at]:g} after {spec.dense.transform},"
        raise DataError(f"not a finite float32: {raw[at]:g}{transformed} is beyond float32's range "
                        f"(±{FLOAT32_MAX:.4g})", file=block.file, column=column, **block.where(at))
    return out


def _numbers(block: Block, column: str, problem: str) -> pa.Array:
    """A column's values as float64. Text (dense columns are read as text, so that a type
    Arrow would guess from a file's first block cannot refuse a later block's values) is
    parsed as numbers; where that fails, it is read leniently (:func:`_lenient`); a value
    still not a number is a :class:`DataError` saying ``problem`` and naming its row."""
    raw = _column(block, column)
    try:
        return pc.cast(raw, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if not (pa.types.is_string(raw.type) or pa.types.is_large_string(raw.type)):
            raise DataError(f"{problem}, got {raw.type}", file=block.file, column=column) from None
    lenient = _lenient(raw)
    try:
        return pc.cast(lenient, pa.float64())
    except pa.ArrowInvalid:
        at = _first_unparsed(lenient)
        value = raw[at].as_py()
        missing = " (only an empty field is a missing value)" if value.strip() in NULL_SPELLINGS else ""
        raise DataError(f"{problem}, got {value!r}{missing}", file=block.file, column=column,
                        **block.where(at)) from None


def _lenient(strings: pa.Array) -> pa.Array:
    """``strings`` as Arrow's CSV reader reads a column of numbers or booleans: blanks
    around a value ignored, a blank value missing, ``true``/``false`` 1 and 0."""
    trimmed = pc.utf8_trim_whitespace(strings)
    trimmed = pc.if_else(pc.equal(trimmed, ""), pa.scalar(None, trimmed.type), trimmed)
    ones = pc.is_in(trimmed, value_set=pa.array(CSV_TRUE, trimmed.type))
    zeros = pc.is_in(trimmed, value_set=pa.array(CSV_FALSE, trimmed.type))
    return pc.if_else(ones, pa.scalar("1", trimmed.type), pc.if_else(zeros, pa.scalar("0", trimmed.type), trimmed))


def _parses(strings: pa.Array, kind: pa.DataType = pa.float64()) -> bool:
    """Whether every one of ``strings`` reads as a ``kind`` (or is missing)."""
    try:
        pc.cast(strings, kind)
    except pa.ArrowInvalid:
        return False
    return True


def _first_unparsed(strings: pa.Array, kind: pa.DataType = pa.float64()) -> int:
    """The index of the first of ``strings`` (not all ``kind``) that does not read as a
    ``kind``: a bisection, each half cast whole."""
    low, high = 0, len(strings)  # it lies in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if _parses(strings.slice(low, middle - low), kind):
            low = middle
        else:
            high = middle
    return low


def _values(spec: ImportSpec, block: Block, column: str) -> pa.Array:
    """A categorical column's values as strings; a multi-valued column's values flattened."""
    raw = _column(block, column)
    if column not in spec.multivalued.columns:
        return as_strings(raw)
    return pc.list_flatten(_lists(spec, block, column))


def _lists(spec: ImportSpec, block: Block, column: str) -> pa.Array:
    """A multi-valued column as list<string>, missing → empty, empty values dropped."""
    raw = _column(block, column)
    delimiter = spec.multivalued.columns[column]
    if delimiter:
        lists = pc.split_pattern(as_strings(raw), delimiter)
    elif pa.types.is_list(raw.type) or pa.types.is_large_list(raw.type):
        lists = raw.cast(pa.list_(pa.string()))
    else:
        raise DataError(f"a multi-valued column without a delimiter must be a list column, got {raw.type}",
                        file=block.file, column=column)
    offsets = _list_offsets(lists)
    flat = lists.values.slice(lists.offsets[0].as_py(), int(offsets[-1]))
    keep = pc.fill_null(pc.not_equal(flat, ""), False).to_numpy(zero_copy_only=False)
    if lists.null_count:  # a missing list becomes empty
        keep &= np.repeat(lists.is_valid().to_numpy(zero_copy_only=False), np.diff(offsets))
    kept = np.concatenate([[0], np.cumsum(keep)])[offsets]
    return pa.ListArray.from_arrays(pa.array(kept.astype(np.int32)), flat.filter(pa.array(keep)))


def _list_offsets(lists: pa.Array) -> np.ndarray:
    return np.asarray(lists.offsets, dtype=np.int64) - lists.offsets[0].as_py()


def _repeat(train: pa.Array, spec: ImportSpec, block: Block, column: str) -> pa.Array:
    """The train mask of a block's rows, repeated for each value of a multi-valued column."""
    if column not in spec.multivalued.columns:
        return train
    return pa.array(np.repeat(np.asarray(train), np.diff(_list_offsets(_lists(spec, block, column)))))


def _column(block: Block, column: str) -> pa.Array:
    index = block.batch.schema.get_field_index(column)
    if index < 0:
        raise no_column(column, block.batch.schema.names, block.file)
    return block.batch.column(index)


def _where(block: Block, bad) -> dict[str, int]:
    """The place (:meth:`Block.where`: its line) of the first true value of ``bad``."""
    return block.where(int(np.argmax(np.asarray(bad))))


def needed_columns(spec: ImportSpec) -> list[str]:
    columns = [spec.label.column, *spec.dense.columns, *spec.feature_columns]
    if spec.split.kind == "chronological" and spec.split.time_column not in columns:
        columns.append(spec.split.time_column)
    return columns


def arrow_schema(schema: DatasetSchema) -> pa.Schema:
    return pa.schema([pa.field("label", pa.float32(), nullable=False)]
                     + [pa.field(c, pa.float32(), nullable=False) for c in schema.dense]
                     + [pa.field(f.name, pa.list_(pa.int64()) if f.multi_hot else pa.int64(), nullable=False)
                        for f in schema.sparse])
