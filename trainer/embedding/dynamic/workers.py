"""The id steps of a batch's map shards, run side by side.

Every map shard (:class:`~neorec.trainer.embedding.dynamic.table.DynamicTable`) decides
alone, from its own ids in order, so shards can run on different threads and decide exactly
as one after the other: the same slots, admissions and evictions, bit for bit. Their
kernels release the GIL. A batch's shards are dealt into as many groups as the calling
thread's Numba threads (the count training uses, see
:mod:`~neorec.trainer.run.thread_governor`), largest first to the lightest group; the
calling thread runs one group and a pool the others.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

import numba

T = TypeVar("T")


def deal(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """Indices of ``sizes`` dealt into ``groups`` lists of about equal total size (the
    largest first, each to the group with the least so far; ties to the lowest group), each
    list in ascending order. Empty groups are left out."""
    dealt: list[list[int]] = [[] for _ in range(max(1, groups))]
    totals = [0] * len(dealt)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(len(dealt)), key=lambda g: (totals[g], g))
        dealt[g].append(i)
        totals[g] += sizes[i]
    return [sorted(group) for group in dealt if group]


class MapShardWorkers:
    """Runs a batch's per-shard jobs on the calling thread and a pool of threads, created at
    the first batch that can use it (its threads end when this object is collected)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def run(self, jobs: Sequence[Callable[[], T]], sizes: Sequence[int]) -> list[T]:
        """Each job's result, in ``jobs`` order; ``sizes[i]``: job ``i``'s ids (how the
        jobs are dealt)."""
        groups = deal(sizes, min(numba.get_num_threads(), len(jobs)))
        if len(groups) <= 1:
            return [job() for job in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(numba.config.NUMBA_NUM_THREADS - 1, thread_name_prefix="dynamic-maps")
        results: list[T | None] = [None] * len(jobs)

        def run_group(group: list[int]) -> None:
            for i in group:
                results[i] = jobs[i]()

        others = [self._pool.submit(run_group, group) for group in groups[1:]]
        try:
            run_group(groups[0])
        finally:
            wait(others)  # no job outlives the call, even when one failed
        for future in others:
            future.result()
        return results  # type: ignore[return-value]
