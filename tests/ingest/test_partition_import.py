"""``neorec data import --partition``: new rows encoded with the dataset's own vocabularies
(unseen values → id 0, counted), marker last, named errors for taken names, late names and
schema changes."""

import csv
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from neorec.common.dir_lock import DirectoryInUseError, DirectoryLock
from neorec.ingest.errors import DataError
from neorec.ingest.importer import import_dataset
from neorec.ingest.partition_import import import_partition
from neorec.ingest.partitions import (MARKER, PartitionError, PartitionOrderError, PartitionSchemaError,
                                      check_partition_schema, next_partition, open_partition)
from neorec.ingest.schema import Dataset
from neorec.trainer.run.train import train
from tests.cli import neorec_in_process
from tests.ingest.test_importer import reference, spec, write_log
from tests.ingest.test_presets import FIXTURES, criteo_line, write_criteo
from tests.trainer.follow_helpers import follow_config


@pytest.fixture
def imported(tmp_path):
    write_log(tmp_path / "old.csv", seed=0)
    write_log(tmp_path / "new.csv", rows=700, seed=1, users=600)  # more users: some unseen
    import_dataset(spec(tmp_path / "old.csv"), tmp_path / "data")
    return tmp_path


def test_a_partition_is_encoded_with_the_datasets_vocabularies_and_its_unseen_values_counted(imported):
    vocabs = reference(imported / "old.csv")["vocabs"]
    info = import_partition(spec(imported / "new.csv"), imported / "data", "2026-01-02T00")
    dataset = Dataset.load(imported / "data")
    partition = next_partition(dataset.root, [])
    assert partition.name == "2026-01-02T00" and partition.info["oov"] == info["oov"]
    check_partition_schema(dataset, partition)
    got = [r for f in partition.files for r in pq.read_table(dataset.root / f).to_pylist()]
    raw = list(csv.DictReader(open(imported / "new.csv")))
    assert len(got) == len(raw) == info["rows"]  # every row, in file order, no split
    for row, encoded in zip(raw, got):
        assert encoded["user"] == vocabs["user"].get(row["user"], 0)
        assert encoded["item"] == vocabs["item"].get(row["item"], 0)
        assert encoded["genres"] == [vocabs["genres"].get(g, 0) for g in row["genres"].split("|") if g]
        assert encoded["label"] == float(int(row["rating"]) >= 4)
    unseen_users = sum(r["user"] not in vocabs["user"] for r in raw)
    assert unseen_users > 0 and info["oov"]["user"] == unseen_users and info["values"]["user"] == len(raw)
    assert info["oov"]["item"] == sum(r["item"] not in vocabs["item"] for r in raw)


def test_a_dataset_imported_reading_na_as_missing_takes_no_partition_that_reads_it_as_a_value(imported):
    """An earlier neorec read Arrow's NA, null, NaN, … as missing values and recorded
    nothing: a partition imported now would give those values ids the dataset never gave."""
    assert Dataset.load(imported / "data").generator["missing"] == [""]
    recorded = json.loads((imported / "data" / "dataset.json").read_text())
    del recorded["generator"]["missing"]
    (imported / "data" / "dataset.json").write_text(json.dumps(recorded))
    with pytest.raises(PartitionSchemaError, match="imported reading Arrow's NA, null, NaN, … .an earlier neorec. as "
                                                   "missing values, this import only an empty field: import the "
                                                   "dataset again"):
        import_partition(spec(imported / "new.csv"), imported / "data", "2026-01-02T00")


def test_the_same_partition_imports_to_the_same_bytes(imported):
    for name in ("2026-01-02T00", "2026-01-02T01"):
        import_partition(spec(imported / "new.csv"), imported / "data", name)
    first, second = (imported / "data" / "partitions" / name for name in ("2026-01-02T00", "2026-01-02T01"))
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    assert all(p.read_bytes() == (second / p.name).read_bytes() for p in first.iterdir() if p.is_file())


def test_taken_and_late_names_a_schema_change_and_no_dataset_are_named_errors(imported):
    new = spec(imported / "new.csv")
    import_partition(new, imported / "data", "2026-01-02T05")
    with pytest.raises(PartitionError, match="exists already"):
        import_partition(new, imported / "data", "2026-01-02T05")
    with pytest.raises(PartitionOrderError, match="2026-01-02T05"):
        import_partition(new, imported / "data", "2026-01-02T04")
    with pytest.raises(PartitionSchemaError, match="categorical.columns is \\['user'\\]"):
        import_partition(spec(imported / "new.csv", categorical={"columns": ["user"]}), imported / "data",
                         "2026-01-02T06")
    for changed, said in (({"dense": {"transform": "log1p"}}, "dense.transform is 'log1p', the dataset was imported "
                                                               "with 'standardize'"),
                          ({"label": {"transform": ">= 3"}}, "label.transform is '>= 3'"),
                          ({"dense": {"fill": -5.0}}, "dense.fill is -5.0"),
                          ({"categorical": {"encoding": "raw"}}, "categorical.encoding is 'raw'")):
        with pytest.raises(PartitionSchemaError, match=f"would be encoded otherwise than the dataset: {said}"):
            import_partition(spec(imported / "new.csv", **changed), imported / "data", "2026-01-02T06")
    hash_rows = spec(imported / "new.csv", categorical={"hash_rows": 1000})  # unused by vocabularies: no difference
    import_partition(hash_rows, imported / "data", "2026-01-02T06")
    for bad in ("_tmp", "a b", "2026*", "a\\b", "a\nb"):
        with pytest.raises(PartitionError, match="not a partition name"):
            import_partition(new, imported / "data", bad)
    with pytest.raises(PartitionError, match="import the first data"):
        import_partition(new, imported / "nothing", "2026-01-02T06")


def test_a_partition_left_half_written_is_not_read_and_is_written_again(imported):
    directory = imported / "data" / "partitions" / "2026-01-02T00"
    directory.mkdir(parents=True)
    (directory / "part-00003.parquet").write_bytes(b"half a file")
    assert next_partition(imported / "data", []) is None
    import_partition(spec(imported / "new.csv"), imported / "data", "2026-01-02T00")
    assert (directory / MARKER).is_file() and not (directory / "part-00003.parquet").exists()
    assert open_partition(imported / "data", "2026-01-02T00").files == ("partitions/2026-01-02T00/part-00000.parquet",)


def test_the_partition_is_on_the_disk_before_its_marker(imported, monkeypatch):
    """A power loss after the marker was written must not find the files it marks missing."""
    synced = []
    partition = imported / "data" / "partitions" / "2026-01-02T00"

    def fsync_file(path):
        synced.append((str(Path(path).relative_to(imported / "data")), (partition / MARKER).exists()))

    monkeypatch.setattr("neorec.common.durable.fsync_file", fsync_file)
    import_partition(spec(imported / "new.csv", output={"row_group_rows": 250, "file_rows": 250}), imported / "data",
                     "2026-01-02T00")
    before_marker = [path for path, marked in synced if not marked]
    files = [f"partitions/2026-01-02T00/{name}" for name in ("part-00000.parquet", "part-00001.parquet",
                                                             "part-00002.parquet", "partition.json")]
    assert set(files) <= set(before_marker)
    assert before_marker[-3:] == ["partitions/2026-01-02T00", "partitions", "."]  # then the entries above them
    assert [path for path, marked in synced if marked] == ["partitions/2026-01-02T00"]  # the marker's name


def test_a_failed_import_leaves_nothing_to_block_the_partitions_after_it(imported):
    lines = (imported / "new.csv").read_text().splitlines()
    bad = imported / "bad.csv"
    bad.write_text("\n".join(lines[:300] + [lines[300].rsplit(",", 1)[0] + ",x"] + lines[301:]) + "\n")
    with pytest.raises(DataError, match="line 301: "):
        import_partition(spec(bad), imported / "data", "2026-01-02T00")
    assert not (imported / "data" / "partitions" / "2026-01-02T00").exists()
    import_partition(spec(imported / "new.csv"), imported / "data", "2026-01-02T00")  # the same name, once fixed
    assert next_partition(imported / "data", []).name == "2026-01-02T00"


def test_one_import_writes_a_partition_at_a_time(imported):
    directory = imported / "data" / "partitions" / "2026-01-02T00"
    first = DirectoryLock(directory, what="partition", owners="another import of it")  # an import at work
    (directory / "part-00000.parquet").write_bytes(b"being written")
    try:
        with pytest.raises(DirectoryInUseError, match=f"partition {directory} is in use by process {os.getpid()}"):
            import_partition(spec(imported / "new.csv"), imported / "data", "2026-01-02T00")
        assert (directory / "part-00000.parquet").read_bytes() == b"being written"  # its files untouched
    finally:
        first.release()


def test_a_converted_dataset_takes_a_partition_of_new_files_without_a_spec(tmp_path, caplog):
    """The spec the dataset was converted with is recorded: a new day of Criteo logs needs
    only its files, and is encoded as the dataset's own rows are. A following run trains
    that partition, and says the dataset's own train split is not trained."""
    day_0 = write_criteo(tmp_path / "day_0", [criteo_line(str(n % 2), [str(n)] * 13) for n in range(40)])
    day_1 = write_criteo(tmp_path / "day_1", [criteo_line(str(n % 2), [str(n)] * 13) for n in range(25)])
    out = tmp_path / "criteo"
    assert neorec_in_process("data", "convert", "criteo", day_0, "--out", out).returncode == 0
    added = neorec_in_process("data", "import", "--partition", "2026-01-02", "--files", day_1, "--out", out)
    assert added.returncode == 0, added.stderr
    dataset = Dataset.load(out)
    partition = open_partition(out, "2026-01-02")
    check_partition_schema(dataset, partition)
    new = pq.read_table(out / partition.files[0])
    old = pq.read_table(dataset.files("train")[0])
    assert partition.info["rows"] == new.num_rows == 25
    assert new.slice(0, 20).equals(old.slice(0, 20))  # the first rows of both days are the same lines
    without = neorec_in_process("data", "import", "--partition", "2026-01-03", "--out", out)
    assert without.returncode == 2 and "name the partition's files with --files" in without.stderr, without.stderr
    with caplog.at_level("WARNING", logger="neorec.trainer.run.follow"):
        summary = train(follow_config(out, tmp_path / "run", train={"batch_size": 8}))
    assert summary["partitions"] == 1 and summary["train_samples"] == 24
    assert "the dataset's own train split (36 rows) is not trained" in caplog.text


def test_a_partition_without_a_spec_is_refused_where_the_dataset_records_none(tmp_path, criteo_dataset):
    refused = neorec_in_process("data", "import", "--partition", "p1", "--files", tmp_path / "x.tsv", "--out",
                                criteo_dataset.root)
    assert refused.returncode == 2 and "records no import spec" in refused.stderr, refused.stderr
    movielens = tmp_path / "ml"
    assert neorec_in_process("data", "convert", "movielens", FIXTURES / "movielens-100k", "--out",
                             movielens).returncode == 0
    refused = neorec_in_process("data", "import", "--partition", "p1", "--files", tmp_path / "x", "--out", movielens)
    assert refused.returncode == 2 and "read by MovieLensSource, which joins its files" in refused.stderr
