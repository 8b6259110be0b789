"""Interleaved timing of competing implementations."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_round_rates(
    candidates: dict[str, Callable[[int], int]], steps: int, rounds: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Items per second of each candidate in each of ``rounds`` rounds, in round order.

    ``candidates[name](i)`` runs step ``i`` and returns the items it processed. Each round
    runs ``steps`` steps of every candidate, one candidate after the other, so that drift of
    the machine hits all of them alike, and the candidates' rates in one round were measured
    seconds apart (their per-round ratios show how far the machine moved the comparison).
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
    return rates


def interleaved_rates(
    candidates: dict[str, Callable[[int], int]], steps: int, rounds: int, warmup: int = 2
) -> dict[str, float]:
    """Items per second of each candidate, the median over the rounds of
    :func:`interleaved_round_rates`."""
    return medians(interleaved_round_rates(candidates, steps, rounds, warmup))


def medians(by_round: dict[str, list[float]]) -> dict[str, float]:
    """Each candidate's median over its rounds."""
    return {name: statistics.median(values) for name, values in by_round.items()}
