"""The thread governor: the count follows the CPUs other processes leave, and changing it
changes no result."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numba
import pytest
import torch

from neorec.trainer.run import thread_governor
from neorec.trainer.run.thread_governor import (ThreadGovernor, busy_seconds, dense_thread_invariant, own_cpu_seconds,
                                                thread_ladder)
from neorec.trainer.run.build import build_model
from neorec.trainer.run.train import train
from tests.trainer.checkpoint.test_resume import config_for
from tests.trainer.run_records import records
from tests.trainer.test_train import final_state

TWO_THREADS = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2 or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs two CPUs")


def test_ladder_halves_down_to_one():
    assert thread_ladder(1) == [1]
    assert thread_ladder(2) == [2, 1]
    assert thread_ladder(12) == [12, 6, 3, 1]


def test_busy_seconds_sums_the_busy_times_of_the_given_cpus(tmp_path: Path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 1 10 500 7 2 3 4 0 0\n"
                    "cpu1 200 0 20 400 0 0 0 0 0 0\n"
                    "cpu2 1000 0 0 0 0 0 0 0 0 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds([0, 1], stat) == pytest.approx((100 + 1 + 10 + 2 + 3 + 4 + 200 + 20) / tick)
    assert busy_seconds([3], stat) is None  # a CPU it does not list
    assert busy_seconds([0], tmp_path / "missing") is None


class FakeHost:
    """A clock, the busy seconds of the CPUs and this process's CPU seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0
        self.applied: list[int] = []

    def advance(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy += (own_cpus + other_cpus) * seconds

    def governor(self, ladder: list[int], cpus: int) -> ThreadGovernor:
        return ThreadGovernor(ladder, list(range(cpus)), clock=lambda: self.now, busy=lambda: self.busy,
                              own=lambda: self.own, apply=self.applied.append)


def test_one_cpu_of_other_load_takes_one_of_two_threads_away_and_its_end_gives_it_back():
    host = FakeHost()
    governor = host.governor([2, 1], cpus=2)
    for _ in range(3):  # quiet: stays at 2
        host.advance(0.6, own_cpus=2.0, other_cpus=0.0)
        governor.after_step()
    assert governor.threads == 2 and host.applied == []
    host.advance(0.6, own_cpus=1.3, other_cpus=0.7)  # a competitor gets its share of the 2 CPUs
    governor.after_step()
    assert governor.threads == 2, "one look is a burst, not a change"
    host.advance(0.6, own_cpus=1.3, other_cpus=0.7)
    governor.after_step()
    assert governor.threads == 1 and host.applied == [1]
    for _ in range(3):  # the competitor keeps its whole CPU: one thread is right
        host.advance(0.6, own_cpus=1.0, other_cpus=1.0)
        governor.after_step()
    assert host.applied == [1]
    for _ in range(2):  # it left
        host.advance(0.6, own_cpus=1.0, other_cpus=0.05)
        governor.after_step()
    assert governor.threads == 2 and host.applied == [1, 2]


def test_a_look_waits_for_its_period_and_a_burst_between_agreeing_looks_resets_them():
    host = FakeHost()
    governor = host.governor([4, 2, 1], cpus=4)
    host.advance(0.1, own_cpus=2.0, other_cpus=2.0)
    governor.after_step()  # before the period: no look
    assert governor._pending is None
    host.advance(0.6, own_cpus=2.0, other_cpus=2.0)
    governor.after_step()
    host.advance(0.6, own_cpus=4.0, other_cpus=0.0)  # quiet again: the pending change is dropped
    governor.after_step()
    host.advance(0.6, own_cpus=2.0, other_cpus=2.0)
    governor.after_step()
    assert host.applied == []
    host.advance(0.6, own_cpus=2.0, other_cpus=2.0)
    governor.after_step()
    assert host.applied == [2]


@pytest.mark.parametrize("other, expected", [(0.0, 8), (0.4, 8), (0.6, 4), (3.0, 4), (4.6, 2), (6.6, 1), (20.0, 1)])
def test_the_count_is_the_largest_of_the_ladder_that_the_cpus_left_hold(other, expected):
    assert FakeHost().governor(thread_ladder(8), cpus=8).count_for(other) == expected


def _run(dataset, run_dir: Path, threads: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Metrics and final weights of the resume tests' run with ``threads`` threads."""
    config = config_for(dataset, run_dir)
    config.train.threads = threads
    train(config)
    return records(run_dir), final_state(run_dir)


def _same(a: tuple[list[dict], dict[str, torch.Tensor]], b: tuple[list[dict], dict[str, torch.Tensor]]) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(a[1][k].equal(b[1][k]) for k in a[1])


def _model(dataset, tmp_path: Path):
    return build_model(dataset, config_for(dataset, tmp_path / "unused"))


@TWO_THREADS
def test_the_dense_check_agrees_with_training_at_each_count(criteo_dataset, tmp_path, restore_threads):
    """What :func:`dense_thread_invariant` says of the model is what training it with two
    threads and with one does."""
    two, one = (_run(criteo_dataset, tmp_path / f"run-{t}", t) for t in (2, 1))
    assert dense_thread_invariant(_model(criteo_dataset, tmp_path), (128,), (500,), [2, 1]) == _same(two, one)


@TWO_THREADS
def test_a_count_changed_mid_run_trains_the_same_model(criteo_dataset, tmp_path, monkeypatch, caplog,
                                                        restore_threads):
    """With other processes taking 1.5 of the 2 CPUs, the default count drops to one thread
    during the run; the run ends as one that kept two threads, bit for bit."""
    if not dense_thread_invariant(_model(criteo_dataset, tmp_path), (128,), (500,), [2, 1]):
        pytest.skip("torch's dense layers give different bits with one thread on this machine: the count stays fixed")
    fixed = _run(criteo_dataset, tmp_path / "fixed", 2)
    monkeypatch.setattr(thread_governor, "PERIOD_S", 0.0)
    monkeypatch.setattr(thread_governor, "busy_seconds", lambda cpus: own_cpu_seconds() + 1.5 * time.monotonic())
    with caplog.at_level(logging.INFO, logger=thread_governor.__name__):
        governed = _run(criteo_dataset, tmp_path / "governed", 0)
    assert "training threads 2 -> 1" in caplog.text and torch.get_num_threads() == 1
    assert _same(governed, fixed)
