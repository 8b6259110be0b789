"""Reading a whole dataset once, as training would, to find what would stop a run that
reaches it (``neorec data verify DIR``).

Every split and every ready partition is read row group by row group: each page's checksum,
the columns' types, every label, dense value and id (ids within their feature's stated
cardinality: the strict mapping, which no table size hides). A bad row group is reported
and the reading goes on with the next one, so one pass names every bad row group; a split
whose rows differ from the count ``dataset.json`` (or a partition's ``partition.json``)
gives is reported too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from neorec.ingest.decoder import DecodeOptions, decode_table, open_files, read_row_group
from neorec.ingest.errors import DataError
from neorec.ingest.partitions import (PARTITION_FILE, SPLIT_PREFIX, PartitionError, is_ready, open_partition,
                                      partition_names, partitions_dir)
from neorec.ingest.schema import DATASET_FILE, RAW_CARDINALITY, Dataset


@dataclass
class SplitReport:
    """What reading one split (or partition, ``partitions/NAME``) found."""

    split: str
    files: int = 0
    row_groups: int = 0
    rows: int = 0
    problems: list[DataError] = field(default_factory=list)


def verify_dataset(dataset: Dataset, progress: Callable[[int], object] = lambda rows: None) -> list[SplitReport]:
    """A report per split of ``dataset`` (``dataset.json``'s order), then per ready
    partition (name order); ``progress(rows)`` after each row group read."""
    raw = tuple(f.name for f in dataset.schema.sparse if f.cardinality == RAW_CARDINALITY)
    options = DecodeOptions(table_rows=tuple(1 if f.name in raw else f.cardinality for f in dataset.schema.sparse),
                            id_mapping="strict", raw_features=raw)
    reports = [_verify_files(dataset, split, dataset.files(split), options, progress,
                             dataset.rows.get(split), dataset.root / DATASET_FILE)
               for split in dataset.splits]
    for name in partition_names(dataset.root):
        if not is_ready(dataset.root, name):
            continue
        try:
            partition = open_partition(dataset.root, name)
        except PartitionError as err:
            reports.append(SplitReport(SPLIT_PREFIX + name, problems=[err]))
            continue
        files = [dataset.root / f for f in partition.files]
        described_in = partitions_dir(dataset.root) / name / PARTITION_FILE
        reports.append(_verify_files(dataset, partition.split, files, options, progress, partition.info.get("rows"),
                                     described_in))
    return reports


def _verify_files(dataset: Dataset, split: str, paths: list[Path], options: DecodeOptions,
                  progress: Callable[[int], object], expected_rows: int | None, described_in: Path) -> SplitReport:
    """Read ``paths``, the files of ``split``, whose rows ``described_in`` gives as
    ``expected_rows`` (None: it gives none)."""
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
    if expected_rows is not None and expected_rows != report.rows and not report.problems:
        report.problems.append(DataError(f"{split!r} holds {report.rows:,} rows, not the {expected_rows:,} this file "
                                         "gives", file=str(described_in)))
    return report
