"""Time partitions of a dataset and the order follow mode reads them in.

A dataset directory (its ``dataset.json`` gives the schema) may hold partitions::

    DATASET/partitions/2026-11-25T03/part-00000.parquet
                                    /partition.json     (optional: rows, oracle, import counts)
                                    /_SUCCESS           (empty, written last)

Partition names sort in time order. A partition is *ready* once its ``_SUCCESS`` marker
exists, as Spark and Hive writers leave it; before that it is never read, however many of
its files are already there. Names beginning with ``_`` or ``.`` (a writer's temporary
directories and files) are not partitions and not data files.

Follow mode trains the partitions once each, in name order: the next one is the first
partition directory after the last trained one, and the reader waits for its marker. A
marker that appears on a name sorting before the last trained partition is a
:class:`PartitionOrderError`; files without the dataset's columns and types are a
:class:`PartitionSchemaError`. A partition is read like a split named ``partitions/NAME``
(:func:`partition_view`), by the in-process reader and the reader services alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from neorec.common.errors import UserError
from neorec.ingest.decoder import open_files
from neorec.ingest.errors import DataError, UnreadableFileError
from neorec.ingest.fingerprint import fingerprints, first_change
from neorec.ingest.schema import DATASET_FILE, Dataset, count_field, metrics_field

PARTITIONS = "partitions"
MARKER = "_SUCCESS"
PARTITION_FILE = "partition.json"
"""Optional description a writer leaves in a partition: ``rows``, ``oracle`` (synthetic
data: the teacher's metrics on the partition), ``oov`` (import: values not in the
vocabularies, per column)."""
SPLIT_PREFIX = PARTITIONS + "/"


class PartitionError(DataError, UserError):
    """A partition cannot be followed; the message names it."""


class PartitionOrderError(PartitionError):
    """A partition landed after a partition whose name sorts after it was trained."""


class PartitionSchemaError(PartitionError):
    """A partition's files lack the dataset's columns or change their types."""


@dataclass(frozen=True)
class Partition:
    """A ready partition: its name, its Parquet files (relative to the dataset root, in
    name order), when its marker was written (wall-clock seconds) and its description."""

    name: str
    files: tuple[str, ...]
    marker_time: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def split(self) -> str:
        """The split name a reader reads the partition as."""
        return SPLIT_PREFIX + self.name


def partitions_dir(root: str | Path) -> Path:
    return Path(root) / PARTITIONS


def _visible(name: str) -> bool:
    return not name.startswith(("_", "."))


def partition_names(root: str | Path) -> list[str]:
    """Every partition directory of the dataset at ``root``, ready or not, in name order."""
    directory = partitions_dir(root)
    if not directory.is_dir():
        return []
    return sorted(e.name for e in os.scandir(directory) if e.is_dir() and _visible(e.name))


def first_ready(root: str | Path) -> Partition | None:
    """The first partition in name order that is ready, or None while none is."""
    name = next((n for n in partition_names(root) if is_ready(root, n)), None)
    return None if name is None else open_partition(root, name)


def is_ready(root: str | Path, name: str) -> bool:
    return (partitions_dir(root) / name / MARKER).is_file()


def open_partition(root: str | Path, name: str) -> Partition:
    """The ready partition ``name``; :class:`PartitionError` when it has no marker or no
    Parquet file."""
    directory = partitions_dir(root) / name
    marker = directory / MARKER
    try:
        marker_time = marker.stat().st_mtime
    except FileNotFoundError:
        raise PartitionError(f"partition {name!r} has no {MARKER} marker (not completely written)",
                             file=str(directory)) from None
    files = sorted(e.name for e in os.scandir(directory)
                   if e.is_file() and _visible(e.name) and e.name.endswith(".parquet"))
    if not files:
        raise PartitionError(f"partition {name!r} is marked complete but holds no .parquet file", file=str(directory))
    info: dict[str, Any] = {}
    described = directory / PARTITION_FILE
    if described.is_file():
        try:
            info = json.loads(described.read_text())
        except (OSError, ValueError, RecursionError) as err:  # UnicodeDecodeError, JSONDecodeError: ValueErrors
            raise PartitionError(f"not a readable JSON file: {err}", file=str(described)) from None
        try:
            info = _checked_info(info)
        except ValueError as err:
            raise PartitionError(str(err), file=str(described)) from None
    return Partition(name, tuple(f"{PARTITIONS}/{name}/{f}" for f in files), marker_time, info)


def _checked_info(info: Any) -> dict[str, Any]:
    """A partition's description with the fields the trainer reads checked (ValueError)."""
    if not isinstance(info, dict):
        raise ValueError("expected a JSON object")
    for key in ("oracle", "late_oracle"):
        if key in info:
            info[key] = metrics_field(info[key], key)
    if "rows" in info:
        info["rows"] = count_field(info["rows"], "rows")
    return info


def next_partition(root: str | Path, done: Sequence[str]) -> Partition | None:
    """The partition to train after ``done`` (the partitions trained so far, in order), or
    None while it is not ready (or there is none yet).

    Raises :class:`PartitionOrderError` naming a ready partition that sorts before the last
    trained one and was not trained: it landed too late to be trained in order.
    """
    names = partition_names(root)
    last = done[-1] if done else None
    if last is not None:
        trained = set(done)
        for name in names:
            if name >= last:
                break
            if name not in trained and is_ready(root, name):
                raise PartitionOrderError(
                    f"partition {name!r} landed after partition {last!r} was trained: partitions must land in name "
                    f"(time) order", file=str(partitions_dir(root) / name))
    later = [n for n in names if last is None or n > last]
    if not later or not is_ready(root, later[0]):
        return None
    return open_partition(root, later[0])


def partition_fingerprints(root: str | Path, partition: Partition) -> dict[str, list[int]]:
    """Each file of ``partition`` (relative to ``root``) and its ``[size, footer CRC-32]``
    (:mod:`neorec.ingest.fingerprint`); a file that cannot be read is :class:`PartitionError`."""
    prints = {}
    for name in partition.files:
        try:
            prints.update(fingerprints(root, [name]))
        except (OSError, ValueError) as err:
            raise PartitionError(f"partition {partition.name!r} holds a file that cannot be read: {err}",
                                 file=str(Path(root) / name)) from None
    return prints


def check_unchanged(root: str | Path, partition: Partition, planned: dict[str, list[int]]) -> None:
    """Raise :class:`PartitionError` naming a file of ``partition`` added, removed or
    rewritten since its files were ``planned`` (:func:`partition_fingerprints`): a run
    resumed inside it would go on in another plan of other rows."""
    changed = first_change(planned, partition_fingerprints(root, partition))
    if changed is not None:
        name, change = changed
        raise PartitionError(f"the run was training partition {partition.name!r}, and a file of it was {change} "
                             f"since: a partition must not change once it is marked ready ({MARKER})",
                             file=str(Path(root) / name))


def blocking_partition(root: str | Path, done: Sequence[str]) -> tuple[str, int] | None:
    """The partition to train after ``done`` when it is not ready while later ones are: its
    name and how many ready partitions wait behind it (None otherwise)."""
    last = done[-1] if done else None
    later = [n for n in partition_names(root) if last is None or n > last]
    if not later or is_ready(root, later[0]):
        return None
    behind = sum(1 for name in later[1:] if is_ready(root, name))
    return (later[0], behind) if behind else None


def partition_view(dataset: Dataset, partition: Partition) -> Dataset:
    """``dataset`` with ``partition`` as one more split, named :attr:`Partition.split`, and
    its rows when its ``partition.json`` gives them."""
    rows = dataset.rows if "rows" not in partition.info else {**dataset.rows, partition.split: partition.info["rows"]}
    return replace(dataset, splits={**dataset.splits, partition.split: list(partition.files)}, rows=rows)


def row_count_problem(dataset: Dataset, split: str, found: int) -> DataError | None:
    """The error when the files of ``split`` (a split, or a partition as
    :func:`partition_view` adds it) hold ``found`` rows, not the count their description
    gives (``dataset.json``, or the partition's ``partition.json``): a file lost, cut
    short or added since they were written. None when they agree or no count is given."""
    expected = dataset.rows.get(split)
    if expected is None or expected == found:
        return None
    described_in = (partitions_dir(dataset.root) / split[len(SPLIT_PREFIX):] / PARTITION_FILE
                    if split.startswith(SPLIT_PREFIX) else dataset.root / DATASET_FILE)
    return DataError(f"{split!r} holds {found:,} rows in its files, not the {expected:,} this file gives: a file "
                     "lost, cut short or added since the data was written? (If its files were changed on purpose, "
                     "correct its 'rows'.)", file=str(described_in))


def with_partition_split(dataset: Dataset, split: str) -> Dataset:
    """``dataset`` able to read ``split`` when that names a ready partition
    (``partitions/NAME``); else ``dataset`` itself."""
    if split in dataset.splits or not split.startswith(SPLIT_PREFIX):
        return dataset
    name = split[len(SPLIT_PREFIX):]
    if not _visible(name) or "/" in name or not is_ready(dataset.root, name):
        return dataset
    return partition_view(dataset, open_partition(dataset.root, name))


def check_partition_schema(dataset: Dataset, partition: Partition) -> None:
    """Raise :class:`PartitionSchemaError` naming the partition, file and column when a
    file of ``partition`` lacks one of the dataset's columns or has another type, and
    :class:`PartitionError` naming the file when one cannot be opened as Parquet."""
    try:
        for parquet_file in open_files([dataset.root / f for f in partition.files], dataset.schema):
            parquet_file.close()
    except UnreadableFileError as err:
        raise PartitionError(f"partition {partition.name!r} holds a file that cannot be read: {err.problem}",
                             file=err.file) from None
    except DataError as err:
        raise PartitionSchemaError(f"partition {partition.name!r} changes the dataset's schema: {err.problem}",
                                   file=err.file, column=err.column) from None
