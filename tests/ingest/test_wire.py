from dataclasses import replace

import numpy as np
import pytest
import zstandard

from neorec.ingest import batch as batch_module
from neorec.ingest import flat_columns, take
from neorec.ingest import wire as wire_module
from neorec.ingest.batch import BatchPieces, HostBatch, Provenance
from neorec.ingest.chunks import compile_decoding
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import InProcessReader, ReaderConfig, batch_pieces
from neorec.ingest.rows import RowGroupInfo, RowSpan, Window
from neorec.ingest.wire import WireError, decode_batch, serialize_batch, serialize_pieces
from neorec.protos import ingest_pb2
from tests.ingest.workers import assert_same_batches

COMPRESSIONS = [ingest_pb2.COMPRESSION_NONE, ingest_pb2.COMPRESSION_ZSTD]
WINDOWS = [Window((RowGroupInfo(0, 0, 40),)), Window((RowGroupInfo(1, 3, 20), RowGroupInfo(0, 1, 30)), seed=7)]


def _windows(batches: list[HostBatch]) -> list[Window]:
    return list(dict.fromkeys(s.window for b in batches for s in b.provenance.rows))


def _message(batch: HostBatch, compression: int = ingest_pb2.COMPRESSION_NONE,
             id_bounds: tuple[int, ...] | None = None, windows: list[Window] = WINDOWS) -> bytes:
    """The batch as a client receives it: the serialized message (each feature's ids
    bounded by its largest + 1 unless ``id_bounds`` says otherwise)."""
    if id_bounds is None:
        offsets = batch.feature_value_offsets()
        id_bounds = tuple(int(batch.values[a:b].max(initial=0)) + 1 for a, b in zip(offsets[:-1], offsets[1:]))
    return serialize_batch(batch, id_bounds, {w: i for i, w in enumerate(windows)}, compression)


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


def _chunk(samples: int, seed: int, weighted: bool) -> HostBatch:
    """A decoded chunk of four features: ids below 300 (a, b), raw ids (c: any int64,
    negative ones included), ids below 70,000 (d); bags of 0 to 3 ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=4 * samples).astype(np.int32)
    ends = np.cumsum(lengths.reshape(4, samples).sum(axis=1))
    values = rng.integers(0, 300, size=int(ends[-1]))
    values[ends[1] : ends[2]] -= 1 << 40
    values[ends[2] :] *= 200
    return HostBatch(dense=rng.normal(size=(samples, 2)).astype(np.float32),
                     labels=rng.integers(0, 2, size=samples).astype(np.float32), keys=tuple("abcd"),
                     lengths=lengths, values=values,
                     weights=rng.random(values.size, dtype=np.float32) if weighted else None)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("id_bounds", [(300, 300, 0, 70_000), (300, 200, 0, 60_000)])  # the second: b's ids past
def test_a_batch_packed_from_its_pieces_is_the_assembled_batch_byte_for_byte(compression, weighted, id_bounds):
    # one byte where its bound is 200, d's past two bytes (and so in 3) or past 3 (and so in 8)
    first, second, third = _chunk(5, 1, weighted), _chunk(4, 2, weighted), _chunk(3, 3, weighted)
    offsets = second.feature_value_offsets()
    second.values[offsets[1] : offsets[2]] = 299  # past one byte
    second.values[offsets[3] :] = 1 << 24  # past three bytes
    a, b = first.pieces([0, 3, 5]), second.pieces([0, 1, 4])
    rows = lambda start, stop: RowSpan(WINDOWS[0], start, stop)
    empty = HostBatch.empty(first.keys, 2)
    batches = [
        BatchPieces(0, 0, 3, ((rows(0, 3), a[0]),), empty),  # inside one chunk
        BatchPieces(0, 1, 3, ((rows(3, 5), a[1]), (rows(5, 6), b[0])), empty),  # across two
        BatchPieces(0, 2, 3, ((rows(6, 9), third.pieces([0, 3])[0]),), empty),  # a whole chunk
        BatchPieces(0, 3, 5, ((rows(9, 12), b[1]),), empty),  # two padding samples
        BatchPieces(0, 4, 5, (), empty),  # all padding
    ]
    index = {WINDOWS[0]: 0}
    spilled = []
    for batch in batches:
        assembled = batch.assembled()
        message = serialize_pieces(batch, id_bounds, index, compression)
        assert message == serialize_batch(assembled, id_bounds, index, compression)
        assert_same_batches([decode_batch(message, first.keys, WINDOWS[:1])], [assembled])
        widths = ingest_pb2.Batch.FromString(serialize_pieces(batch, id_bounds, index)).value_bytes
        offsets = assembled.feature_value_offsets()
        largest = [assembled.values[i:j].max(initial=0) for i, j in zip(offsets[:-1], offsets[1:])]
        narrow_b, narrow_d = (2, 3) if id_bounds[1] == 300 else (1, 2)
        assert widths == [2, 8 if largest[1] >= 1 << 8 * narrow_b else narrow_b, 8,
                          8 if largest[3] >= 1 << 8 * narrow_d else narrow_d]
        spilled.append((widths[1], widths[3]))
    assert spilled[1] == ((2, 8) if id_bounds[1] == 300 else (8, 8))  # the pieces from the second chunk spill


@pytest.mark.parametrize("shuffle", ["rows", "row_groups"])
@pytest.mark.parametrize("dataset_name", ["criteo_dataset", "multihot_dataset"])
def test_every_batch_of_a_dataset_packed_from_its_pieces_is_the_assembled_one(request, dataset_name, shuffle):
    dataset = request.getfixturevalue(dataset_name)
    options = DecodeOptions.for_schema(dataset.schema)
    reader = InProcessReader(dataset, "train", options, ReaderConfig(batch_size=350, remainder="pad", shuffle=shuffle,
                                                                     window=2))
    task = reader.plan(0).whole()
    chunks = (pair for span in task.spans for pair in reader.decoder.chunks(span))
    batches = list(batch_pieces(task, chunks, dataset.schema))
    windows = list(dict.fromkeys(s.window for b in batches for s in b.provenance.rows))
    index = {w: i for i, w in enumerate(windows)}
    bounds = options.id_bounds(dataset.schema)
    assert any(len(b.parts) > 1 for b in batches) and batches[-1].num_valid < batches[-1].size
    for batch in batches:
        assert serialize_pieces(batch, bounds, index) == serialize_batch(batch.assembled(), bounds, index)


def test_after_compile_decoding_serving_a_dataset_compiles_no_kernel(multihot_dataset):
    """A reader service compiles its kernels at start (compile_decoding), not in a request."""
    compile_decoding()
    kernels = (wire_module._pack, wire_module._unpack, wire_module._bag_stats, batch_module._first_problem,
               batch_module._piece_ids, flat_columns._numbers_routed, flat_columns._numbers, take._copy_bags)
    compiled = [len(kernel.signatures) for kernel in kernels]
    options = DecodeOptions.for_schema(multihot_dataset.schema)
    reader = InProcessReader(multihot_dataset, "train", options, ReaderConfig(batch_size=300, shuffle="rows", window=2))
    task = reader.plan(0).whole()
    chunks = (pair for span in task.spans for pair in reader.decoder.chunks(span))
    keys, bounds = multihot_dataset.schema.feature_names, options.id_bounds(multihot_dataset.schema)
    for batch in batch_pieces(task, chunks, multihot_dataset.schema):
        windows = list(dict.fromkeys(s.window for s in batch.provenance.rows))
        message = serialize_pieces(batch, bounds, {w: i for i, w in enumerate(windows)})
        decode_batch(message, keys, windows).check(bounds)
    assert [len(kernel.signatures) for kernel in kernels] == compiled


def test_pieces_that_do_not_fit_their_batch_or_their_chunk_are_refused():
    chunk = _chunk(4, 1, weighted=True)
    whole = chunk.pieces([0, 4])[0]
    empty = HostBatch.empty(chunk.keys, 2)
    index, bounds = {WINDOWS[0]: 0}, (300, 300, 0, 70_000)
    rows = RowSpan(WINDOWS[0], 0, 4)

    def refused(piece, match, size=4, other=None):
        parts = ((rows, piece),) if other is None else ((rows, piece), (RowSpan(WINDOWS[0], 4, 8), other))
        with pytest.raises(ValueError, match=match):
            serialize_pieces(BatchPieces(0, 0, size, parts, empty), bounds, index)

    refused(whole, "pieces of 4 samples for a batch of 3", size=3)
    refused(replace(whole, hi=5), r"piece \[0, 5\) is not a run of samples of its batch of 4", size=5)
    refused(replace(whole, lo=3, hi=2), r"piece \[3, 2\) is not a run")
    refused(replace(whole, counts=whole.counts + 1), "a piece's ids .* are not those its bag lengths count")
    refused(replace(whole, first=whole.first - 1), "a piece's ids .* are not those its bag lengths count")
    refused(replace(whole, first=whole.first[:3]), r"a piece of a batch of 4 features locates \(3,\)")
    other = _chunk(4, 2, weighted=False).pieces([0, 4])[0]
    refused(whole, "other features, dense widths or weights", size=8, other=other)
    short = replace(chunk, weights=chunk.weights[:-1], provenance=Provenance(0, 0, (rows,)))
    with pytest.raises(ValueError, match=f"{chunk.values.size - 1} id weights for {chunk.values.size} ids"):
        serialize_batch(short, bounds, index)


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


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_each_feature_travels_in_its_own_narrowest_widths_and_comes_back_wide(compression):
    # Features a..e: tables that need 1, 2, 4, 8 and 3 bytes an id (the largest id each
    # allows is sent); bags of one id each (no lengths sent), longest 255, 256 and 65,536,
    # and bags of at most one id, not all one (1 byte).
    bounds = (256, 1 << 16, 1 << 32, (1 << 32) + 1, 1 << 24)
    lengths = np.array([[1, 1], [255, 0], [256, 3], [65_536, 2], [1, 0]], dtype=np.int32)
    values = np.concatenate([np.arange(n, dtype=np.int64) % 7 for n in lengths.sum(axis=1)])
    ends = np.cumsum(lengths.sum(axis=1)) - 1
    values[ends] = np.array(bounds) - 1
    batch = HostBatch(
        dense=np.ones((2, 1), dtype=np.float32), labels=np.array([1, 0], dtype=np.float32), keys=tuple("abcde"),
        lengths=lengths.reshape(-1), values=values, weights=np.linspace(0, 1, values.size, dtype=np.float32),
        provenance=Provenance(epoch=0, step=1, rows=(RowSpan(WINDOWS[0], 0, 2),)),
    )
    message = _message(batch, compression, id_bounds=bounds)
    header = ingest_pb2.Batch.FromString(message)
    assert list(header.value_bytes) == [1, 2, 4, 8, 3]
    assert list(header.length_bytes) == [0, 1, 2, 4, 1]
    decoded = decode_batch(message, batch.keys, WINDOWS)
    assert decoded.values.dtype == np.int64 and decoded.lengths.dtype == np.int32
    assert_same_batches([decoded], [batch])
    if compression == ingest_pb2.COMPRESSION_NONE:
        ids = 2 + 255 * 2 + 259 * 4 + 65_538 * 8 + 3
        assert len(header.body) == ids + 4 * (2 + 2 + values.size) + 2 * (1 + 2 + 4 + 1)


def test_negative_lengths_travel_signed():
    batch = _weighted_batch()
    batch.lengths = np.array([1, 0, 2, 3, -1, 1], dtype=np.int32)  # feature b adds up to its 3 ids
    message = _message(batch)
    assert list(ingest_pb2.Batch.FromString(message).length_bytes) == [1, 4]
    with pytest.raises(ValueError, match="feature 'b', sample 1: negative bag length -1"):
        decode_batch(message, batch.keys, WINDOWS).check((8, 8))


def test_a_batch_whose_lengths_do_not_add_up_is_not_serialized():
    batch = _weighted_batch()
    batch.lengths = batch.lengths + 1
    with pytest.raises(ValueError, match="bag lengths add up to 12 ids, the batch holds 6"):
        _message(batch, id_bounds=(8, 8))


def test_a_body_that_does_not_match_its_header_is_refused():
    message = ingest_pb2.Batch.FromString(_message(_weighted_batch()))  # protobuf's own encoding
    message.num_values += 1
    with pytest.raises(WireError, match="step 9: bag lengths add up to 6 ids, the batch holds 7"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)
    message.num_values -= 1
    message.has_weights = False
    with pytest.raises(WireError, match="step 9: body holds 72 bytes, its header says 48"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)
    message.has_weights = True
    with pytest.raises(WireError, match="truncated|not a Batch"):
        decode_batch(_message(_weighted_batch())[:-5], ("a", "b"), WINDOWS)
    with pytest.raises(WireError, match="not a Batch|wire type"):
        decode_batch(b"\xff\xff\xff", ("a", "b"), WINDOWS)
    with pytest.raises(WireError, match="2 features, the dataset 3"):
        decode_batch(_message(_weighted_batch()), ("a", "b", "c"), WINDOWS)
    with pytest.raises(WireError, match="not rows of the request's 1 windows"):
        decode_batch(_message(_weighted_batch()), ("a", "b"), WINDOWS[:1])
    message.value_bytes[0] = 5
    with pytest.raises(WireError, match=r"step 9: value_bytes is \[5, 1\], expected 2 of \[1, 2, 3, 4, 8\]"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)
    message.value_bytes[0] = 1
    del message.length_bytes[1]
    with pytest.raises(WireError, match=r"step 9: length_bytes is \[1\], expected 2 of \[0, 1, 2, 4\]"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)


def test_the_body_holds_each_width_little_endian_in_the_documented_order():
    batch = HostBatch(
        dense=np.array([[1.5], [2.5]], dtype=np.float32), labels=np.array([1, 0], dtype=np.float32),
        keys=("a", "b", "c"), lengths=np.array([1, 1, 2, 0, 0, 1], dtype=np.int32),
        values=np.array([5, 6, 0x0102, 0x0A0B, 0x0C0D0E], dtype=np.int64),
        provenance=Provenance(epoch=0, step=1, rows=(RowSpan(WINDOWS[0], 0, 2),)),
    )
    header = ingest_pb2.Batch.FromString(_message(batch, id_bounds=(256, 1 << 16, 1 << 24)))
    assert (list(header.value_bytes), list(header.length_bytes)) == ([1, 2, 3], [0, 1, 1])
    floats = np.array([1.5, 2.5, 1.0, 0.0], dtype="<f4").tobytes()
    ids = bytes([5, 6, 0x02, 0x01, 0x0B, 0x0A, 0x0E, 0x0D, 0x0C])
    assert header.body == ids + floats + bytes([2, 0, 0, 1])


def _one_feature(lengths: list[int], largest_id: int) -> HostBatch:
    values = np.zeros(sum(lengths), dtype=np.int64)
    values[-1] = largest_id
    return HostBatch(
        dense=np.zeros((len(lengths), 0), dtype=np.float32), labels=np.zeros(len(lengths), dtype=np.float32),
        keys=("a",), lengths=np.array(lengths, dtype=np.int32), values=values,
        provenance=Provenance(epoch=0, step=1, rows=(RowSpan(WINDOWS[0], 0, len(lengths)),)),
    )


@pytest.mark.parametrize("bound, width", [(1, 1), (256, 1), (257, 2), (1 << 16, 2), ((1 << 16) + 1, 3), (1 << 24, 3),
                                          ((1 << 24) + 1, 4), (1 << 32, 4), ((1 << 32) + 1, 8),
                                          (0, 8)])  # 0: raw ids, any int64
def test_ids_take_the_narrowest_width_that_holds_their_table(bound, width):
    batch = _one_feature([1, 0, 1], bound - 1)
    message = _message(batch, id_bounds=(bound,))
    assert list(ingest_pb2.Batch.FromString(message).value_bytes) == [width]
    assert_same_batches([decode_batch(message, batch.keys, WINDOWS)], [batch])


@pytest.mark.parametrize("longest, width", [(1, 1), (255, 1), (256, 2), (65_535, 2), (65_536, 4)])
def test_lengths_take_the_narrowest_width_that_holds_the_longest_bag(longest, width):
    batch = _one_feature([0, longest], 0)  # an empty bag: not all ones
    message = _message(batch, id_bounds=(1,))
    assert list(ingest_pb2.Batch.FromString(message).length_bytes) == [width]
    assert_same_batches([decode_batch(message, batch.keys, WINDOWS)], [batch])


@pytest.mark.parametrize("bound, bad_id", [(200, 300), (200, 1 << 40), (200, -1), (70_000, 1 << 24), (70_000, -1)])
def test_an_id_its_width_cannot_hold_travels_whole_for_the_receiver_to_name(bound, bad_id):
    batch = _one_feature([1, 1], bad_id)
    message = _message(batch, id_bounds=(bound,))
    assert list(ingest_pb2.Batch.FromString(message).value_bytes) == [8]
    decoded = decode_batch(message, batch.keys, WINDOWS)
    assert decoded.values.tolist() == [0, bad_id]
    with pytest.raises(ValueError, match=f"feature 'a': id {bad_id} is outside its table's rows"):
        decoded.check((bound,))


def test_a_feature_whose_lengths_add_up_below_zero_is_neither_sent_nor_read():
    batch = _weighted_batch()
    batch.lengths = np.array([-2, 0, 0, 4, 2, 2], dtype=np.int32)  # 6 ids in all
    with pytest.raises(ValueError, match="feature 'a': bag lengths add up to -2 ids"):
        _message(batch, id_bounds=(8, 8))
    # The same lengths as a worker might send them: signed 4-byte lengths, 6 one-byte ids.
    message = ingest_pb2.Batch(epoch=2, step=9, rows=[ingest_pb2.RowSpan(window=1, start=10, stop=13)],
                               batch_size=3, num_valid=3, num_dense=0, num_features=2, num_values=6,
                               value_bytes=[1, 1], length_bytes=[4, 4],
                               body=bytes(6) + bytes(4 * 3) + batch.lengths.astype("<i4").tobytes())
    with pytest.raises(WireError, match="step 9: a feature's bag lengths add up to a negative number"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)


def test_a_zstd_body_must_declare_its_size():
    message = ingest_pb2.Batch.FromString(_message(_weighted_batch()))
    message.compression = ingest_pb2.COMPRESSION_ZSTD
    message.body = zstandard.ZstdCompressor(write_content_size=False).compress(message.body)
    with pytest.raises(WireError, match="step 9: the zstd body does not declare a size"):
        decode_batch(message.SerializeToString(), ("a", "b"), WINDOWS)
