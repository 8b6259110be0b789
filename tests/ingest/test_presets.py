"""``neorec data convert`` presets on hand-written fixtures in each public format: the rows,
splits and features come out as the format says, and ``neorec train`` runs on the result."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from neorec.ingest.importer import import_dataset
from neorec.ingest.presets import PresetOptions, preset
from neorec.ingest.schema import Dataset
from tests.conftest import FIXTURES


def convert(name: str, path, out, **options) -> Dataset:
    spec, source = preset(name, [str(path)], PresetOptions(**options))
    return import_dataset(spec, out, source=source, profile=name)


def rows(dataset: Dataset, split: str) -> list[dict]:
    return [r for f in dataset.files(split) for r in pq.read_table(f).to_pylist()]


def test_criteo_tsv_keeps_counts_and_the_file_order_split(tmp_path):
    dataset = convert("criteo", FIXTURES / "criteo_sample.tsv", tmp_path, eval_fraction=0.5)
    assert dataset.rows == {"train": 2, "eval": 2}  # the last rows are the eval split
    first = rows(dataset, "train")[0]
    assert first["label"] == 0.0 and first["I5"] == 1382.0 and first["I12"] == 0.0  # missing → 0
    assert first["C22"] == 0  # a missing categorical
    assert [r["label"] for r in rows(dataset, "eval")] == [0.0, 1.0]  # the fixture's third and fourth lines
    assert [f.name for f in dataset.schema.sparse] == [f"C{i}" for i in range(1, 27)]


def test_avazu_splits_by_hour(tmp_path):
    dataset = convert("avazu", FIXTURES / "avazu_sample.csv", tmp_path, eval_fraction=0.25)
    assert dataset.rows == {"train": 12, "eval": 4}  # the last of the four hours
    assert "hour" not in [f.name for f in dataset.schema.sparse] and not dataset.schema.dense
    assert [r["label"] for r in rows(dataset, "train")][:4] == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("directory,users", [("movielens-100k", True), ("movielens-1m", True),
                                             ("movielens-25m", False)])
def test_movielens_joins_users_and_genres(tmp_path, directory, users):
    dataset = convert("movielens", FIXTURES / directory, tmp_path, eval_fraction=0.25)
    names = [f.name for f in dataset.schema.sparse]
    assert names == (["user", "item", "gender", "age", "occupation", "zip", "genres"] if users
                     else ["user", "item", "genres"])
    assert dataset.schema.sparse[-1].multi_hot
    genres = pq.read_table(tmp_path / "vocab" / "genres.parquet")["value"].to_pylist()
    train = rows(dataset, "train")
    assert all(0 < i <= len(genres) for r in train for i in r["genres"])
    assert "(no genres listed)" not in genres and "" not in genres
    assert {r["label"] for r in train} <= {0.0, 1.0}


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_each_preset_trains(tmp_path):
    cases = [("criteo", FIXTURES / "criteo_sample.tsv", ["--eval-fraction", "0.5"]),
             ("avazu", FIXTURES / "avazu_sample.csv", ["--eval-fraction", "0.25"]),
             ("movielens", FIXTURES / "movielens-1m", ["--eval-fraction", "0.25"])]
    for name, path, flags in cases:
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "neorec.orchestration.cli", "data", "convert", name, str(path), "--out",
                               str(out), *flags], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rows"] == Dataset.load(out).rows
        run = tmp_path / f"run-{name}"
        done = subprocess.run([sys.executable, "-m", "neorec.orchestration.cli", "train", "configs/demo.toml",
                               "--set", f"data.path='{out}'", "--set", f"run.dir='{run}'",
                               "--set", "train.batch_size=2", "--set", "data.remainder='pad'"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] >= 1 and 0 <= summary["eval_auc"] <= 1
