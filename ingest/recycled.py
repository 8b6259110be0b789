"""Large arrays whose memory is recycled rather than freed: what decoded chunks are made of.

A permuted window's chunks are decoded a group at a time, and the group's outputs (ids,
bag lengths, dense values, labels: ~55 MB for two criteo chunks of 64k rows, ~110 MB for
four) are allocated by the one thread that decodes it, then freed once its batches are
used. glibc's malloc serves each thread from heaps of at most 64 MB and unmaps an extra
heap the moment it is empty, whatever its thresholds say, so every chunk group's outputs
were mapped afresh and their huge pages zeroed as the kernels first wrote them: 9% of a
reader service's samples on row-shuffled criteo (``BENCHMARKS.md``, ``neorec bench
ingest``).

:func:`empty` hands out arrays backed by buffers that go back to a pool when the last
array viewing them is gone (a batch's views of its chunk included), and takes a buffer
of a similar size from the pool when it has one, so the memory stays mapped and its
pages stay faulted in. Arrays under :data:`MIN_BYTES` come from numpy as usual; the pool
keeps at most :data:`KEEP_BYTES` of idle buffers and frees any beyond.
"""

from __future__ import annotations

import threading

import numpy as np

MIN_BYTES = 1 << 20
"""Smaller arrays are allocated as usual: malloc keeps such blocks for reuse itself."""
KEEP_BYTES = 512 << 20
"""Most bytes of idle buffers the pool keeps (about four criteo chunk groups)."""
_STEP = 1 << 20
"""Buffers are sized in whole steps, so that a chunk's outputs (whose sizes vary with its
ids) fit the buffers of the chunk before."""
_SLACK = 2
"""A request takes an idle buffer of up to this many times its size (not a much larger one,
which a later, larger request may need)."""


class ArrayPool:
    """Buffers by size in :data:`_STEP` steps; see the module's docstring. Thread-safe: an
    array may die on any thread."""

    def __init__(self, keep_bytes: int = KEEP_BYTES, min_bytes: int = MIN_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self.min_bytes = min_bytes
        self.idle_bytes = 0
        self._idle: dict[int, list[np.ndarray]] = {}  # by size in steps: uint8 buffers no array views
        self._lock = threading.RLock()  # reentrant: a buffer may come back while this thread holds it

    def empty(self, shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized C-contiguous array, as ``np.empty(shape, dtype)``."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype)
        steps = -(-nbytes // _STEP)
        buffer = self._take(steps)
        if buffer is None:
            buffer = np.empty(steps * _STEP, dtype=np.uint8)
        return np.asarray(_Lease(self, buffer))[:nbytes].view(dtype).reshape(shape)

    def _take(self, steps: int) -> np.ndarray | None:
        with self._lock:
            for size in range(steps, _SLACK * steps + 1):
                buffers = self._idle.get(size)
                if buffers:
                    self.idle_bytes -= size * _STEP
                    return buffers.pop()
        return None

    def _give_back(self, buffer: np.ndarray) -> None:
        steps = buffer.size // _STEP
        with self._lock:
            if self.idle_bytes + buffer.size > self.keep_bytes:
                return  # freed
            self.idle_bytes += buffer.size
            self._idle.setdefault(steps, []).append(buffer)


class _Lease:
    """A pool's buffer lent to the arrays made from it (their base): back to the pool when
    the last of them is gone."""

    def __init__(self, pool: ArrayPool, buffer: np.ndarray) -> None:
        self._pool = pool
        self._buffer = buffer
        self.__array_interface__ = buffer.__array_interface__

    def __del__(self) -> None:
        self._pool._give_back(self._buffer)


_POOL = ArrayPool()


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized array from this process's pool: ``np.empty(shape, dtype)`` whose
    memory, when large, is recycled (see the module's docstring)."""
    return _POOL.empty(shape, dtype)
