import numpy as np
import pytest

from neorec.ingest.batch import HostBatch, Provenance
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.rows import RowGroupInfo, RowSpan, Window
from neorec.ingest.wire import WireError, decode_batch, serialize_batch
from neorec.protos import ingest_pb2
from tests.ingest.workers import assert_same_batches

COMPRESSIONS = [ingest_pb2.COMPRESSION_NONE, ingest_pb2.COMPRESSION_ZSTD]
WINDOWS = [Window((RowGroupInfo(0, 0, 40),)), Window((RowGroupInfo(1, 3, 20), RowGroupInfo(0, 1, 30)), seed=7)]


def _windows(batches: list[HostBatch]) -> list[Window]:
    return list(dict.fromkeys(s.window for b in batches for s in b.provenance.rows))


def _message(batch: HostBatch, compression: int = ingest_pb2.COMPRESSION_NONE, id_bound: int | None = None,
             windows: list[Window] = WINDOWS) -> bytes:
    """The batch as a client receives it: the serialized message (ids bounded by the
    largest + 1 unless ``id_bound`` says otherwise)."""
    if id_bound is None:
        id_bound = int(batch.values.max(initial=0)) + 1
    return serialize_batch(batch, id_bound, {w: i for i, w in enumerate(windows)}, compression)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("shuffle", ["rows", "row_groups"])
@pytest.mark.parametrize("dataset_name", ["criteo_dataset", "multihot_dataset"])
def test_round_trip_is_byte_identical(request, dataset_name, shuffle, compression):
    dataset = request.getfixturevalue(dataset_name)
    reader = InProcessReader(dataset, "train", DecodeOptions.for_schema(dataset.schema),
                             ReaderConfig(batch_size=350, remainder="pad", shuffle=shuffle, window=2))
    batches = list(reader.epoch(0))
    windows = _windows(batches)
    decoded = [decode_batch(_message(b, compression, windows=windows), dataset.schema.feature_names, windows)
               for b in batches]
    assert_same_batches(decoded, batches)
    assert decoded[-1].num_valid < decoded[-1].batch_size  # the padded tail survives


def _weighted_batch() -> HostBatch:
    return HostBatch(
        dense=np.arange(6, dtype=np.float32).reshape(3, 2),
        labels=np.array([0, 1, 0], dtype=np.float32),
        keys=("a", "b"),
        lengths=np.array([1, 0, 2, 3, 0, 0], dtype=np.int32),
        values=np.array([5, 6, 7, 1, 2, 3], dtype=np.int64),
        weights=np.array([0.5, 1, 2, 3, 4, 5], dtype=np.float32),
        provenance=Provenance(epoch=2, step=9, rows=(RowSpan(WINDOWS[1], 10, 13),)),
    )


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_weights_and_empty_bags_round_trip(compression):
    batch = _weighted_batch()
    assert_same_batches([decode_batch(_message(batch, compression), batch.keys, WINDOWS)], [batch])


@pytest.mark.parametrize("id_bound, value_bytes", [(8, 4), (1 << 32, 4), ((1 << 32) + 1, 8)])
@pytest.mark.parametrize("longest_bag, length_bytes", [(3, 1), (255, 1), (256, 2), (65_536, 4)])
def test_ids_and_lengths_travel_narrow_and_come_back_wide(id_bound, value_bytes, longest_bag, length_bytes):
    lengths = np.array([longest_bag, 1, 0, 2], dtype=np.int32)  # features "a", "b" of samples 0, 1
    values = np.arange(lengths.sum(), dtype=np.int64) % 5
    values[-1] = id_bound - 1  # the largest id the bound allows
    batch = HostBatch(
        dense=np.ones((2, 1), dtype=np.float32), labels=np.array([1, 0], dtype=np.float32), keys=("a", "b"),
        lengths=lengths, values=values, weights=np.linspace(0, 1, values.size, dtype=np.float32),
        provenance=Provenance(epoch=0, step=1, rows=(RowSpan(WINDOWS[0], 0, 2),)),
    )
    message = _message(batch, id_bound=id_bound)
    header = ingest_pb2.Batch.FromString(message)
    assert (header.value_bytes, header.length_bytes) == (value_bytes, length_bytes)
    decoded = decode_batch(message, batch.keys, WINDOWS)
    assert decoded.values.dtype == np.int64 and decoded.lengths.dtype == np.int32
    assert_same_batches([decoded], [batch])


def test_a_body_that_does_not_match_its_header_is_refused():
    message = ingest_pb2.Batch.FromString(_message(_weighted_batch()))  # protobuf's own encoding
    message.num_values += 1
    with pytest.raises(WireError, match="step 9: body holds"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)
    with pytest.raises(WireError, match="truncated|not a Batch"):
        decode_batch(_message(_weighted_batch())[:-5], ("a", "b"), WINDOWS)
    with pytest.raises(WireError, match="not a Batch|wire type"):
        decode_batch(b"\xff\xff\xff", ("a", "b"), WINDOWS)
    with pytest.raises(WireError, match="2 features, the dataset 3"):
        decode_batch(_message(_weighted_batch()), ("a", "b", "c"), WINDOWS)
    with pytest.raises(WireError, match="not rows of the request's 1 windows"):
        decode_batch(_message(_weighted_batch()), ("a", "b"), WINDOWS[:1])
    message.num_values -= 1
    message.value_bytes = 3
    with pytest.raises(WireError, match="step 9: value_bytes is 3"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)
