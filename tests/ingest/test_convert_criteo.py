import numpy as np
import pyarrow.parquet as pq
import pytest

from ingest.convert_criteo import ConvertOptions, convert
from ingest.decoder import DecodeOptions
from ingest.errors import DataError
from ingest.reader import InProcessReader, ReaderConfig
from tests.conftest import FIXTURES


def test_fixture_converts_to_the_criteo_schema(tmp_path):
    dataset = convert([FIXTURES / "criteo_sample.tsv"], tmp_path, ConvertOptions(eval_every=2))
    assert dataset.rows == {"train": 2, "eval": 2}
    train = pq.read_table(dataset.files("train")[0])
    first = train.slice(0, 1).to_pylist()[0]
    assert first["label"] == 0.0
    assert first["I1"] == 1.0 and first["I5"] == 1382.0 and first["I12"] is None
    assert first["C1"] == 0x68FD1E64 and first["C26"] == 0x9727DD16 and first["C22"] is None
    evals = pq.read_table(dataset.files("eval")[0]).to_pylist()
    assert [row["label"] for row in evals] == [1.0, 1.0]
    assert evals[1]["I2"] == -1.0 and evals[1]["C3"] is None and evals[1]["C1"] == 0x05DB9164


def test_converted_data_trains_through_the_reader(tmp_path):
    dataset = convert([FIXTURES / "criteo_sample.tsv"] * 3, tmp_path, ConvertOptions(eval_every=4))
    options = DecodeOptions(table_rows=(1000,) * 26)
    reader = InProcessReader(dataset, "train", options, ReaderConfig(batch_size=3, remainder="pad"))
    batches = list(reader.epoch(0))
    assert sum(b.num_valid for b in batches) == 9
    values = np.concatenate([b.values for b in batches])
    assert values.min() >= 0 and values.max() < 1000


def _convert_with_one_bad_field(tmp_path, index: int, value: str):
    """Convert the fixture's first line with field ``index`` replaced by ``value``."""
    line = (FIXTURES / "criteo_sample.tsv").read_text().splitlines()[0].split("\t")
    line[index] = value
    bad = tmp_path / "bad.tsv"
    bad.write_text("\t".join(line) + "\n")
    return convert([bad], tmp_path / "out")


def test_bad_hash_is_named(tmp_path):
    with pytest.raises(DataError, match=r"bad.tsv, column 'C7', row 1: not a hexadecimal hash"):
        _convert_with_one_bad_field(tmp_path, 20, "zz12")


def test_bad_label_is_named(tmp_path):
    with pytest.raises(DataError, match=r"column 'label', row 1: label must be 0 or 1"):
        _convert_with_one_bad_field(tmp_path, 0, "2")
