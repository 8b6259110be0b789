"""Partitions: markers, order and schema, and the synthetic partitioned data."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.ingest.partitions import (MARKER, PartitionError, PartitionOrderError, PartitionSchemaError,
                                      blocking_partition, check_partition_schema, next_partition, open_partition, partition_names,
                                      with_partition_split)
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.errors import DataError
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate, partition_name
from tests.trainer.follow_helpers import partitioned


@pytest.fixture
def dataset(tmp_path):
    return Dataset.load(partitioned(tmp_path / "data", 2))


def _half_written(root, name):
    """A partition directory whose writer has not finished: a truncated Parquet file, no marker."""
    directory = root / "partitions" / name
    directory.mkdir(parents=True)
    good = next((root / "partitions" / partition_name(0)).glob("*.parquet")).read_bytes()
    (directory / "part-00000.parquet").write_bytes(good[: len(good) // 3])
    return directory


def test_synth_writes_marked_partitions_with_their_oracle(dataset):
    names = partition_names(dataset.root)
    assert names == [partition_name(0), partition_name(1)] == ["2026-01-01T00", "2026-01-01T01"]
    for name in names:
        partition = open_partition(dataset.root, name)
        assert partition.files == (f"partitions/{name}/part-00000.parquet",)
        assert partition.info["rows"] == 1200 == pq.ParquetFile(dataset.root / partition.files[0]).metadata.num_rows
        assert 0.6 < partition.info["oracle"]["auc"] < 0.95
    assert dataset.splits == {}


@pytest.mark.parametrize("oracle", ["high", {"auc": "x"}, {"auc": True}])
def test_a_partition_description_whose_oracle_is_not_numbers_is_named(dataset, oracle):
    described = dataset.root / "partitions" / partition_name(1) / "partition.json"
    described.write_text(json.dumps({**json.loads(described.read_text()), "oracle": oracle}))
    with pytest.raises(PartitionError, match=f"{described}: 'oracle' must be an object of numbers"):
        open_partition(dataset.root, partition_name(1))


@pytest.mark.parametrize("rows", [-1, 1.5, "1200", True])
def test_a_partition_description_whose_rows_is_not_a_count_is_named(dataset, rows):
    described = dataset.root / "partitions" / partition_name(1) / "partition.json"
    described.write_text(json.dumps({**json.loads(described.read_text()), "rows": rows}))
    with pytest.raises(PartitionError, match=f"{described}: 'rows' must be a whole number at least 0"):
        open_partition(dataset.root, partition_name(1))


def test_synth_partitions_hold_every_row_asked_for(tmp_path):
    generate(SynthSpec(rows=1_000, partitions=3, row_group_rows=500, seed=4), tmp_path)
    partitions = [open_partition(tmp_path, partition_name(index)) for index in range(3)]
    assert [partition.info["rows"] for partition in partitions] == [334, 333, 333]  # none of the 1,000 dropped
    assert [pq.ParquetFile(tmp_path / partition.files[0]).metadata.num_rows for partition in partitions] == [334, 333, 333]


def test_drift_changes_the_labels_of_later_partitions_only_as_asked(tmp_path):
    def labels(drift, index):
        root = tmp_path / f"d{drift}"
        if not root.exists():
            generate(SynthSpec(rows=2_000, partitions=2, drift=drift, row_group_rows=500, seed=4), root)
        return pq.read_table(root / "partitions" / partition_name(index) / "part-00000.parquet").column("label").to_numpy()

    assert (labels(0.0, 0) == labels(0.5, 0)).all()  # partition 0: the teacher has not moved yet
    assert (labels(0.0, 1) != labels(0.5, 1)).any()


def test_a_drifted_partition_holds_the_metrics_of_the_teacher_one_partition_late(tmp_path):
    def infos(drift):
        root = tmp_path / f"d{drift}"
        generate(SynthSpec(rows=6_000, partitions=2, drift=drift, row_group_rows=1_000, seed=4), root)
        return [open_partition(root, partition_name(index)).info for index in range(2)]

    assert not any("late_oracle" in info for info in infos(0.0))
    turned, whole_turn = infos(1.0), infos(4.0)
    assert "late_oracle" not in turned[0]
    assert turned[1]["late_oracle"]["auc"] < turned[1]["oracle"]["auc"] - 0.02  # a quarter turn late
    assert whole_turn[1]["late_oracle"]["auc"] == pytest.approx(whole_turn[1]["oracle"]["auc"], abs=1e-6)


def test_a_partition_without_its_marker_is_never_read_even_half_written(dataset):
    root = dataset.root
    _half_written(root, "2026-01-01T02")
    done = [partition_name(0), partition_name(1)]
    assert next_partition(root, done) is None  # waits for the marker; the truncated file is not opened
    assert with_partition_split(dataset, "partitions/2026-01-01T02") is dataset
    with pytest.raises(PartitionError, match="no _SUCCESS marker"):
        open_partition(root, "2026-01-01T02")


def test_the_first_partition_not_trained_is_waited_for_even_when_a_later_one_is_ready(dataset):
    root = dataset.root
    later = root / "partitions" / "2026-01-01T05"
    later.mkdir()
    (later / MARKER).touch()
    _half_written(root, "2026-01-01T03")
    assert next_partition(root, [partition_name(0), partition_name(1)]) is None
    assert next_partition(root, []).name == partition_name(0)
    assert next_partition(root, [partition_name(0)]).name == partition_name(1)
    assert blocking_partition(root, [partition_name(0), partition_name(1)]) == ("2026-01-01T03", 1)
    assert blocking_partition(root, [partition_name(0)]) is None  # the next one is ready
    assert blocking_partition(root, [partition_name(0), partition_name(1), "2026-01-01T03"]) is None
    (later / MARKER).unlink()
    assert blocking_partition(root, [partition_name(0), partition_name(1)]) is None  # nothing ready behind it


def test_hidden_directories_and_files_are_not_partitions(dataset):
    root = dataset.root
    (root / "partitions" / "_temporary" / "0").mkdir(parents=True)
    (root / "partitions" / ".staging").mkdir()
    (root / "partitions" / partition_name(0) / "_part.parquet.crc").write_bytes(b"x")
    assert partition_names(root) == [partition_name(0), partition_name(1)]
    assert next_partition(root, [partition_name(0), partition_name(1)]) is None
    assert open_partition(root, partition_name(0)).files == (f"partitions/{partition_name(0)}/part-00000.parquet",)


def test_a_partition_landing_out_of_order_is_a_named_error(dataset):
    root = dataset.root
    with pytest.raises(PartitionOrderError, match=r"partition '2026-01-01T00' landed after partition '2026-01-01T01'"):
        next_partition(root, [partition_name(1)])


def test_a_schema_change_is_a_named_error(dataset, tmp_path):
    root = dataset.root
    name = "2026-01-01T02"
    directory = root / "partitions" / name
    directory.mkdir()
    table = pq.read_table(root / "partitions" / partition_name(0) / "part-00000.parquet")
    column = table.schema.get_field_index("C3")
    table = table.set_column(column, "C3", pa.array([str(v) for v in table.column("C3").to_pylist()]))
    pq.write_table(table, directory / "part-00000.parquet")
    (directory / MARKER).touch()
    partition = next_partition(root, [partition_name(0), partition_name(1)])
    with pytest.raises(PartitionSchemaError, match=r"partition '2026-01-01T02' changes the dataset's schema") as err:
        check_partition_schema(dataset, partition)
    assert "column 'C3'" in str(err.value) and "part-00000.parquet" in str(err.value)


def test_a_partition_file_that_is_not_parquet_is_named_as_unreadable(dataset):
    root = dataset.root
    name = "2026-01-01T02"
    directory = root / "partitions" / name
    directory.mkdir()
    good = (root / "partitions" / partition_name(0) / "part-00000.parquet").read_bytes()
    (directory / "part-00000.parquet").write_bytes(good[: len(good) // 2])  # truncated
    (directory / MARKER).touch()
    partition = next_partition(root, [partition_name(0), partition_name(1)])
    with pytest.raises(PartitionError, match=rf"part-00000.parquet: partition '{name}' holds a file that cannot be "
                                             rf"read: cannot open Parquet file") as err:
        check_partition_schema(dataset, partition)
    assert not isinstance(err.value, PartitionSchemaError)


def test_a_partition_reads_as_a_split(dataset):
    view = with_partition_split(dataset, f"partitions/{partition_name(1)}")
    reader = InProcessReader(view, f"partitions/{partition_name(1)}",
                             DecodeOptions(table_rows=tuple(f.cardinality for f in dataset.schema.sparse)),
                             ReaderConfig(batch_size=100, shuffle="none", remainder="pad"))
    try:
        rows = sum(b.num_valid for b in reader.epoch(0))
    finally:
        reader.close()
    assert rows == 1200
    assert json.loads((dataset.root / "dataset.json").read_text())["splits"] == {}  # the view is not saved


def test_a_partition_holding_other_rows_than_its_description_gives_is_refused_by_name(dataset):
    split = f"partitions/{partition_name(1)}"
    described = dataset.root / split / "partition.json"
    described.write_text(json.dumps({**json.loads(described.read_text()), "rows": 1201}))
    with pytest.raises(DataError, match=rf"{described}: '{split}' holds 1,200 rows in its files, not the 1,201"):
        InProcessReader(with_partition_split(dataset, split), split,
                        DecodeOptions(table_rows=tuple(f.cardinality for f in dataset.schema.sparse)),
                        ReaderConfig(batch_size=100))


def test_a_split_a_partitioned_dataset_lacks_is_named_with_what_it_has(dataset):
    split = "partitions/2026-01-01T09"  # never landed
    with pytest.raises(DataError, match=rf"the dataset has no split '{split}' \(it has none\)$"):
        with_partition_split(dataset, split).files(split)
