"""Reading a whole dataset once, as training would, to find what would stop a run that
reaches it (``neorec data verify DIR``).

Every split and every ready partition is read row group by row group (a partition not yet
marked ready is listed, unread, as training would wait for it): each page's checksum,
the columns' types, every label, dense value and id (ids within their feature's stated
cardinality: the strict mapping, which no table size hides). A bad row group is reported
and the reading goes on with the next one, so one pass names every bad row group; a split
whose rows differ from the count ``dataset.json`` (or a partition's ``partition.json``)
gives is reported too, and so is an imported dataset's vocabulary that cannot be read, or
that its encoding needs and it lacks (named by its column).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from neorec.ingest.decoder import DecodeOptions, decode_table, open_files, open_parquet, read_row_group
from neorec.ingest.errors import DataError
from neorec.ingest.partitions import (SPLIT_PREFIX, PartitionError, is_ready, open_partition, partition_names,
                                      partition_view, row_count_problem)
from neorec.ingest.importer import VOCAB_DIRECTORY
from neorec.ingest.schema import RAW_CARDINALITY, Dataset
from neorec.ingest.vocab import Vocabulary


@dataclass
class SplitReport:
    """What reading one split (or partition, ``partitions/NAME``) found."""

    split: str
    files: int = 0
    row_groups: int = 0
    rows: int = 0
    problems: list[DataError] = field(default_factory=list)
    ready: bool = True
    """False for a partition without its ready marker (not read)."""


def verify_dataset(dataset: Dataset, progress: Callable[[int], object] = lambda rows: None) -> list[SplitReport]:
    """A report per split of ``dataset`` (``dataset.json``'s order), then per partition
    (name order; one not marked ready is reported unread); ``progress(rows)`` after each
    row group read."""
    raw = tuple(f.name for f in dataset.schema.sparse if f.cardinality == RAW_CARDINALITY)
    options = DecodeOptions(table_rows=tuple(1 if f.name in raw else f.cardinality for f in dataset.schema.sparse),
                            id_mapping="strict", raw_features=raw)
    reports = [_verify_files(dataset, split, options, progress) for split in dataset.splits]
    vocab_dir = dataset.root / VOCAB_DIRECTORY
    vocabularies = sorted(vocab_dir.glob("*.parquet"))
    missing = [c for c in needed_vocabularies(dataset) if not (vocab_dir / f"{c}.parquet").is_file()]
    if vocabularies or missing:
        reports.append(_verify_vocabularies(vocabularies, [vocab_dir / f"{c}.parquet" for c in missing]))
    for name in partition_names(dataset.root):
        if not is_ready(dataset.root, name):
            reports.append(SplitReport(SPLIT_PREFIX + name, ready=False))
            continue
        try:
            partition = open_partition(dataset.root, name)
        except PartitionError as err:
            reports.append(SplitReport(SPLIT_PREFIX + name, problems=[err]))
            continue
        reports.append(_verify_files(partition_view(dataset, partition), partition.split, options, progress))
    return reports


def _verify_files(dataset: Dataset, split: str, options: DecodeOptions,
                  progress: Callable[[int], object]) -> SplitReport:
    """Read the files of ``split``."""
    paths = dataset.files(split)
    report = SplitReport(split, files=len(paths))
    for path in paths:
        try:
            (parquet_file,) = open_files([path], dataset.schema)
        except DataError as err:
            report.problems.append(err)
            continue
        with parquet_file:
            for group in range(parquet_file.num_row_groups):
                rows = parquet_file.metadata.row_group(group).num_rows
                report.row_groups += 1
                report.rows += rows
                try:
                    table = read_row_group(parquet_file, str(path), group, dataset.schema)
                    decode_table(table, dataset.schema, options, file=str(path), row_group=group)
                except DataError as err:
                    report.problems.append(err)
                progress(rows)
    miscounted = None if report.problems else row_count_problem(dataset, split, report.rows)
    if miscounted is not None:
        report.problems.append(miscounted)
    return report


def needed_vocabularies(dataset: Dataset) -> list[str]:
    """The columns whose vocabularies an imported dataset keeps: its categorical columns,
    when it encoded them with vocabularies (none for hashed or raw ids, or another dataset)."""
    generator = dataset.generator or {}
    encoding = ((generator.get("spec") or {}).get("categorical") or {}).get("encoding")
    if generator.get("kind") != "import" or encoding != "vocab":
        return []
    return [feature.name for feature in dataset.schema.sparse]


def _verify_vocabularies(paths: list[Path], missing: list[Path]) -> SplitReport:
    """Read an imported dataset's vocabularies (reported as ``vocab``): new data and its
    partitions are encoded with them; each of ``missing`` (``vocab/COLUMN.parquet``, that
    the dataset's encoding needs) is a problem naming its column."""
    report = SplitReport(VOCAB_DIRECTORY, files=len(paths),
                         problems=[DataError("missing: the dataset's ids of this column are this vocabulary's, and "
                                             "new data and partitions are encoded with it", file=str(path),
                                             column=path.stem) for path in missing])
    for path in paths:
        try:
            report.rows += len(Vocabulary.load(path).values)
        except DataError as err:
            report.problems.append(err)
            continue
        with open_parquet(path) as vocabulary:  # read whole above: its footer is sound
            report.row_groups += vocabulary.metadata.num_row_groups
    return report
