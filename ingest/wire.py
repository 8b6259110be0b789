"""A batch on the wire: :class:`HostBatch` ⇄ the ``Batch`` protobuf message.

Tensors travel as raw little-endian bytes in one ``body`` field (optionally one zstd
frame); decoding is ``numpy.frombuffer`` on that body, never a loop over rows or ids.
Ids travel as uint32 when the largest table has at most 2**32 rows (the decoder maps
every id into its table, never negative), bag lengths in the narrowest width that holds
the batch's longest bag, which halves a typical batch's bytes; the receiver widens them
back to int64 and int32.
"""

from __future__ import annotations

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from typing import Mapping, Sequence

from neorec.ingest.batch import HostBatch, Provenance
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


class WireError(ValueError):
    """A message does not hold a well-formed batch."""


def serialize_batch(batch: HostBatch, id_bound: int, window_index: Mapping[Window, int],
                    compression: int = ingest_pb2.COMPRESSION_NONE) -> bytes:
    """The serialized ``Batch`` message for ``batch``, whose ids all lie in ``[0, id_bound)``
    (the largest table's rows: no scan of the ids), built with one copy of the tensors.
    ``window_index`` numbers the windows of the request the batch answers (its provenance
    names rows by window number).

    The header fields are serialized by protobuf; the body field (number 11) is appended
    by hand (tag, length, bytes), which is a valid encoding of the same message: fields
    may come in any order. This saves the two copies of the body that setting the field
    and serializing the message would make.
    """
    provenance = batch.provenance
    if provenance is None:
        raise ValueError("only batches with a provenance go on the wire")
    value_kind = next(k for k in VALUE_KINDS if id_bound - 1 <= np.iinfo(k).max)
    length_kind = _narrowest(batch.lengths, LENGTH_KINDS)
    parts = [
        batch.values.astype(value_kind, copy=False),
        np.ascontiguousarray(batch.dense, dtype="<f4"),
        np.ascontiguousarray(batch.labels, dtype="<f4"),
    ]
    if batch.weights is not None:
        parts.append(np.ascontiguousarray(batch.weights, dtype="<f4"))
    parts.append(batch.lengths.astype(length_kind, copy=False))
    views = [memoryview(p).cast("B") for p in parts]
    if compression == ingest_pb2.COMPRESSION_ZSTD:
        views = [memoryview(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(views)))]
    elif compression != ingest_pb2.COMPRESSION_NONE:
        raise ValueError(f"unknown compression {compression}")
    header = ingest_pb2.Batch(
        epoch=provenance.epoch,
        step=provenance.step,
        rows=[ingest_pb2.RowSpan(window=window_index[s.window], start=s.start, stop=s.stop)
              for s in provenance.rows],
        batch_size=batch.batch_size,
        num_valid=batch.num_valid,
        num_dense=batch.dense.shape[1],
        num_features=batch.num_features,
        num_values=batch.values.shape[0],
        has_weights=batch.weights is not None,
        compression=compression,
        value_bytes=value_kind.itemsize,
        length_bytes=length_kind.itemsize,
    )
    body_size = sum(v.nbytes for v in views)
    return b"".join([header.SerializeToString(), _BODY_TAG, _varint(body_size), *views])


VALUE_KINDS = tuple(np.dtype(k) for k in ("<u4", "<i8"))
LENGTH_KINDS = tuple(np.dtype(k) for k in ("<u1", "<u2", "<i4"))
"""Wire widths of ids and of bag lengths, narrowest first (the last is the batch's own)."""


def _narrowest(array: np.ndarray, kinds: tuple[np.dtype, ...]) -> np.dtype:
    """The first of ``kinds`` that holds every element of ``array`` (the last holds all)."""
    if array.size == 0:
        return kinds[0]
    if array.min() < 0:
        return kinds[-1]
    largest = int(array.max())
    return next(k for k in kinds if largest <= np.iinfo(k).max)


def _wire_kind(width: int, kinds: tuple[np.dtype, ...], field: str, step: int) -> np.dtype:
    for kind in kinds:
        if kind.itemsize == width:
            return kind
    raise WireError(f"batch step {step}: {field} is {width}, expected one of {[k.itemsize for k in kinds]}")


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

    The arrays are read-only views into ``data`` itself (or into its decompressed body):
    only the small header goes through protobuf, so the tensors are never copied. Raises
    :class:`WireError` if the message is malformed or its sizes do not match its body.
    """
    message, body = split_body(data)
    if message.num_features != len(keys):
        raise WireError(f"batch has {message.num_features} features, the dataset {len(keys)}")
    if message.compression == ingest_pb2.COMPRESSION_ZSTD:
        try:
            body = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError as err:
            raise WireError(f"batch step {message.step}: the zstd body does not decompress: {err}") from None
    elif message.compression != ingest_pb2.COMPRESSION_NONE:
        raise WireError(f"unknown compression {message.compression}")
    size, num_values, num_dense, step = message.batch_size, message.num_values, message.num_dense, message.step
    value_kind = _wire_kind(message.value_bytes, VALUE_KINDS, "value_bytes", step)
    length_kind = _wire_kind(message.length_bytes, LENGTH_KINDS, "length_bytes", step)
    layout = [(value_kind, num_values), (np.dtype("<f4"), size * num_dense), (np.dtype("<f4"), size)]
    if message.has_weights:
        layout.append((np.dtype("<f4"), num_values))
    layout.append((length_kind, len(keys) * size))
    expected = sum(kind.itemsize * count for kind, count in layout)
    if expected != len(body):
        raise WireError(f"batch step {step}: body holds {len(body)} bytes, its header says {expected}")
    arrays = []
    offset = 0
    for kind, count in layout:
        arrays.append(np.frombuffer(body, dtype=kind, count=count, offset=offset))
        offset += arrays[-1].nbytes
    values, dense, labels = arrays[:3]
    return HostBatch(
        dense=dense.reshape(size, num_dense),
        labels=labels,
        keys=keys,
        lengths=arrays[-1].astype(np.int32, copy=False),
        values=values.astype(np.int64, copy=False),
        weights=arrays[3] if message.has_weights else None,
        num_valid=message.num_valid,
        provenance=Provenance(epoch=message.epoch, step=message.step, rows=_spans(message, windows)),
    )


def _spans(message: ingest_pb2.Batch, windows: Sequence[Window]) -> tuple[RowSpan, ...]:
    spans = []
    for r in message.rows:
        if r.window >= len(windows) or not r.start < r.stop <= windows[r.window].num_rows:
            raise WireError(f"batch step {message.step}: rows [{r.start}, {r.stop}) of window {r.window} "
                            f"are not rows of the request's {len(windows)} windows")
        spans.append(RowSpan(windows[r.window], r.start, r.stop))
    return tuple(spans)
