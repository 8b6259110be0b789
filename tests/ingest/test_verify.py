"""``neorec data verify``: one pass over a dataset names every bad row group."""

import json
import shutil
import subprocess

import pyarrow.parquet as pq
import pytest

from neorec.ingest.errors import DataError
from neorec.ingest.partitions import MARKER
from neorec.ingest.schema import DATASET_FILE, Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.ingest.verify import verify_dataset
from tests.ingest.workers import with_a_bit_flipped_in_each_column
from tests.cli import NEOREC, neorec_in_process


def _row_groups(paths) -> int:
    return sum(pq.ParquetFile(p).metadata.num_row_groups for p in paths)


def test_a_sound_dataset_is_read_whole_and_found_sound(criteo_dataset):
    read = []
    reports = verify_dataset(criteo_dataset, progress=read.append)
    assert [r.split for r in reports] == ["train", "eval"]
    for report in reports:
        assert report.problems == []
        assert report.rows == criteo_dataset.rows[report.split]
        assert report.files == len(criteo_dataset.files(report.split))
        assert report.row_groups == _row_groups(criteo_dataset.files(report.split))
    assert sum(read) == sum(criteo_dataset.rows.values())


def _copy(dataset: Dataset, to) -> Dataset:
    shutil.copytree(dataset.root, to)
    return Dataset.load(to)


def test_every_bad_row_group_is_named_and_the_reading_goes_on(criteo_dataset, tmp_path):
    dataset = _copy(criteo_dataset, tmp_path / "d")
    first, last = dataset.files("train")[0], dataset.files("train")[-1]
    first.write_bytes(next(with_a_bit_flipped_in_each_column(first, row_group=1)))
    last.write_bytes(next(with_a_bit_flipped_in_each_column(last, row_group=0)))
    described = json.loads((dataset.root / DATASET_FILE).read_text())
    described["rows"]["eval"] += 1
    (dataset.root / DATASET_FILE).write_text(json.dumps(described))
    train, evaluation = verify_dataset(Dataset.load(dataset.root))
    assert [(p.file, p.row_group) for p in train.problems] == [(str(first), 1), (str(last), 0)]
    assert all("CRC checksum verification failed" in p.problem for p in train.problems)
    assert train.rows == criteo_dataset.rows["train"]  # every row group was read
    (mismatch,) = evaluation.problems
    assert mismatch.file == str(dataset.root / DATASET_FILE)
    assert f"holds {criteo_dataset.rows['eval']:,} rows in its files, not the {criteo_dataset.rows['eval'] + 1:,}" in str(mismatch)


def test_ids_beyond_a_features_cardinality_are_named(criteo_dataset, tmp_path):
    dataset = _copy(criteo_dataset, tmp_path / "d")
    described = json.loads((dataset.root / DATASET_FILE).read_text())
    described["schema"]["sparse"][2]["cardinality"] = 1
    (dataset.root / DATASET_FILE).write_text(json.dumps(described))
    reports = verify_dataset(Dataset.load(dataset.root))
    name = described["schema"]["sparse"][2]["name"]
    problems = [p for r in reports for p in r.problems]
    assert len(problems) == _row_groups([*dataset.files("train"), *dataset.files("eval")])
    assert all(p.column == name and "is out of range for a table of 1 rows" in p.problem for p in problems)


def test_partitions_and_raw_ids_are_verified(tmp_path):
    partitioned = generate(SynthSpec(rows=3_000, row_group_rows=500, partitions=3, raw_ids=True, seed=2),
                           tmp_path / "p")
    reports = verify_dataset(partitioned)
    assert [r.split for r in reports] == ["partitions/2026-01-01T00", "partitions/2026-01-01T01",
                                          "partitions/2026-01-01T02"]
    assert sum(r.rows for r in reports) == 3_000 and not any(r.problems for r in reports)
    (tmp_path / "p" / "partitions" / "2026-01-01T01" / MARKER).unlink()  # as while its writer is at work
    reports = verify_dataset(partitioned)
    assert [(r.split, r.ready, r.rows) for r in reports] == [("partitions/2026-01-01T00", True, 1_000),
                                                             ("partitions/2026-01-01T01", False, 0),
                                                             ("partitions/2026-01-01T02", True, 1_000)]
    listed = neorec_in_process("data", "verify", tmp_path / "p")
    assert listed.returncode == 0, listed.stderr
    assert "partitions/2026-01-01T01: not marked ready (_SUCCESS): not read (training waits for it)" \
        in listed.stdout.splitlines()


def test_the_command_prints_a_line_a_split_and_exits_2_naming_each_problem(criteo_dataset, tmp_path):
    command = [*NEOREC, "data", "verify"]
    sound = subprocess.run([*command, str(criteo_dataset.root)], capture_output=True, text=True, timeout=120)
    assert sound.returncode == 0, sound.stderr
    assert sound.stdout.splitlines()[0] == (f"train: {len(criteo_dataset.files('train'))} files, "
                                            f"{_row_groups(criteo_dataset.files('train'))} row groups, "
                                            f"{criteo_dataset.rows['train']:,} rows, 0 problems")
    dataset = _copy(criteo_dataset, tmp_path / "d")
    victim = dataset.files("eval")[0]
    victim.write_bytes(next(with_a_bit_flipped_in_each_column(victim, row_group=0)))
    damaged = subprocess.run([*command, str(dataset.root)], capture_output=True, text=True, timeout=120)
    assert damaged.returncode == 2, damaged.stderr
    assert "eval: " in damaged.stdout and ", 1 problem\n" in damaged.stdout
    errors = [line for line in damaged.stderr.splitlines() if line.startswith("neorec:")]
    assert errors[0].startswith(f"neorec: file {victim}, row group 0: cannot read row group")
    assert errors[-1] == f"neorec: error: 1 problem in {dataset.root}"
    assert "Traceback" not in damaged.stderr


def test_an_imported_dataset_s_vocabularies_are_verified_and_a_damaged_one_named(tmp_path):
    from neorec.ingest.importer import import_dataset
    from neorec.ingest.partition_import import import_partition
    from tests.ingest.test_importer import spec, write_log

    write_log(tmp_path / "log.csv")
    dataset = import_dataset(spec(tmp_path / "log.csv"), tmp_path / "d")
    sound = verify_dataset(dataset)
    assert [r.split for r in sound] == ["train", "eval", "vocab"] and not any(r.problems for r in sound)
    assert sound[-1].files == sound[-1].row_groups == len(list((tmp_path / "d" / "vocab").iterdir()))  # one each
    vocabulary = tmp_path / "d" / "vocab" / "user.parquet"
    vocabulary.write_bytes(next(with_a_bit_flipped_in_each_column(vocabulary, row_group=0)))
    (problem,) = verify_dataset(dataset)[-1].problems
    assert problem.file == str(vocabulary) and "cannot read this vocabulary" in problem.problem
    with pytest.raises(DataError, match=f"file {vocabulary}: cannot read this vocabulary"):  # as new data is encoded
        import_partition(spec(tmp_path / "log.csv"), tmp_path / "d", "2026-01-01T00")


def test_a_vocabulary_the_dataset_needs_and_lacks_is_named_by_its_column(tmp_path):
    from neorec.ingest.importer import import_dataset
    from tests.ingest.test_importer import spec, write_log

    write_log(tmp_path / "log.csv", rows=200)
    dataset = import_dataset(spec(tmp_path / "log.csv"), tmp_path / "d")
    (tmp_path / "d" / "vocab" / "item.parquet").unlink()
    (problem,) = verify_dataset(dataset)[-1].problems
    assert (problem.file, problem.column) == (str(tmp_path / "d" / "vocab" / "item.parquet"), "item")
    assert problem.problem.startswith("missing")
    for name in ("user", "genres"):
        (tmp_path / "d" / "vocab" / f"{name}.parquet").unlink()
    assert sorted(p.column for p in verify_dataset(dataset)[-1].problems) == ["genres", "item", "user"]
    hashed = import_dataset(spec(tmp_path / "log.csv", categorical={"encoding": "hash"}), tmp_path / "h")
    assert [r.split for r in verify_dataset(hashed)] == ["train", "eval"]  # no vocabulary needed
