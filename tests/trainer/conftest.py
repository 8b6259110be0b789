"""Fixtures of the trainer's tests."""

from __future__ import annotations

import numba
import pyarrow as pa
import pytest
import torch


@pytest.fixture
def restore_threads():
    """Puts torch's, Numba's and Arrow's thread counts back as they were after the test."""
    before = (torch.get_num_threads(), numba.get_num_threads(), pa.cpu_count())
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])
    pa.set_cpu_count(before[2])
