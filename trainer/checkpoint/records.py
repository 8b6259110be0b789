"""Rows of one shard of one table as a byte record: a checkpoint file is records one after
the other, and the manifest says where each lies.

A record is ``MAGIC``, a 4-byte little-endian header length, a JSON header, then its
arrays, each one zstd frame. The header holds the shard's place in its table, the rows it
holds (all of them, or the listed ``ids`` of an incremental checkpoint), how the weights
are encoded (raw in their storage type, fp16, or quantized to 8/4/2 bits) and, per
array, its dtype, shape and compressed size. Optimizer state is always float32.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from neorec.trainer.checkpoint.quantize import QuantizedRows, quantize

MAGIC = b"NRC1"
ZSTD_LEVEL = 1
FP16_MAX = 65504.0
WEIGHT_BITS = (32, 16, 8, 4, 2)


class RecordError(ValueError):
    """A record does not decode (truncated, corrupt, or not a record)."""


@dataclass
class ShardRows:
    """Rows of a shard: ``table`` rows ``[row_offset, row_offset + rows)`` and columns
    ``[col_offset, col_offset + cols)`` is the shard; ``ids`` (int64, ascending, local to
    the shard) the rows held, or None for all of them; ``weights`` ``[n, cols]`` in the
    storage type (float32, or the uint16 bits of ``storage`` fp16/bf16); ``states`` the
    optimizer state arrays, float32 ``[n, width]``."""

    table: str
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    storage: str
    ids: np.ndarray | None
    weights: np.ndarray
    states: list[np.ndarray] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.weights.shape[0]

    def float_weights(self) -> np.ndarray:
        """The weights as float32 ``[n, cols]``."""
        return as_float32(self.weights, self.storage)


def as_float32(weights: np.ndarray, storage: str) -> np.ndarray:
    """float32 values of ``weights`` stored as float32, or as fp16/bf16 uint16 bits."""
    if storage == "fp32":
        return weights
    if storage == "fp16":
        return weights.view(np.float16).astype(np.float32)
    return (weights.astype(np.uint32) << 16).view(np.float32)  # bf16: the top half of a float32


def encode(shard: ShardRows, bits: int) -> bytes:
    """The record of ``shard`` with its weights in ``bits`` bits (32: as stored, exactly)."""
    if bits not in WEIGHT_BITS:
        raise ValueError(f"weight bits must be one of {WEIGHT_BITS}, got {bits}")
    arrays: dict[str, np.ndarray] = {}
    if shard.ids is not None:
        arrays["ids"] = shard.ids.astype(np.int64, copy=False)
    encoding = shard.storage
    if bits == 32 or (bits == 16 and shard.storage != "fp32"):
        arrays["weights"] = shard.weights
    elif bits == 16:
        encoding = "fp16"
        arrays["weights"] = np.clip(shard.weights, -FP16_MAX, FP16_MAX).astype(np.float16).view(np.uint16)
    else:
        encoding = f"q{bits}"
        quantized = quantize(shard.float_weights(), bits)
        arrays.update(codes=quantized.codes, scale=quantized.scale, offset=quantized.offset)
    for i, state in enumerate(shard.states):
        arrays[f"state{i}"] = state.astype(np.float32, copy=False)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    frames, described = [], []
    for name, array in arrays.items():
        frame = compressor.compress(np.ascontiguousarray(array).tobytes())
        frames.append(frame)
        described.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape), "bytes": len(frame)})
    header = json.dumps({
        "table": shard.table, "row_offset": shard.row_offset, "rows": shard.rows, "col_offset": shard.col_offset,
        "cols": shard.cols, "storage": shard.storage, "encoding": encoding, "count": shard.count,
        "states": len(shard.states), "arrays": described,
    }).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *frames])


def decode(data: bytes) -> ShardRows:
    """The shard rows of a record (weights decoded to the storage type, or float32 when
    they were quantized to fewer bits than the storage); :class:`RecordError` if corrupt."""
    header, arrays = _split(data)
    encoding = header["encoding"]
    storage = header["storage"]
    if encoding.startswith("q"):
        bits = int(encoding[1:])
        weights = QuantizedRows(bits, header["cols"], arrays["codes"], arrays["scale"], arrays["offset"]).dequantize()
        storage = "fp32"
    elif encoding == "fp16" and storage == "fp32":
        weights, storage = arrays["weights"].view(np.float16).astype(np.float32), "fp32"
    else:
        weights = arrays["weights"]
    return ShardRows(header["table"], header["row_offset"], header["rows"], header["col_offset"], header["cols"],
                     storage, arrays.get("ids"), weights, [arrays[f"state{i}"] for i in range(header["states"])])


def _split(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    try:
        if data[:4] != MAGIC:
            raise RecordError("not a checkpoint record (bad magic)")
        (length,) = struct.unpack_from("<I", data, 4)
        header = json.loads(data[8 : 8 + length])
        position = 8 + length
        arrays = {}
        decompressor = zstandard.ZstdDecompressor()
        for described in header["arrays"]:
            frame = data[position : position + described["bytes"]]
            position += described["bytes"]
            dtype, shape = np.dtype(described["dtype"]), tuple(described["shape"])
            raw = decompressor.decompress(frame, max_output_size=int(np.prod(shape)) * dtype.itemsize)
            arrays[described["name"]] = np.frombuffer(raw, dtype=dtype).reshape(shape)
        if position != len(data):
            raise RecordError(f"{len(data) - position} bytes past the record's arrays")
        return header, arrays
    except (struct.error, json.JSONDecodeError, KeyError, TypeError, ValueError, zstandard.ZstdError) as err:
        if isinstance(err, RecordError):
            raise
        raise RecordError(f"corrupt record: {err}") from None
