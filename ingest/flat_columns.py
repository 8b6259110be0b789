"""Flat Arrow columns (numbers, and single ids that may be null) decoded straight from their
buffers by Numba kernels, in one pass per column: what :func:`neorec.ingest.decoder.decode_table`
does with every column but the lists.

A column arrives as *parts*: arrays whose rows land at given places of the decoded rows.
A slice of one row group is a single part that fills the rows in order; a permuted chunk
(row-level shuffling) has one part per row group of its window, each naming the rows it
gives in ascending order and where each one goes. Reading a row group's rows in ascending
order streams through its column, while the rows' places, random, lie in the chunk's own
output, which the caches hold; reading in the chunk's order instead (Arrow's take) waits
for a random read of a column larger than the caches at every value, and then decodes the
taken copy once more.

Several chunks that together take a good share of their row groups' rows are decoded
faster as *routed parts* (:class:`RoutedPart`): one pass over every row of a row group,
each row sent to its place in one of the chunks' outputs (:class:`Outputs`) or dropped.
The pass reads the column and one int32 route per row in order, where a pass per chunk
reads a row index and a place (int64 each) per value and the group's column once per
chunk (BENCHMARKS.md, row-level shuffling, has the figures).

The kernels check nothing: a caller checks the decoded values (finite, in range) and,
on a failure, finds the first bad row again the slow way, so that the fast path stays one
pass and the errors stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numba
import numpy as np
import pyarrow as pa

from neorec.common.borrowed_view import borrowed_view, view_at
from neorec.ingest import recycled

_NONE = np.zeros(0, dtype=np.int64)
_NO_BITMAP = np.zeros(0, dtype=np.uint8)


@dataclass(frozen=True)
class Part:
    """Rows of one flat array: all of them, in order, to places ``[0, len)`` (``rows`` is
    None), or rows ``rows`` (int64, ascending) to places ``places`` (int64, same size)."""

    array: pa.Array
    rows: np.ndarray | None = None
    places: np.ndarray | None = None


class _Buffers:
    """The values (numpy view of the whole buffer), validity bitmap (uint8, empty when
    there are no nulls) and first element of a flat Arrow array."""

    def __init__(self, array: pa.Array) -> None:
        validity, data = array.buffers()[:2]
        dtype = np.dtype(array.type.to_pandas_dtype())
        used = array.offset + len(array)  # a buffer may hold more bytes than its elements
        self.values = np.frombuffer(data, dtype=dtype, count=used) if used else np.zeros(0, dtype=dtype)
        self.bitmap = (np.frombuffer(validity, dtype=np.uint8) if array.null_count and validity is not None
                       else _NO_BITMAP)
        self.offset = array.offset


def decodable(kind: pa.DataType) -> bool:
    """Whether the kernels read a flat column of this type (integers, float32, float64)."""
    return pa.types.is_integer(kind) or pa.types.is_float32(kind) or pa.types.is_float64(kind)


def numbers_into(parts: Sequence[Part], missing: float, out: np.ndarray, clip_add_one: bool = False) -> bool:
    """``out`` (float32 ``[n]``, may be strided) ← the parts' numbers as float32 (numpy's
    rounding), ``missing`` for a null; with ``clip_add_one``, ``max(x, 0) + 1`` of each
    (in float32, what ``log(1 + x)`` of the clipped value takes the log of). Returns
    whether every number, before clipping, is finite (when not, what ``out`` holds is
    unspecified)."""
    finite = True
    for part in parts:
        b = _Buffers(part.array)
        rows, places = (_NONE, _NONE) if part.rows is None else (part.rows, part.places)
        finite &= _numbers(b.values, b.bitmap, b.offset, rows, places, part.rows is not None, np.float32(missing),
                           clip_add_one, out)
    return finite


def single_ids(parts: Sequence[Part], flags: np.ndarray) -> tuple[int, Callable[[np.ndarray], None]]:
    """Single ids of ``flags.size`` rows: how many rows hold one, and ``write(out)``, which
    writes those ids (as int64, in row order, nulls left out) to ``out``, an array of
    exactly that many. Once ``write`` has run, ``flags`` (int32 ``[n]``) holds 1 for a row
    with an id and 0 for a null (its bag length).

    The count comes first so that a caller can place every feature's ids before writing
    any: for rows in order it is Arrow's null count, and the write is one pass; for picked
    rows the flags are written at once and counted."""
    buffers = [_Buffers(p.array) for p in parts]
    if len(parts) == 1 and parts[0].rows is None:
        b = buffers[0]

        def in_order(out: np.ndarray) -> None:
            _ids_in_order(b.values, b.bitmap, b.offset, flags, out)

        return flags.size - parts[0].array.null_count, in_order
    nulls = any(b.bitmap.size for b in buffers)
    if nulls:
        for b, p in zip(buffers, parts):
            _valid_to(b.bitmap, b.offset, p.rows, p.places, flags)
    else:
        flags[:] = 1

    def place(targets: Sequence[np.ndarray]) -> None:
        for b, p in zip(buffers, parts):
            _placed(b.values, b.offset, p.rows, p.places, targets[0])

    write = _written_compacted([flags], nulls, place)
    return int(flags.sum()) if nulls else flags.size, lambda out: write([out])


@numba.njit(cache=True, nogil=True, inline="always")
def _valid(bitmap, bit):  # pragma: no cover - compiled
    return (bitmap[bit >> 3] >> (bit & 7)) & 1


@numba.njit(cache=True, nogil=True, inline="always")
def _column(values, offset):  # pragma: no cover - compiled
    """The array's elements from ``offset`` on, indexed from 0: read in order
    (``column[k]``), they are one contiguous run to LLVM (see common/borrowed_view)."""
    return borrowed_view(values, offset, values.shape[0] - offset)


@numba.njit(cache=True, nogil=True)
def _numbers(values, bitmap, offset, rows, places, picked, missing, clip_add_one, out):  # pragma: no cover - compiled
    n = rows.size if picked else out.shape[0]
    column = _column(values, offset)
    finite = True
    for k in range(n):
        r = rows[k] if picked else k
        x = np.float32(column[r])
        if bitmap.size != 0 and not _valid(bitmap, offset + r):
            x = missing
        finite &= np.isfinite(x)
        if clip_add_one:
            x = (x if x > 0 else np.float32(0.0)) + np.float32(1.0)
        out[places[k] if picked else k] = x
    return finite


@numba.njit(cache=True, nogil=True)
def _ids_in_order(values, bitmap, offset, flags, out):  # pragma: no cover - compiled
    n = flags.size
    column = _column(values, offset)
    if bitmap.size == 0:
        for k in range(n):
            flags[k] = 1
            out[k] = column[k]
        return
    written = 0
    for k in range(n):
        ok = _valid(bitmap, offset + k)
        flags[k] = ok
        if written < out.size:  # past the last id, nothing is written: out ends there
            out[written] = column[k]  # overwritten by the next id when this one is null
        written += ok


@numba.njit(cache=True, nogil=True)
def _valid_to(bitmap, offset, rows, places, flags):  # pragma: no cover - compiled
    for k in range(rows.size):
        flags[places[k]] = 1 if bitmap.size == 0 else _valid(bitmap, offset + rows[k])


@numba.njit(cache=True, nogil=True)
def _placed(values, offset, rows, places, out):  # pragma: no cover - compiled
    column = _column(values, offset)
    for k in range(rows.size):
        out[places[k]] = column[rows[k]]


@numba.njit(cache=True, nogil=True)
def _compacted(placed, flags, out):  # pragma: no cover - compiled
    written = 0
    for k in range(flags.size):
        if written < out.size:  # past the last id, nothing is written: out ends there
            out[written] = placed[k]  # overwritten by the next id when this one is null
        written += flags[k]


@dataclass(frozen=True)
class RoutedPart:
    """Every row of a flat array, row ``r`` to destination ``routes[r]`` (int32) of an
    :class:`Outputs`."""

    array: pa.Array
    routes: np.ndarray


class Outputs:
    """Arrays that routed rows land in (1-D, C-contiguous, of one dtype; held here, so
    alive while the kernels write them): destination ``q`` is element
    ``q & (2**shift - 1)`` of ``arrays[q >> shift]``, and a ``q >> shift`` of
    ``len(arrays)`` drops the row (it is written to a scratch element)."""

    def __init__(self, arrays: Sequence[np.ndarray], shift: int) -> None:
        if any(a.ndim != 1 or not a.flags.c_contiguous or a.dtype != arrays[0].dtype for a in arrays):
            raise ValueError("routed rows land in 1-D C-contiguous arrays of one dtype")
        self.arrays = list(arrays)
        self._scratch = np.empty(1, dtype=np.int64)  # a dropped row's element (of any dtype up to 8 bytes)
        self.addresses = np.array([a.ctypes.data for a in self.arrays] + [self._scratch.ctypes.data],
                                  dtype=np.int64)
        self.shift = shift
        self.like = arrays[0][:0]  # the arrays' dtype, for the kernels' views


def numbers_routed(parts: Sequence[RoutedPart], missing: float, outputs: Outputs, clip_add_one: bool = False) -> bool:
    """:func:`numbers_into` for routed parts (float32 outputs); returns whether every
    number that lands (dropped rows aside) is finite before clipping."""
    finite = True
    for part in parts:
        b = _Buffers(part.array)
        finite &= _numbers_routed(b.values, b.bitmap, b.offset, part.routes, outputs.addresses, outputs.shift,
                                  np.float32(missing), clip_add_one, outputs.like)
    return finite


def single_ids_routed(parts: Sequence[RoutedPart], flags: Sequence[np.ndarray],
                      shift: int) -> tuple[list[int], Callable[[Sequence[np.ndarray]], None]]:
    """:func:`single_ids` for routed parts: ``flags[k]`` (int32 ``[n_k]``) are output ``k``'s
    flags; returns each output's count of ids, and ``write(outs)``, which writes output
    ``k``'s ids to ``outs[k]``. The flags are written at once."""
    buffers = [_Buffers(p.array) for p in parts]
    nulls = any(b.bitmap.size for b in buffers)
    if nulls:
        targets = Outputs(flags, shift)
        for b, p in zip(buffers, parts):
            _valid_routed(b.bitmap, b.offset, p.routes, targets.addresses, shift, targets.like)
    else:
        for f in flags:
            f[:] = 1

    def place(targets: Sequence[np.ndarray]) -> None:
        outputs = Outputs(targets, shift)
        for b, p in zip(buffers, parts):
            _placed_routed(b.values, b.offset, p.routes, outputs.addresses, shift, outputs.like)

    return [int(f.sum()) if nulls else f.size for f in flags], _written_compacted(flags, nulls, place)


def _written_compacted(flags: Sequence[np.ndarray], nulls: bool,
                       place: Callable[[Sequence[np.ndarray]], None]) -> Callable[[Sequence[np.ndarray]], None]:
    """``write(outs)``: ``outs[k]`` ← output ``k``'s ids in row order, nulls left out (its
    ``flags[k]``: 1 for a row with an id). ``place(targets)`` writes every row's value, a
    null row's too, at its row of ``targets[k]``: the outputs themselves when no row is
    null, else int64 scratch arrays that are then compacted into them."""
    def write(outs: Sequence[np.ndarray]) -> None:
        if not nulls:
            place(outs)
            return
        placed = [recycled.empty(f.size, np.int64) for f in flags]
        place(placed)
        for values, f, out in zip(placed, flags, outs):
            _compacted(values, f, out)

    return write


@numba.njit(cache=True, nogil=True, inline="always")
def _route(addresses, shift, like, q):  # pragma: no cover - compiled
    """A one-element view of where destination ``q`` lands."""
    return view_at(addresses[q >> shift] + (q & ((1 << shift) - 1)) * like.itemsize, 1, like)


@numba.njit(cache=True, nogil=True)
def _numbers_routed(values, bitmap, offset, routes, addresses, shift, missing, clip_add_one,
                    like):  # pragma: no cover - compiled
    column = _column(values, offset)
    dropped = addresses.size - 1
    finite = True
    for r in range(routes.size):
        x = np.float32(column[r])
        if bitmap.size != 0 and not _valid(bitmap, offset + r):
            x = missing
        q = routes[r]
        finite &= np.isfinite(x) | ((q >> shift) == dropped)
        if clip_add_one:
            x = (x if x > 0 else np.float32(0.0)) + np.float32(1.0)
        _route(addresses, shift, like, q)[0] = x
    return finite


@numba.njit(cache=True, nogil=True)
def _valid_routed(bitmap, offset, routes, addresses, shift, like):  # pragma: no cover - compiled
    for r in range(routes.size):
        _route(addresses, shift, like, routes[r])[0] = 1 if bitmap.size == 0 else _valid(bitmap, offset + r)


@numba.njit(cache=True, nogil=True)
def _placed_routed(values, offset, routes, addresses, shift, like):  # pragma: no cover - compiled
    column = _column(values, offset)
    for r in range(routes.size):
        _route(addresses, shift, like, routes[r])[0] = column[r]
