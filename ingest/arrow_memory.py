"""Which allocator Arrow uses in a process.

A reader service allocates row groups' buffers on Arrow's threads and frees them on
others (its decode and RPC threads, the row group cache). With pyarrow's default
allocator (mimalloc) that pattern costs a worker much kernel time (pages returned and
faulted in again); the system allocator does not, and serves more rows/s. A trainer
decoding in process is faster with the default, so only the service switches
(BENCHMARKS.md, ``neorec bench ingest``, has the figures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

MEMORY_POOLS: dict[str, str] = {
    "system": "system_memory_pool",
    "jemalloc": "jemalloc_memory_pool",
    "mimalloc": "mimalloc_memory_pool",
}
"""Each pool's name (as the command line takes it) and pyarrow's function that returns it
(pyarrow is imported only to switch, so that a command line's parser stays light)."""
SERVICE_MEMORY_POOL = "system"


def use_memory_pool(name: str) -> "pa.MemoryPool":
    """Make ``name``'s pool Arrow's default in this process; returns it. Raises
    ``ValueError`` for an unknown name or one this pyarrow build lacks."""
    import pyarrow as pa

    if name not in MEMORY_POOLS:
        raise ValueError(f"unknown Arrow memory pool {name!r}; expected one of {sorted(MEMORY_POOLS)}")
    try:
        pool = getattr(pa, MEMORY_POOLS[name])()
    except NotImplementedError as err:
        raise ValueError(f"this pyarrow build has no {name} memory pool") from err
    pa.set_memory_pool(pool)
    return pool
