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
feeds one embedding table; several features may share a table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DATASET_FORMAT = "neorec-dataset/1"
DATASET_FILE = "dataset.json"


@dataclass(frozen=True)
class SparseFeature:
    """One categorical feature: a Parquet column of ids in ``[0, cardinality)``."""

    name: str
    cardinality: int
    multi_hot: bool = False
    table: str = ""

    def __post_init__(self) -> None:
        if not self.table:
            object.__setattr__(self, "table", f"t_{self.name}")
        if self.cardinality <= 0:
            raise ValueError(f"sparse feature {self.name!r}: cardinality must be positive")


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
            "sparse": [asdict(f) for f in self.sparse],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "DatasetSchema":
        return cls(
            label=obj["label"],
            dense=tuple(obj["dense"]),
            sparse=tuple(SparseFeature(**f) for f in obj["sparse"]),
        )


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
            raise KeyError(f"dataset {self.root} has no split {split!r} (has {sorted(self.splits)})")
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
        tmp = self.root / (DATASET_FILE + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        tmp.replace(self.root / DATASET_FILE)

    @classmethod
    def load(cls, root: str | Path) -> "Dataset":
        root = Path(root)
        path = root / DATASET_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: not a neorec dataset directory")
        obj = json.loads(path.read_text())
        if obj.get("format") != DATASET_FORMAT:
            raise ValueError(f"{path}: unknown format {obj.get('format')!r}, expected {DATASET_FORMAT!r}")
        return cls(
            root=root,
            schema=DatasetSchema.from_json(obj["schema"]),
            splits={k: list(v) for k, v in obj["splits"].items()},
            rows=dict(obj.get("rows") or {}),
            profile=obj.get("profile", ""),
            oracle=obj.get("oracle"),
            generator=obj.get("generator"),
        )
