import hashlib
import re

import numpy as np
import pytest
import pyarrow.parquet as pq

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import CRITEO_KAGGLE_CARDINALITIES, SynthSpec, generate


def _digest(dataset: Dataset) -> str:
    h = hashlib.sha256()
    for split in ("train", "eval"):
        for path in dataset.files(split):
            table = pq.read_table(path)
            for column in table.columns:
                h.update(repr(column.to_pylist()[:500]).encode())
                h.update(str(column.null_count).encode())
    return h.hexdigest()


def test_schema_and_oracle_are_recorded(criteo_dataset):
    loaded = Dataset.load(criteo_dataset.root)
    assert loaded.rows == {"train": 4800, "eval": 1200}
    assert [f.cardinality for f in loaded.schema.sparse] == list(CRITEO_KAGGLE_CARDINALITIES)
    assert len(loaded.schema.dense) == 13
    assert 0.6 < loaded.oracle["eval_auc"] < 0.95
    assert loaded.oracle["eval_ne"] < 1.0
    meta = pq.ParquetFile(loaded.files("train")[0]).metadata
    assert meta.row_group(0).num_rows == 700
    assert meta.row_group(0).column(0).compression == "ZSTD"


def test_ids_are_in_range_and_skewed(criteo_dataset):
    table = pq.read_table(criteo_dataset.files("train")[0])
    for feature in criteo_dataset.schema.sparse:
        ids = table.column(feature.name).drop_null().to_numpy()
        assert ids.min() >= 0 and ids.max() < feature.cardinality
    ids = table.column("C3").drop_null().to_numpy()
    _, counts = np.unique(ids, return_counts=True)
    # Zipf: the most frequent id is far more common than the median one
    assert counts.max() > 20 * np.median(counts)


def test_same_seed_same_data_other_seed_other_data(tmp_path):
    a = generate(SynthSpec(rows=1000, seed=1), tmp_path / "a")
    b = generate(SynthSpec(rows=1000, seed=1), tmp_path / "b")
    c = generate(SynthSpec(rows=1000, seed=2), tmp_path / "c")
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_multihot_profile_has_variable_length_lists(multihot_dataset):
    table = pq.read_table(multihot_dataset.files("train")[0])
    lengths = np.array([len(x) for x in table.column("M1").to_pylist()])
    assert 18 < lengths.mean() < 22
    assert lengths.std() > 2
    assert all(f.multi_hot for f in multihot_dataset.schema.sparse)


@pytest.mark.parametrize("changes,expected", [
    ({"eval_fraction": 0.0}, "eval_fraction must lie in (0, 1), got 0.0"),
    ({"eval_fraction": float("nan")}, "eval_fraction must lie in (0, 1), got nan"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"rows": 3, "partitions": 5}, "3 rows cannot fill 5 partitions"),
    ({"partitions": 2, "drift": float("inf")}, "partitions and drift must be >= 0"),
    ({"drift": 0.1}, "drift 0.1 turns the teacher between partitions: give partitions too"),
])
def test_a_spec_that_cannot_be_generated_is_a_user_error(changes, expected):
    from neorec.common.errors import UserError

    with pytest.raises(UserError, match=re.escape(expected)):
        SynthSpec(**{"rows": 100, **changes})
