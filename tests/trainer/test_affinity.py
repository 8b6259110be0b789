"""Pinning a rank's threads to its share of the host's cores; their scheduling policy."""

import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from neorec.trainer.run.affinity import pin_process, pin_rank, rank_cores, schedule_as_batch

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux thread affinity")


def test_shares_are_contiguous_disjoint_and_cover_the_cores():
    cores = [7, 0, 3, 1, 2, 6, 5, 4]
    shares = [rank_cores(cores, r, 3) for r in range(3)]
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [rank_cores([4, 9], r, 2) for r in range(2)] == [[4], [9]]


def test_fewer_cores_than_ranks_gets_no_share():
    assert rank_cores([0, 1], 0, 4) is None


def test_rank_outside_the_host_is_an_error():
    with pytest.raises(ValueError, match="local rank 2"):
        rank_cores([0, 1], 2, 2)


def per_thread(read: Callable[[int], Any]) -> dict[int, Any]:
    """``read(thread id)`` of every thread of this process (threads that end meanwhile left
    out)."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            found[int(task.name)] = read(int(task.name))
        except ProcessLookupError:
            pass
    return found


def thread_affinities() -> dict[int, set[int]]:
    return per_thread(os.sched_getaffinity)


@linux_only
def test_pinning_reaches_running_and_later_threads():
    original = os.sched_getaffinity(0)
    core = min(original)
    release = threading.Event()
    running = threading.Thread(target=release.wait)
    running.start()
    later_affinity = []
    try:
        pin_process([core])
        assert all(cores == {core} for cores in thread_affinities().values())
        later = threading.Thread(target=lambda: later_affinity.append(os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert later_affinity == [{core}]
    finally:
        pin_process(sorted(original))
        release.set()
        running.join()
    assert all(cores == original for cores in thread_affinities().values())


@linux_only
def test_a_rank_alone_on_its_host_is_left_alone():
    before = thread_affinities()
    assert pin_rank(0, 1) is None
    assert thread_affinities() == before


def thread_policies() -> dict[int, int]:
    return per_thread(os.sched_getscheduler)


@linux_only
def test_batch_scheduling_reaches_running_and_later_threads_and_keeps_chosen_policies():
    original = thread_policies()
    release = threading.Event()
    running = threading.Thread(target=release.wait)
    chosen = threading.Thread(target=release.wait)  # its policy chosen by someone: kept
    running.start()
    chosen.start()
    os.sched_setscheduler(chosen.native_id, os.SCHED_IDLE, os.sched_param(0))
    later_policy = []
    try:
        assert schedule_as_batch()
        policies = thread_policies()
        assert policies.pop(chosen.native_id) == os.SCHED_IDLE
        assert set(policies.values()) == {os.SCHED_BATCH}
        later = threading.Thread(target=lambda: later_policy.append(os.sched_getscheduler(0)))
        later.start()
        later.join()
        assert later_policy == [os.SCHED_BATCH]
    finally:
        for thread, policy in original.items():
            try:
                os.sched_setscheduler(thread, policy, os.sched_param(0))
            except ProcessLookupError:
                pass
        release.set()
        running.join()
        chosen.join()
