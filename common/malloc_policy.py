"""How glibc's malloc treats the memory a training step frees: kept for the next step, not
given back to the kernel and faulted in again.

Every step allocates the same large temporaries and frees them at its end: the batch's ids
and their groupings as int64 arrays of about 1 MB each, the pooled embeddings and their
gradient (tens or hundreds of MB at large batches and widths), the MLPs' activations.
glibc's malloc maps blocks of 128 KiB and more with their own ``mmap`` and returns the top
of its heap to the kernel once 128 KiB of it are free, raising both thresholds as it sees
large blocks freed, up to 32 MiB. Whether it has raised them by the time training starts
depends on what the process loaded and allocated first: with FBGEMM's CPU library
imported before the fused embeddings were built, every step of ``neorec bench tbe``'s
fused embeddings took ~1,300 page faults (its temporaries, mapped and zeroed afresh) and
11–12 ms instead of 6.6–7.2 ms. Blocks above 32 MiB are mapped afresh every time: the
criteo-like step with tables 128 wide (a 54 MB pooled output at 4,096 samples) took 36 ms
instead of 12.

:func:`keep_freed_memory` serves every block from malloc's heaps instead (no block gets
its own mapping: ``M_MMAP_MAX`` 0), and keeps up to :data:`TRIM_THRESHOLD` of free memory
at a heap's top mapped for the next step. The cost is memory a process freed in the
middle of its heap staying mapped (reused by later blocks, not given back). It is set
when :mod:`neorec` is imported, unless the user chose any of :data:`MALLOC_VARIABLES`, and
only with glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping

MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""The environment variables by which a user sets glibc's malloc thresholds."""

TRIM_THRESHOLD = 256 << 20
"""Bytes of free memory at the top of a heap that malloc keeps mapped (and that the
process's RSS counts). glibc's own dynamic threshold stops at 64 MiB, which was not enough:
in ``neorec bench tbe``'s process, with FBGEMM's modules beside ours, steps went back to
faulting their temporaries in at 64 MiB (9.4 ms a step against 6.5-6.9 ms)."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc (whose ``mallopt`` these thresholds are
    for), else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Serve every block from malloc's heaps and keep :data:`TRIM_THRESHOLD` of free heap
    mapped in this process, unless one of :data:`MALLOC_VARIABLES` is in ``environ`` or
    the C library is not glibc; returns whether it set them."""
    libc = None if any(name in environ for name in MALLOC_VARIABLES) else glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
