"""Which allocator Arrow uses in a process.

A reader service allocates row groups' buffers on Arrow's threads and frees them on
others (its decode and RPC threads, the row group cache). With pyarrow's default
allocator (mimalloc) that pattern costs a worker much kernel time (pages returned and
faulted in again); the system allocator does not, and serves more rows/s. A trainer
decoding in process is faster with the default, so only the service switches
(BENCHMARKS.md, ``neorec bench ingest``, has the figures).
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa

MEMORY_POOLS: dict[str, Callable[[], pa.MemoryPool]] = {
    "system": pa.system_memory_pool,
    "jemalloc": pa.jemalloc_memory_pool,
    "mimalloc": pa.mimalloc_memory_pool,
}
SERVICE_MEMORY_POOL = "system"


def use_memory_pool(name: str) -> pa.MemoryPool:
    """Make ``name``'s pool Arrow's default in this process; returns it. Raises
    ``ValueError`` for an unknown name or one this pyarrow build lacks."""
    if name not in MEMORY_POOLS:
        raise ValueError(f"unknown Arrow memory pool {name!r}; expected one of {sorted(MEMORY_POOLS)}")
    try:
        pool = MEMORY_POOLS[name]()
    except NotImplementedError as err:
        raise ValueError(f"this pyarrow build has no {name} memory pool") from err
    pa.set_memory_pool(pool)
    return pool
