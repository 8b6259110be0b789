"""Interleaved timing of competing implementations."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_rates(
    candidates: dict[str, Callable[[int], int]], steps: int, rounds: int, warmup: int = 2
) -> dict[str, float]:
    """Items per second of each candidate, the median over ``rounds``.

    ``candidates[name](i)`` runs step ``i`` and returns the items it processed. Rounds
    alternate between candidates so that drift of the machine hits all of them alike.
    """
    for run in candidates.values():
        for i in range(warmup):
            run(i)
    rates: dict[str, list[float]] = {name: [] for name in candidates}
    for r in range(rounds):
        for name, run in candidates.items():
            started = time.perf_counter()
            items = sum(run(warmup + r * steps + i) for i in range(steps))
            rates[name].append(items / (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in rates.items()}
