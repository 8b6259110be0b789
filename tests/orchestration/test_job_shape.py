"""Nodes of one job started with different shapes (``--nnodes``, ``--nproc``) learn it from
the rendezvous store, every one of them; nodes that agree stop looking."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from neorec.orchestration.job_shape import JobShapeCheck
from neorec.orchestration.nodes import Nodes


def _checks(store: dist.TCPStore, shapes: list[tuple[int, int]]) -> tuple[list[JobShapeCheck], list[str]]:
    told: list[str] = []
    checks = [JobShapeCheck(Nodes(count, rank, f"127.0.0.1:{store.port}", "job"), nproc, told.append)
              for rank, (count, nproc) in enumerate(shapes)]
    for check in checks:
        check.start()
    return checks, told


def _wait_until(done, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_every_node_learns_of_a_node_of_another_shape():
    store = _store()
    checks, told = _checks(store, [(3, 2), (3, 2), (3, 1)])  # the third node runs one rank, not two
    try:
        _wait_until(lambda: len(told) == 3)
    finally:
        for check in checks:
            check.stop()
    assert len(set(told)) == 1 and "--nnodes 3 --nproc 2" in told[0] and "--nnodes 3 --nproc 1" in told[0]
    assert all(check.mismatch == told[0] for check in checks)


def test_nodes_that_agree_stop_looking_and_are_told_nothing():
    store = _store()
    checks, told = _checks(store, [(3, 2)] * 3)
    try:
        _wait_until(lambda: not any(check.looking for check in checks))
    finally:
        for check in checks:
            check.stop()
    assert told == [] and all(check.mismatch is None for check in checks)
