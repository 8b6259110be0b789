"""``neorec data import … --partition NAME``: one more time partition of an imported dataset.

The new rows are encoded exactly as the dataset's own (its vocabularies, hashing and dense
statistics, :func:`~neorec.ingest.importer.load_encoding`), so the schema and the tables'
sizes do not change: a categorical value the vocabularies do not hold becomes the
out-of-vocabulary id 0, and is counted per column (``partition.json``'s ``oov``, next to
``values``, the values present). Every row goes to the partition (no train/eval split:
following evaluates each partition before training on it).

The files are written into ``partitions/NAME/`` and fsynced, and the ``_SUCCESS`` marker is
written last (:mod:`neorec.ingest.partitions`), so a follower never reads a partition half
written, even after a power loss. One import writes a partition at a time (a second is
refused, naming the first's process); an import that fails removes what it wrote, and a
directory left without its marker by one that was killed is written again.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from neorec.common.dir_lock import LOCK_FILE, DirectoryLock
from neorec.common.durable import fsync_directories, fsync_tree, write_durably
from neorec.ingest.errors import DataError
from neorec.ingest.import_spec import ImportSpec, SpecError
from neorec.ingest.importer import (BlockSource, Encoding, ProgressFn, VocabMisses, arrow_schema,
                                    dataset_schema, encode_block, load_encoding, needed_columns)
from neorec.ingest.partitions import (MARKER, PARTITION_FILE, PartitionError, PartitionOrderError,
                                      PartitionSchemaError, is_ready, partition_names, partitions_dir)
from neorec.ingest.schema import DATASET_FILE, Dataset, DatasetSchema
from neorec.ingest.sources import MISSING, FileSource
from neorec.ingest.split_writer import SplitWriter

PART_PREFIX = "part"
"""The partition's files are ``part-00000.parquet``, …"""


def recorded_spec(dataset_dir: str | Path) -> dict[str, Any]:
    """The import spec (as TOML's sections) the dataset at ``dataset_dir`` was imported or
    converted with, less its input files and split: the spec of its next partition, whose
    files the caller names. Raises :class:`PartitionError` for a directory that holds no
    dataset, and :class:`SpecError` for a dataset that no such spec describes (synthetic,
    or converted from files the importer joins, as MovieLens's)."""
    root = Path(dataset_dir)
    generator = _dataset_to_extend(root).generator or {}
    if generator.get("kind") != "import" or "spec" not in generator:
        raise SpecError(f"{root / DATASET_FILE} records no import spec (it was not written by neorec data import "
                        f"or convert): give the partition's import spec")
    if generator.get("block_source"):
        raise SpecError(f"{root / DATASET_FILE}: the dataset was read by {generator['block_source']}, which joins "
                        f"its files: give the partition's import spec")
    spec = {section: dict(keys) for section, keys in generator["spec"].items() if section != "split"}
    spec["input"] = {key: value for key, value in spec["input"].items() if key != "files"}
    return spec


def import_partition(spec: ImportSpec, dataset_dir: str | Path, name: str, *, source: BlockSource | None = None,
                     progress: ProgressFn | None = None) -> dict[str, Any]:
    """Write the rows ``spec`` reads as partition ``name`` of the imported dataset at
    ``dataset_dir``; returns the partition's description (``rows``, ``oov``, ``values``,
    written to its ``partition.json``, and the import's ``seconds``).

    Raises :class:`PartitionError` for a name that is not a partition's or is taken,
    :class:`PartitionOrderError` when a ready partition sorts after ``name``,
    :class:`PartitionSchemaError` when ``spec`` encodes other columns or table sizes than
    the dataset's, :class:`DataError` for bad rows or no rows at all."""
    started = time.perf_counter()
    root = Path(dataset_dir)
    dataset = _dataset_to_extend(root)
    _check_name(root, name)
    _check_same_missing(name, root, dataset.generator or {})
    _check_same_encoding(name, root, (dataset.generator or {}).get("spec"), spec)  # first: it names the key
    encoding = load_encoding(spec, root)
    schema = dataset_schema(spec, encoding)
    if schema != dataset.schema:
        raise PartitionSchemaError(f"partition {name!r} would change the dataset's schema: "
                                   f"{_difference(dataset.schema.to_json(), schema.to_json())}", file=str(root))
    directory = partitions_dir(root) / name
    held = DirectoryLock(directory, what="partition", owners="another import of it")
    try:
        _check_name(root, name)  # again, holding it: another import may have finished it meanwhile
        info = _write_partition(spec, root, directory, encoding, schema, source, progress, started)
    except BaseException:
        if not is_ready(root, name):  # nothing half written is left to block the partitions after it
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        held.release()
    return info


def _write_partition(spec: ImportSpec, root: Path, directory: Path, encoding: Encoding, schema: DatasetSchema,
                     source: BlockSource | None, progress: ProgressFn | None, started: float) -> dict[str, Any]:
    """Write the partition's files into ``directory`` (held), then its description, then
    (every file on the disk first) its marker; returns the description."""
    for stale in directory.iterdir():  # an earlier import that was killed before its marker
        if stale.is_file() and stale.name != LOCK_FILE:
            stale.unlink()
    misses = VocabMisses({column: 0 for column in encoding.vocabularies}, {c: 0 for c in encoding.vocabularies})
    with SplitWriter(directory, PART_PREFIX, arrow_schema(schema), spec.output.row_group_rows,
                     spec.output.file_rows) as writer:
        for block in (source or FileSource(spec)).blocks(needed_columns(spec)):
            writer.write(encode_block(spec, encoding, block, misses))
            if progress is not None:
                progress(block.batch.num_rows)
    if writer.rows == 0:
        raise DataError(f"partition {directory.name!r}: the input holds no rows", file=str(directory))
    info = {"rows": writer.rows, "oov": misses.unseen, "values": misses.present}  # the same input: the same bytes
    (directory / PARTITION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    fsync_tree(directory)  # the files, then the directory's entry, are on the disk before the marker
    fsync_directories(directory.parent, up_to=root)
    write_durably(directory / MARKER, b"")
    return {**info, "seconds": time.perf_counter() - started}


def _check_name(root: Path, name: str) -> None:
    if (not name or name.startswith(("_", ".")) or any(c.isspace() or not c.isprintable() or c in "/\\*?[]"
                                                         for c in name)):
        raise PartitionError(f"{name!r} is not a partition name (no '/', '\\', wildcard or space, not starting "
                             "with '_' or '.')")
    if is_ready(root, name):
        raise PartitionError(f"partition {name!r} exists already", file=str(partitions_dir(root) / name))
    later = [n for n in partition_names(root) if n > name and is_ready(root, n)]
    if later:
        raise PartitionOrderError(f"partition {name!r} sorts before partition {later[-1]!r}, which has landed: "
                                  f"partitions must land in name (time) order", file=str(partitions_dir(root)))


def _check_same_missing(name: str, root: Path, generator: dict[str, Any]) -> None:
    """:class:`PartitionSchemaError` when the dataset was imported reading other text as a
    missing value than this import does (:data:`~neorec.ingest.sources.MISSING`): the
    partition's ids would mean something else than the dataset's. An earlier neorec
    recorded nothing, and read Arrow's ``NA``, ``null``, ``NaN``, … as missing too."""
    recorded = generator.get("missing")
    if generator.get("kind") != "import" or recorded == MISSING:
        return
    read = "Arrow's NA, null, NaN, … (an earlier neorec)" if recorded is None else ", ".join(map(repr, recorded))
    raise PartitionSchemaError(f"partition {name!r}: the dataset was imported reading {read} as missing values, "
                               f"this import only an empty field: import the dataset again to add partitions to it",
                               file=str(root / DATASET_FILE))


def _dataset_to_extend(root: Path) -> Dataset:
    """The dataset at ``root`` that a partition is added to (:class:`PartitionError` when
    there is none yet)."""
    try:
        return Dataset.load(root)
    except FileNotFoundError:
        raise PartitionError("no dataset to add a partition to: import the first data without --partition",
                             file=str(root)) from None


ENCODING_KEYS = {"label": ("column", "transform"), "dense": ("columns", "transform", "fill"),
                 "categorical": ("columns", "encoding", "hash_rows"), "multivalued": ("columns",)}
"""What a partition's spec must share with the spec its dataset was imported with, beyond
the schema: what the values mean (the vocabularies themselves come from the dataset)."""


def _check_same_encoding(name: str, root: Path, imported: dict[str, Any] | None, spec: ImportSpec) -> None:
    """:class:`PartitionSchemaError` naming the first of :data:`ENCODING_KEYS` where ``spec``
    differs from the spec the dataset was ``imported`` with (None: not imported, nothing
    to compare)."""
    if imported is None:
        return
    now = asdict(spec)
    hashed = "hash" in (imported.get("categorical", {}).get("encoding"), spec.categorical.encoding)
    for section, keys in ENCODING_KEYS.items():
        for key in keys:
            if (section, key) == ("categorical", "hash_rows") and not hashed:
                continue  # only hashing folds ids into hash_rows
            before, after = imported.get(section, {}).get(key), now[section][key]
            if before != after:
                raise PartitionSchemaError(f"partition {name!r} would be encoded otherwise than the dataset: "
                                           f"{section}.{key} is {after!r}, the dataset was imported with {before!r}",
                                           file=str(root / DATASET_FILE))


def _difference(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The first schema key whose value differs, in words."""
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            return f"{key} is {before.get(key)!r} in the dataset, {after.get(key)!r} in the new rows"
    return "it differs"
