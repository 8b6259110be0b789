"""CPU affinity and scheduling policy of a rank that shares its host with other ranks.

Ranks on one host that float over all of its cores get in each other's way: the threads
of one rank (its training thread, its input thread, the collectives' threads) preempt
another rank's training thread at random moments, and the ranks then wait for each other
at every collective. Pinning each rank to its own share of the cores keeps a rank's
threads on its own cores, so the ranks' steps take the same time.

Pinned, a rank's own threads still preempt each other: a collective's thread woken by a
message, or the input thread woken by a free slot, takes the core from the training
thread in the middle of its work, and that training thread then waits for the scheduler's
next tick to get it back while the other rank waits for it. Linux's ``SCHED_BATCH``
policy (for "non-interactive" work, no privilege needed) turns that wake-up preemption
off: a woken thread runs when the running one blocks, which in a training step is soon,
at its next collective.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


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
    _for_each_thread(lambda thread: os.sched_setaffinity(thread, cores))


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


def schedule_as_batch() -> bool:
    """Run every thread of this process that has the default policy (``SCHED_OTHER``), and
    the threads they start later, under ``SCHED_BATCH`` (new threads inherit their
    creator's policy). A policy someone chose (real time, idle) is kept. Returns False where
    the platform has no such policy or the change is not permitted (a sandbox's filter)."""
    if not hasattr(os, "SCHED_BATCH") or not Path("/proc/self/task").is_dir():
        return False

    def batch(thread: int) -> None:
        if os.sched_getscheduler(thread) == os.SCHED_OTHER:
            os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))

    try:
        _for_each_thread(batch)
    except PermissionError:
        return False
    return True


def _for_each_thread(apply: Callable[[int], None]) -> None:
    """``apply(thread id)`` to every thread of this process."""
    for task in Path("/proc/self/task").iterdir():
        try:
            apply(int(task.name))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
