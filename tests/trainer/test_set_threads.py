"""The default thread count follows the CPUs a process may use, shared by its host's ranks."""

from __future__ import annotations

import numba
import pyarrow as pa
import pytest
import torch

from neorec.trainer.run import step
from neorec.trainer.run.step import set_threads


@pytest.mark.parametrize("available, ranks, expected", [(1, 1, 1), (2, 2, 1), (64, 1, None), (1, 4, 1)])
def test_default_is_the_available_cpus_over_the_ranks(monkeypatch, restore_threads, available, ranks, expected):
    monkeypatch.setattr(step, "available_cpus", lambda: available)
    pool = numba.config.NUMBA_NUM_THREADS
    expected = pool if expected is None else expected  # never more than Numba's pool
    assert set_threads(0, ranks) == expected
    assert torch.get_num_threads() == numba.get_num_threads() == pa.cpu_count() == expected


def test_an_explicit_count_ignores_the_available_cpus(monkeypatch, restore_threads):
    monkeypatch.setattr(step, "available_cpus", lambda: 1)
    assert set_threads(numba.config.NUMBA_NUM_THREADS) == numba.config.NUMBA_NUM_THREADS
