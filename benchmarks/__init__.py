"""Benchmarks run by ``neorec bench NAME``: ours and a baseline side by side, one process,
same data, with the ratio printed (absolute times drift on shared machines; ratios hold)."""

from __future__ import annotations

from typing import Any


def run_benchmark(name: str, quick: bool = False, nproc: int = 1, threads: int = 0,
                  contend: bool = False) -> dict[str, Any]:
    """Benchmark ``name``; ``threads`` (tbe): threads for both sides (0: all cores);
    ``contend`` (train): quiet against one competing CPU-bound process."""
    if name == "train" and contend:
        from neorec.benchmarks.contention_bench import run

        return run(quick=quick)
    if name == "train" and nproc > 1:
        from neorec.benchmarks.sharded_train_bench import run

        return run(quick=quick, nproc=nproc)
    if name == "collectives":
        from neorec.benchmarks.collectives_bench import run

        return run(quick=quick, nproc=max(nproc, 2))
    if name == "train":
        from neorec.benchmarks.train_bench import run
    elif name == "tbe":
        from neorec.benchmarks.tbe_bench import run

        return run(quick=quick, threads=threads)
    elif name == "ingest":
        from neorec.benchmarks.ingest_bench import run
    elif name == "checkpoint":
        from neorec.benchmarks.checkpoint_bench import run
    elif name == "import":
        from neorec.benchmarks.import_bench import run
    elif name == "dynamic":
        from neorec.benchmarks.dynamic_bench import run
    elif name == "store":
        from neorec.benchmarks.store_bench import run
    elif name == "follow":
        from neorec.benchmarks.follow_bench import run
    else:
        raise ValueError(f"unknown benchmark {name!r}")
    return run(quick=quick)
