"""A batch on the wire: :class:`HostBatch` ⇄ the ``Batch`` protobuf message.

Tensors travel as raw little-endian bytes in one ``body`` field (optionally one zstd
frame), never as protobuf fields or a loop over rows in Python. Each feature's ids travel
in the narrowest width that holds its table's rows (the decoder maps every id into its
table, never negative), its bag lengths in the narrowest that holds its longest bag, or
not at all when every bag holds one id: a Criteo sample's 26 ids, mostly of small
tables, take 52 bytes and its bag lengths 5 (208 and 104 as decoded). Numba kernels
narrow them into the body in one pass, and widen them back to int64 and int32 on receipt.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import numba
import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from neorec.ingest.batch import BatchPieces, HostBatch, Piece, Provenance
from neorec.ingest.rows import RowSpan, Window
from neorec.protos import ingest_pb2

ZSTD_LEVEL = 1
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
"""Send/receive limit for a batch message, set on both ends (far above grpc's 4 MiB
default: a batch of 65,536 multi-hot samples is ~100 MiB)."""
MAX_REQUEST_BYTES = 16 * 1024 * 1024
"""Receive limit of a service for one request (a request names files, windows and
spans: kilobytes, or a few MiB for a split of many thousand files)."""
MAX_REQUEST_ROWS = 1 << 22
"""Most rows, padding included, that one request may ask for (``num_batches *
batch_size``); a client's tasks are a few hundred thousand rows."""
MAX_WINDOW_ROWS = 1 << 26
"""Most rows one window of a request may hold: a permuted window's order is an int64 per
row (512 MiB at this bound); a client's windows are ~262k rows unless
``data.shuffle_window`` asks for more."""
MAX_STEP = 2**64 - 1
"""The largest step number a batch message carries (``uint64``)."""


class WireError(ValueError):
    """A message does not hold a well-formed batch."""


def serialize_batch(batch: HostBatch, id_bounds: Sequence[int], window_index: Mapping[Window, int],
                    compression: int = ingest_pb2.COMPRESSION_NONE) -> bytes:
    """The serialized ``Batch`` message for ``batch``, whose feature ``f`` has ids in
    ``[0, id_bounds[f])`` (its table's rows: no scan of the ids), or any int64 where the
    bound is 0 (raw ids, 8 bytes). ``window_index`` numbers the windows of the request the
    batch answers (its provenance names rows by window number). Raises ``ValueError`` if a
    feature's bag lengths add up to a negative number of ids or all of them to another
    number than the batch holds.

    Each feature's ids travel in the narrowest of :data:`VALUE_WIDTHS` that holds its bound,
    its bag lengths in the narrowest of :data:`LENGTH_WIDTHS` that holds its longest bag, or
    not at all when every bag holds one id (width 0); a feature with an id its width cannot
    hold (outside its table) sends its ids at 8 bytes, so that the receiver names the bad
    id. Each tensor is packed into the body in one pass; the header fields are serialized
    by protobuf and the body field (number 11) appended by hand (tag, length, bytes), which
    is a valid encoding of the same message: fields may come in any order. This saves the
    two copies of the body that setting the field and serializing the message would make.
    """
    if batch.provenance is None:
        raise ValueError("only batches with a provenance go on the wire")
    whole = Piece.whole(batch)
    if whole.counts.sum() != batch.values.size:
        raise ValueError(f"bag lengths add up to {int(whole.counts.sum())} ids, the batch holds {batch.values.size}")
    return _serialized([whole], batch.batch_size, batch.num_valid, batch.provenance, id_bounds, window_index,
                       compression)


def serialize_pieces(batch: BatchPieces, id_bounds: Sequence[int], window_index: Mapping[Window, int],
                     compression: int = ingest_pb2.COMPRESSION_NONE) -> bytes:
    """``serialize_batch(batch.assembled(), ...)``, byte for byte, without assembling it:
    each piece's ids, lengths and floats are packed into the body straight from the chunk
    it is part of (one copy of the data instead of two)."""
    return _serialized(batch.pieces(), batch.size, batch.num_valid, batch.provenance, id_bounds, window_index,
                       compression)


def _serialized(pieces: Sequence[Piece], size: int, num_valid: int, provenance: Provenance, id_bounds: Sequence[int],
                window_index: Mapping[Window, int], compression: int) -> bytes:
    """The message of a batch of ``size`` samples: ``pieces`` (at least one), then
    padding (see :func:`serialize_batch`)."""
    first = pieces[0].source
    num_f = first.num_features
    if len(id_bounds) != num_f:
        raise ValueError(f"{len(id_bounds)} id bounds for a batch of {num_f} features")
    if sum(piece.num_samples for piece in pieces) > size:
        raise ValueError(f"pieces of {sum(piece.num_samples for piece in pieces)} samples for a batch of {size}")
    counts = np.zeros(num_f, dtype=np.int64)
    least = np.zeros(num_f, dtype=np.int64)
    largest = np.zeros(num_f, dtype=np.int64)
    for piece in pieces:
        _check_layout(piece, first)
        totals, lo, hi = _bag_stats(piece.source.lengths, piece.bag_starts(), piece.num_samples)
        if (totals < 0).any():
            f = int(np.argmax(totals < 0))
            raise ValueError(f"feature {first.keys[f]!r}: bag lengths add up to {int(totals[f])} ids")
        if (totals != piece.counts).any() or (piece.first < 0).any() or (
                piece.first + piece.counts > piece.source.values.size).any():
            raise ValueError(f"a piece's ids ({piece.counts.tolist()} from {piece.first.tolist()}) are not those "
                             f"its bag lengths count ({totals.tolist()}) among the {piece.source.values.size} ids "
                             f"of its batch")
        counts += totals
        np.minimum(least, lo, out=least)
        np.maximum(largest, hi, out=largest)
    length_widths = np.array([_length_width(int(c), int(lo), int(hi), size)
                              for c, lo, hi in zip(counts.tolist(), least.tolist(), largest.tolist())], dtype=np.int64)
    value_widths = _value_widths(tuple(id_bounds))
    body, too_wide = _body(pieces, size, counts, value_widths, length_widths)
    if too_wide.any():  # ids outside their tables travel whole, for the receiver to name
        value_widths = np.where(too_wide, VALUE_WIDTHS[-1], value_widths)
        body, _ = _body(pieces, size, counts, value_widths, length_widths)
    view = memoryview(body)
    if compression == ingest_pb2.COMPRESSION_ZSTD:
        view = memoryview(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(view))
    elif compression != ingest_pb2.COMPRESSION_NONE:
        raise ValueError(f"unknown compression {compression}")
    header = ingest_pb2.Batch(
        epoch=provenance.epoch,
        step=provenance.step,
        rows=[ingest_pb2.RowSpan(window=window_index[s.window], start=s.start, stop=s.stop)
              for s in provenance.rows],
        batch_size=size,
        num_valid=num_valid,
        num_dense=first.dense.shape[1],
        num_features=num_f,
        num_values=int(counts.sum()),
        has_weights=first.weights is not None,
        compression=compression,
        value_bytes=value_widths.tolist(),
        length_bytes=length_widths.tolist(),
    )
    return b"".join([header.SerializeToString(), _BODY_TAG, _varint(view.nbytes), view])


def _check_layout(piece: Piece, first: HostBatch) -> None:
    """Raise ``ValueError`` unless ``piece`` is a run of samples of a batch laid out as
    ``first`` (features, dense width, weights), so that the packing kernels, which check
    nothing, stay inside it."""
    source = piece.source
    num_f = first.num_features
    if (source.keys, source.dense.shape[1], source.weights is None) != (
            first.keys, first.dense.shape[1], first.weights is None):
        raise ValueError("the pieces of a batch come from batches of other features, dense widths or weights")
    if not 0 <= piece.lo <= piece.hi <= source.batch_size or source.lengths.size != num_f * source.batch_size or (
            source.dense.shape[0] != source.batch_size):
        raise ValueError(f"piece [{piece.lo}, {piece.hi}) is not a run of samples of its batch of "
                         f"{source.batch_size} ({source.lengths.size} bag lengths, {source.dense.shape[0]} dense rows)")
    if piece.first.shape != (num_f,) or piece.counts.shape != (num_f,):
        raise ValueError(f"a piece of a batch of {num_f} features locates {piece.first.shape} and "
                         f"{piece.counts.shape} ids")
    if source.weights is not None and source.weights.size != source.values.size:
        raise ValueError(f"{source.weights.size} id weights for {source.values.size} ids")


def _body(pieces: Sequence[Piece], size: int, counts: np.ndarray, value_widths: np.ndarray,
          length_widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The message body (uint8) of a batch of ``size`` samples, ``pieces`` then padding,
    whose features hold ``counts`` ids (int64 ``[F]``), at these widths; and, per feature,
    whether an id did not fit its width (bool ``[F]``)."""
    first = pieces[0].source
    num_f, num_dense, has_weights = first.num_features, first.dense.shape[1], first.weights is not None
    num_values = int(counts.sum())
    dense_at = int(counts @ value_widths)
    labels_at = dense_at + 4 * size * num_dense
    weights_at = labels_at + 4 * size
    lengths_at = weights_at + (4 * num_values if has_weights else 0)
    body = np.empty(lengths_at + int(length_widths.sum()) * size, dtype=np.uint8)
    valid = sum(piece.num_samples for piece in pieces)
    if valid < size:  # padding samples: zero dense values and label, empty bags
        body[dense_at + 4 * valid * num_dense : labels_at] = 0
        body[labels_at + 4 * valid : weights_at] = 0
        body[lengths_at:] = 0
    # where each feature's next ids, weights and bag lengths go, advanced piece by piece
    value_at = np.cumsum(counts * value_widths) - counts * value_widths
    weight_at = weights_at + 4 * (np.cumsum(counts) - counts)
    length_at = lengths_at + size * (np.cumsum(length_widths) - length_widths)
    spilled = np.zeros(num_f, dtype=np.int64)
    rows = 0
    for piece in pieces:
        source, n = piece.source, piece.num_samples
        spilled |= _pack(source.values, piece.first, piece.counts, value_widths, body, value_at)
        value_at = value_at + piece.counts * value_widths
        if has_weights:
            weights = np.ascontiguousarray(source.weights, dtype="<f4").view(np.uint8)
            for f, (start, n_ids) in enumerate(zip(piece.first.tolist(), piece.counts.tolist())):
                body[weight_at[f] : weight_at[f] + 4 * n_ids] = weights[4 * start : 4 * (start + n_ids)]
            weight_at = weight_at + 4 * piece.counts
        _pack(source.lengths, piece.bag_starts(), np.full(num_f, n, dtype=np.int64), length_widths, body,
              length_at + rows * length_widths)
        for array, at, width in ((source.dense, dense_at, 4 * num_dense), (source.labels, labels_at, 4)):
            rows_bytes = np.ascontiguousarray(array[piece.lo : piece.hi], dtype="<f4").view(np.uint8).reshape(-1)
            body[at + rows * width : at + (rows + n) * width] = rows_bytes
        rows += n
    return body, spilled != 0


VALUE_WIDTHS = (1, 2, 3, 4, 8)
"""Bytes of an id on the wire, narrowest first: unsigned, but 8 bytes are a signed int64
(the width of a decoded id)."""
LENGTH_WIDTHS = (0, 1, 2, 4)
"""Bytes of a bag length on the wire: 0 (every bag of the feature holds one id, nothing
sent), unsigned 1 or 2, or a signed int32 (the width of a decoded length)."""


@functools.lru_cache(maxsize=64)
def _value_widths(id_bounds: tuple[int, ...]) -> np.ndarray:
    """int64 ``[F]``: the narrowest of :data:`VALUE_WIDTHS` holding ids below each bound
    (8 bytes for a bound of 0: raw ids, any int64)."""
    widths = np.array([next((w for w in VALUE_WIDTHS[:-1] if 0 < bound <= 1 << 8 * w), VALUE_WIDTHS[-1])
                       for bound in id_bounds], dtype=np.int64)
    widths.flags.writeable = False  # shared by the callers of the cache
    return widths


def _length_width(total: int, least: int, largest: int, size: int) -> int:
    """The wire width of a feature's ``size`` bag lengths, which add up to ``total`` and
    lie in ``[least, largest]``: 0 when all are 1, a signed 4 when any is negative."""
    if largest == 1 and total == size or size == 0:  # at most 1 each and adding up to size: all 1
        return 0
    if least < 0:
        return LENGTH_WIDTHS[-1]
    return next(w for w in LENGTH_WIDTHS[1:] if largest < 1 << (8 * w - (w == LENGTH_WIDTHS[-1])))


@numba.njit(cache=True, nogil=True)
def _bag_stats(lengths, starts, size):  # pragma: no cover - compiled
    """Per feature ``f`` of the bag lengths ``lengths[starts[f] : starts[f] + size]``
    (int32): their sum (int64), least and largest (int64 ``[F]`` each; no more than 0 and
    no less than 0), in one pass."""
    num_f = starts.size
    totals = np.zeros(num_f, dtype=np.int64)
    least = np.zeros(num_f, dtype=np.int64)
    largest = np.zeros(num_f, dtype=np.int64)
    for f in range(num_f):
        bags = lengths[starts[f] : starts[f] + size]  # a slice: indexing from 0 lets the loop vectorize
        total = 0
        lo = 0
        hi = 0
        for b in range(size):
            total += bags[b]
            lo = min(lo, bags[b])
            hi = max(hi, bags[b])
        totals[f], least[f], largest[f] = total, lo, hi
    return totals, least, largest


@numba.njit(cache=True, nogil=True)
def _pack(source, starts, counts, widths, out, out_starts):  # pragma: no cover - compiled
    """For each ``f``: write ``source[starts[f] : starts[f] + counts[f]]`` (int64 or int32),
    as elements of ``widths[f]`` bytes each (little endian, truncated; 0: nothing),
    into ``out`` (uint8) from ``out_starts[f]``. Returns int64 ``[F]``: per feature, the
    bits of its elements that did not fit (0: all fit unsigned in 1, 2, 3 or 4 bytes; 8 bytes
    always fit). The ranges must lie inside ``source`` and ``out`` (counts not negative)."""
    spilled = np.zeros(counts.size, dtype=np.int64)
    for f in range(counts.size):
        n = counts[f]
        width = widths[f]
        part = source[starts[f] : starts[f] + n]
        dst = out[out_starts[f] : out_starts[f] + n * width]  # slices from 0 let the loops vectorize
        high = np.int64(0)
        if width == 1:
            for k in range(n):
                dst[k] = part[k] & 0xFF
                high |= part[k] >> 8
        elif width == 2:
            for k in range(n):
                dst[2 * k] = part[k] & 0xFF
                dst[2 * k + 1] = (part[k] >> 8) & 0xFF
                high |= part[k] >> 16
        elif width == 3:
            for k in range(n):
                dst[3 * k] = part[k] & 0xFF
                dst[3 * k + 1] = (part[k] >> 8) & 0xFF
                dst[3 * k + 2] = (part[k] >> 16) & 0xFF
                high |= part[k] >> 24
        elif width == 4:
            for k in range(n):
                for j in range(4):
                    dst[4 * k + j] = (part[k] >> (8 * j)) & 0xFF
                high |= np.int64(part[k]) >> 32
        elif width == 8:
            for k in range(n):
                for j in range(8):
                    dst[8 * k + j] = (np.int64(part[k]) >> (8 * j)) & 0xFF
        spilled[f] = high
    return spilled


@numba.njit(cache=True, nogil=True)
def _unpack(body, start, counts, widths, out):  # pragma: no cover - compiled
    """The inverse of :func:`_pack`: ``out`` (int64 or int32) ← ``counts[f]`` elements of
    ``widths[f]`` bytes each of ``body`` (uint8) from ``start``, for each ``f`` in turn;
    width 0 gives ones, 4 bytes into int32 and 8 into int64 are signed."""
    position = start
    write = 0
    for f in range(counts.size):
        n = counts[f]
        width = widths[f]
        part = out[write : write + n]
        src = body[position : position + n * width]
        if width == 0:
            for k in range(n):
                part[k] = 1
        elif width == 1:
            for k in range(n):
                part[k] = src[k]
        elif width == 2:
            for k in range(n):
                part[k] = np.int64(src[2 * k]) | np.int64(src[2 * k + 1]) << 8
        elif width == 3:
            for k in range(n):
                part[k] = np.int64(src[3 * k]) | np.int64(src[3 * k + 1]) << 8 | np.int64(src[3 * k + 2]) << 16
        elif width == 4:
            for k in range(n):
                value = np.uint32(0)
                for j in range(4):
                    value |= np.uint32(src[4 * k + j]) << np.uint32(8 * j)
                part[k] = value
        else:
            for k in range(n):
                value = np.uint64(0)
                for j in range(8):
                    value |= np.uint64(src[8 * k + j]) << np.uint64(8 * j)
                part[k] = value
        write += n
        position += n * width


_BODY_FIELD = 11
_BODY_TAG = bytes([_BODY_FIELD << 3 | 2])  # wire type 2 (length-delimited)
SERVICE_NAME = "neorec.ingest.Reader"
READ_METHOD = f"/{SERVICE_NAME}/Read"
"""Full name of the streaming RPC (its responses travel as raw serialized messages)."""


def split_body(data: bytes) -> tuple[ingest_pb2.Batch, memoryview]:
    """The message's header fields (parsed by protobuf) and a view of its body field,
    found by walking the top-level fields of the protobuf wire format."""
    view = memoryview(data)
    header_parts = []
    body = view[0:0]
    position = 0
    try:
        while position < len(data):
            key, start = _read_varint(data, position)
            wire_type = key & 7
            if wire_type == 0:
                end = _read_varint(data, start)[1]
            elif wire_type == 1:
                end = start + 8
            elif wire_type == 5:
                end = start + 4
            elif wire_type == 2:
                length, start = _read_varint(data, start)
                end = start + length
                if key >> 3 == _BODY_FIELD:
                    body = view[start:end]
            else:
                raise WireError(f"unsupported protobuf wire type {wire_type}")
            if end > len(data):
                raise WireError("message is truncated")
            if key >> 3 != _BODY_FIELD:
                header_parts.append(view[position:end])
            position = end
        return ingest_pb2.Batch.FromString(b"".join(header_parts)), body
    except (IndexError, DecodeError) as err:
        raise WireError(f"message is not a Batch: {err}") from None


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it."""
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_batch(data: bytes, keys: tuple[str, ...], windows: Sequence[Window]) -> HostBatch:
    """The batch a serialized ``Batch`` message holds; ``keys`` are the dataset's feature
    names (schema order), ``windows`` those of the request it answers.

    Dense values, labels and weights are read-only views into ``data`` itself (or into its
    decompressed body); ids and lengths are widened into new arrays. Only the small header
    goes through protobuf. Raises :class:`WireError` if the message is malformed or its
    sizes do not match its body.
    """
    message, body = split_body(data)
    if message.num_features != len(keys):
        raise WireError(f"batch has {message.num_features} features, the dataset {len(keys)}")
    if message.compression == ingest_pb2.COMPRESSION_ZSTD:
        try:
            if not 0 <= zstandard.frame_content_size(body) <= MAX_MESSAGE_BYTES:
                raise WireError(f"batch step {message.step}: the zstd body does not declare a size up to "
                                f"{MAX_MESSAGE_BYTES} bytes")
            body = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError as err:
            raise WireError(f"batch step {message.step}: the zstd body does not decompress: {err}") from None
    elif message.compression != ingest_pb2.COMPRESSION_NONE:
        raise WireError(f"unknown compression {message.compression}")
    size, num_values, num_dense, step = message.batch_size, message.num_values, message.num_dense, message.step
    value_widths = _widths(message.value_bytes, VALUE_WIDTHS, len(keys), "value_bytes", step)
    length_widths = _widths(message.length_bytes, LENGTH_WIDTHS, len(keys), "length_bytes", step)
    float_bytes = 4 * (size * num_dense + size + (num_values if message.has_weights else 0))
    length_bytes = int(length_widths.sum()) * size
    data_bytes = len(body) - length_bytes
    if data_bytes < float_bytes:
        raise WireError(f"batch step {step}: body holds {len(body)} bytes, too few for its dense values and bag lengths")
    raw = np.frombuffer(body, dtype=np.uint8)
    lengths = np.empty(len(keys) * size, dtype=np.int32)
    _unpack(raw, data_bytes, np.full(len(keys), size, dtype=np.int64), length_widths, lengths)
    counts = _bag_stats(lengths, np.arange(len(keys), dtype=np.int64) * size, size)[0]
    if (counts < 0).any():
        raise WireError(f"batch step {step}: a feature's bag lengths add up to a negative number of ids "
                        f"({counts.tolist()})")
    if counts.sum() != num_values:
        raise WireError(f"batch step {step}: bag lengths add up to {int(counts.sum())} ids, the batch holds {num_values}")
    value_bytes = int(counts @ value_widths)
    if value_bytes + float_bytes != data_bytes:
        raise WireError(f"batch step {step}: body holds {len(body)} bytes, its header says "
                        f"{value_bytes + float_bytes + length_bytes}")
    values = np.empty(num_values, dtype=np.int64)
    _unpack(raw, 0, counts, value_widths, values)
    floats = np.frombuffer(body, dtype="<f4", count=float_bytes // 4, offset=value_bytes)
    dense, labels = floats[: size * num_dense], floats[size * num_dense : size * (num_dense + 1)]
    return HostBatch(
        dense=dense.reshape(size, num_dense),
        labels=labels,
        keys=keys,
        lengths=lengths,
        values=values,
        weights=floats[size * (num_dense + 1) :] if message.has_weights else None,
        num_valid=message.num_valid,
        provenance=Provenance(epoch=message.epoch, step=message.step, rows=_spans(message, windows)),
    )


def _widths(widths: Sequence[int], allowed: tuple[int, ...], num_f: int, field: str, step: int) -> np.ndarray:
    """A header's per-feature widths as int64 ``[F]``, each one of ``allowed``."""
    if len(widths) != num_f or not set(widths) <= set(allowed):
        raise WireError(f"batch step {step}: {field} is {list(widths)}, expected {num_f} of {list(allowed)}")
    return np.array(widths, dtype=np.int64)


def _spans(message: ingest_pb2.Batch, windows: Sequence[Window]) -> tuple[RowSpan, ...]:
    spans = []
    for r in message.rows:
        if r.window >= len(windows) or not r.start < r.stop <= windows[r.window].num_rows:
            raise WireError(f"batch step {message.step}: rows [{r.start}, {r.stop}) of window {r.window} "
                            f"are not rows of the request's {len(windows)} windows")
        spans.append(RowSpan(windows[r.window], r.start, r.stop))
    return tuple(spans)
