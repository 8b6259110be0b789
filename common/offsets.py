"""Offsets from counts: the exclusive prefix sum, for numpy arrays and torch tensors alike.

``exclusive_cumsum([3, 1, 2]) == [0, 3, 4]``: where each of a sequence of pieces of those
sizes starts when they are laid end to end (tables in a flat buffer, a slot's ids in a
received all-to-all, a feature's columns in an output).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

Counts = TypeVar("Counts", np.ndarray, torch.Tensor)


def exclusive_cumsum(counts: Counts) -> Counts:
    """1-D ``counts`` → the start of each piece: ``cumsum(counts) - counts``, same type and
    dtype (integers wide enough for the total)."""
    return counts.cumsum(0) - counts
