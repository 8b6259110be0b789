"""Dataset description: the schema of its Parquet files and where its splits live.

A dataset directory holds Parquet files and a ``dataset.json`` describing them::

    {
      "format": "neorec-dataset/1",
      "profile": "criteo",
      "schema": {"label": "label", "dense": ["I1", ...],
                 "sparse": [{"name": "C1", "cardinality": 1460, "multi_hot": false,
                             "table": "t_C1"}, ...]},
      "splits": {"train": ["train-00000.parquet", ...], "eval": [...]},
      "rows": {"train": 200000, "eval": 50000},
      "oracle": {"eval_auc": 0.79, "eval_logloss": 0.45, "eval_ne": 0.8}
    }

Each sparse feature is one Parquet column (int64, or list<int64> when ``multi_hot``) and
feeds one embedding table; several features may share a table. The files' pages carry
checksums (``PARQUET_WRITE_OPTIONS``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from neorec.common.durable import write_durably
from neorec.ingest.errors import DataError, DatasetNotFoundError

DATASET_FORMAT = "neorec-dataset/1"
DATASET_FILE = "dataset.json"
PARQUET_WRITE_OPTIONS = {"compression": "zstd", "write_page_checksum": True}
"""How a dataset's Parquet files are written: zstd pages, each with a CRC-32 of its bytes
that every reader verifies (:func:`neorec.ingest.decoder.open_parquet`), so that a flipped
bit on disk is an error naming the file and row group, not different training data."""


RAW_CARDINALITY = 2**64
"""The cardinality of a feature of raw 64-bit ids."""


@dataclass(frozen=True)
class SparseFeature:
    """One categorical feature: a Parquet column of ids in ``[0, cardinality)``, or, when
    ``raw``, of any int64 (64-bit hashes of the values, for a dynamic table)."""

    name: str
    cardinality: int
    multi_hot: bool = False
    table: str = ""
    raw: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a sparse feature's name must be a non-empty string, got {self.name!r}")
        if not self.table:
            object.__setattr__(self, "table", f"t_{self.name}")
        if isinstance(self.cardinality, bool) or not isinstance(self.cardinality, int) or self.cardinality <= 0:
            raise ValueError(f"sparse feature {self.name!r}: cardinality must be a positive integer, "
                             f"got {self.cardinality!r}")
        if not isinstance(self.multi_hot, bool) or not isinstance(self.raw, bool) or not isinstance(self.table, str):
            raise ValueError(f"sparse feature {self.name!r}: multi_hot and raw must be true or false and table "
                             f"a string")


@dataclass(frozen=True)
class DatasetSchema:
    """Column layout shared by every file of a dataset."""

    label: str
    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.sparse)

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.feature_names]

    def table_cardinalities(self) -> dict[str, int]:
        """Rows each table needs to hold every id of the features feeding it."""
        rows: dict[str, int] = {}
        for f in self.sparse:
            rows[f.table] = max(rows.get(f.table, 0), f.cardinality)
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "dense": list(self.dense),
            "sparse": [{k: v for k, v in asdict(f).items() if k != "raw" or v} for f in self.sparse],
        }

    @classmethod
    def from_json(cls, obj: Any) -> "DatasetSchema":
        """The schema of a ``dataset.json``'s ``schema`` object; ``ValueError`` naming what
        is missing or of the wrong type."""
        if not isinstance(obj, dict):
            raise ValueError(f"'schema' must be an object, got {obj!r}")
        missing = [k for k in ("label", "dense", "sparse") if k not in obj]
        if missing:
            raise ValueError(f"'schema' lacks {', '.join(repr(k) for k in missing)}")
        label, dense, sparse = obj["label"], obj["dense"], obj["sparse"]
        if not isinstance(label, str) or not isinstance(dense, list) or not all(isinstance(d, str) for d in dense):
            raise ValueError("'schema': 'label' must be a column name and 'dense' a list of column names")
        if not isinstance(sparse, list) or not all(isinstance(f, dict) for f in sparse):
            raise ValueError("'schema': 'sparse' must be a list of objects")
        if not sparse:
            raise ValueError("'schema': 'sparse' lists no feature: a DLRM needs at least one sparse (categorical) "
                             "feature")
        features = []
        for f in sparse:
            unknown = set(f) - {"name", "cardinality", "multi_hot", "table", "raw"}
            if unknown or "name" not in f or "cardinality" not in f:
                raise ValueError(f"'schema': sparse feature {f!r} needs 'name' and 'cardinality' "
                                 f"(and optionally 'multi_hot', 'table', 'raw')")
            features.append(SparseFeature(**f))
        names = [label, *dense, *(f.name for f in features)]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"'schema' names column(s) {repeated} more than once")
        return cls(label=label, dense=tuple(dense), sparse=tuple(features))


@dataclass
class Dataset:
    """A dataset directory: schema, split files and, for synthetic data, the oracle."""

    root: Path
    schema: DatasetSchema
    splits: dict[str, list[str]]
    rows: dict[str, int] = field(default_factory=dict)
    profile: str = ""
    oracle: dict[str, float] | None = None
    generator: dict[str, Any] | None = None

    def files(self, split: str) -> list[Path]:
        if split not in self.splits:
            has = ", ".join(sorted(self.splits)) or "none"
            raise DataError(f"the dataset has no split {split!r} (it has {has})", file=str(self.root / DATASET_FILE))
        return [self.root / name for name in self.splits[split]]

    def save(self) -> None:
        obj = {
            "format": DATASET_FORMAT,
            "profile": self.profile,
            "schema": self.schema.to_json(),
            "splits": self.splits,
            "rows": self.rows,
            "oracle": self.oracle,
            "generator": self.generator,
        }
        write_durably(self.root / DATASET_FILE, (json.dumps(obj, indent=2) + "\n").encode())

    @classmethod
    def load(cls, root: str | Path) -> "Dataset":
        """The dataset at ``root``: :class:`DatasetNotFoundError` when it has no
        ``dataset.json``, :class:`DataError` naming the file and the problem when that is not
        a valid one."""
        root = Path(root)
        path = root / DATASET_FILE
        if not path.is_file():
            raise DatasetNotFoundError(f"{path} not found: not a neorec dataset directory")
        try:
            obj = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise DataError(f"not a readable JSON file: {err}", file=str(path)) from None
        if not isinstance(obj, dict):
            raise DataError("expected a JSON object", file=str(path))
        if obj.get("format") != DATASET_FORMAT:
            raise DataError(f"unknown format {obj.get('format')!r}, expected {DATASET_FORMAT!r}", file=str(path))
        try:
            if "schema" not in obj or "splits" not in obj:
                raise ValueError(f"lacks {'schema' if 'schema' not in obj else 'splits'!r}")
            splits = obj["splits"]
            if not isinstance(splits, dict) or not all(
                    isinstance(v, list) and all(isinstance(n, str) for n in v) for v in splits.values()):
                raise ValueError("'splits' must map split names to lists of file names")
            return cls(
                root=root,
                schema=DatasetSchema.from_json(obj["schema"]),
                splits={str(k): list(v) for k, v in splits.items()},
                rows=counts_field(obj.get("rows"), "rows"),
                profile=obj.get("profile", ""),
                oracle=metrics_field(obj.get("oracle"), "oracle"),
                generator=obj.get("generator"),
            )
        except (ValueError, TypeError) as err:
            raise DataError(str(err), file=str(path)) from None


def metrics_field(value: Any, name: str) -> dict[str, float] | None:
    """A described dataset's or partition's metrics (``oracle``: ``{"eval_auc": 0.8, …}``),
    checked: absent (None) or an object of numbers; ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in value.items()):
        raise ValueError(f"{name!r} must be an object of numbers (metric: value)")
    return {k: float(v) for k, v in value.items()}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def count_field(value: Any, name: str) -> int:
    """A count (a partition's ``rows``), checked: a whole number at least 0; ValueError
    naming ``name`` otherwise."""
    if not _is_count(value):
        raise ValueError(f"{name!r} must be a whole number at least 0")
    return value


def counts_field(value: Any, name: str) -> dict[str, int]:
    """Counts by name (``rows``: ``{"train": 1000, …}``), checked: absent or an object of
    whole numbers at least 0; ValueError naming ``name`` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in value.items()):
        raise ValueError(f"{name!r} must be an object of counts (name: whole number)")
    return dict(value)
