"""``encoding = "raw"``: each categorical value keeps its whole 64-bit hash (any int64), the
columns are marked raw for dynamic tables; the hash encoding is that hash folded into rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from neorec.ingest.importer import import_dataset
from neorec.ingest.schema import RAW_CARDINALITY, Dataset
from tests.ingest.test_importer import spec, write_log

HASH_ROWS = 1000


def column(dataset: Dataset, split: str, name: str) -> np.ndarray:
    table = pq.read_table([str(p) for p in dataset.files(split)], columns=[name])
    values = table.column(0).combine_chunks()
    return (values.flatten() if hasattr(values, "flatten") else values).to_numpy()


def test_raw_ids_are_the_whole_hash_of_each_value(tmp_path: Path) -> None:
    write_log(tmp_path / "log.csv")
    raw = import_dataset(spec(tmp_path / "log.csv", categorical={"encoding": "raw"}), tmp_path / "raw")
    hashed = import_dataset(spec(tmp_path / "log.csv", categorical={"encoding": "hash", "hash_rows": HASH_ROWS}),
                            tmp_path / "hashed")
    reloaded = Dataset.load(tmp_path / "raw")
    assert all(f.raw and f.cardinality == RAW_CARDINALITY for f in reloaded.schema.sparse)
    assert not any(f.raw for f in Dataset.load(tmp_path / "hashed").schema.sparse)
    for split in ("train", "eval"):
        for name in ("user", "item", "genres"):
            ids = column(raw, split, name)
            assert ids.dtype == np.int64
            folded = (ids.view(np.uint64) % np.uint64(HASH_ROWS - 1)).astype(np.int64) + 1
            assert np.array_equal(folded, column(hashed, split, name))
    users = column(raw, "train", "user")
    assert (users < 0).any() and (users > 0).any() and len(np.unique(users)) > HASH_ROWS // 10
