"""CPU affinity of a rank that shares its host with other ranks.

Ranks on one host that float over all of its cores get in each other's way: the threads
of one rank (its training thread, its input thread, the collectives' threads) preempt
another rank's training thread at random moments, and the ranks then wait for each other
at every collective. Pinning each rank to its own share of the cores keeps a rank's
threads on its own cores, so the ranks' steps take the same time.
"""

from __future__ import annotations

import os
from pathlib import Path


def rank_cores(available: list[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """Rank ``local_rank``'s share of ``available`` cores (sorted): ``local_world_size``
    contiguous shares whose sizes differ by at most one. None when there are fewer cores
    than ranks (no share of its own for every rank)."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside [0, {local_world_size})")
    if len(available) < local_world_size:
        return None
    cores = sorted(available)
    share, extra = divmod(len(cores), local_world_size)
    start = local_rank * share + min(local_rank, extra)
    return cores[start : start + share + (local_rank < extra)]


def pin_process(cores: list[int]) -> None:
    """Run every thread of this process, and the threads it starts later, on ``cores``
    only (Linux: each thread has its own affinity, and new threads inherit their
    creator's)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def pin_rank(local_rank: int, local_world_size: int) -> list[int] | None:
    """Pin this process to its share of the cores it may use (see :func:`rank_cores`);
    returns the share, or None where it was left alone: a rank alone on its host, fewer
    cores than ranks, or a platform without thread affinity."""
    if local_world_size <= 1 or not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir():
        return None
    cores = rank_cores(sorted(os.sched_getaffinity(0)), local_rank, local_world_size)
    if cores is not None:
        pin_process(cores)
    return cores
