"""Assign options to ranks: a greedy pass (biggest tables first, each to the option and
ranks that keep the slowest rank fastest; when a table fits nowhere, tables already placed
in memory move to the embedding store, those freeing the most memory per second they add
first, until it fits), then a local search that re-places the tables of the slowest rank
while that makes it faster."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from neorec.trainer.planner.enumerate import Option
from neorec.trainer.planner.estimate import ShardCosts

REFINE_ROUNDS_PER_TABLE = 2
"""Local-search rounds allowed per table (each round moves one table off the slowest rank)."""


@dataclass(frozen=True)
class Candidate:
    """An option for a table with its estimated shard costs."""

    option: Option
    costs: ShardCosts

    @cached_property
    def total_seconds(self) -> float:
        return float(self.costs.seconds.sum())


@dataclass(frozen=True)
class Placement:
    """Candidate ``index`` of a table, its shards on ``ranks`` (in shard order)."""

    index: int
    ranks: tuple[int, ...]


class Unplaceable(Exception):
    """Table ``table`` (an index) fits nowhere given what is already placed."""

    def __init__(self, table: int, free_memory: np.ndarray) -> None:
        super().__init__(table)
        self.table = table
        self.free_memory = free_memory


class Assignment:
    """Per-rank loads of a set of placed tables; ``candidates[t]`` are table ``t``'s options."""

    def __init__(self, candidates: list[list[Candidate]], world_size: int, memory_per_rank: float) -> None:
        self.candidates = candidates
        self.world_size = world_size
        self.capacity = float(memory_per_rank)
        self.compute = np.zeros(world_size)
        self.comm = np.zeros(world_size)
        self.memory = np.zeros(world_size)
        self.placements: list[Placement | None] = [None] * len(candidates)
        self._cheapest = np.array([min(c.total_seconds for c in options) for options in candidates])
        self._unplaced_cheapest = float(self._cheapest.sum())

    @property
    def load(self) -> np.ndarray:
        return self.compute + self.comm

    def peak(self) -> float:
        return float(self.load.max())

    # --------------------------------------------------------------------------- search
    def greedy(self, order: list[int]) -> None:
        for t in order:
            placement = self.best(t)
            while placement is None and self._move_one_to_store():
                placement = self.best(t)
            if placement is None:
                raise Unplaceable(t, self.capacity - self.memory)
            self.place(t, placement)

    def _move_one_to_store(self) -> bool:
        """Put one placed in-memory table on the store, on the same ranks: the one whose
        store option frees the most memory per second of step time it adds. False when no
        table can move."""
        best: tuple[float, int, Placement] | None = None
        for u, placement in enumerate(self.placements):
            if placement is None:
                continue
            current = self.candidates[u][placement.index]
            if current.option.cache_fraction is not None:
                continue
            for index, candidate in enumerate(self.candidates[u]):
                option = candidate.option
                if option.cache_fraction is None or replace(option, cache_fraction=None) != current.option:
                    continue
                saved = float(current.costs.memory.sum() - candidate.costs.memory.sum())
                if saved <= 0:
                    continue
                score = (candidate.total_seconds - current.total_seconds) / saved
                if best is None or score < best[0]:
                    best = (score, u, Placement(index, placement.ranks))
        if best is None:
            return False
        _, u, placement = best
        self.remove(u)
        self.place(u, placement)
        return True

    def refine(self) -> int:
        """Move tables off the slowest rank while that lowers the peak; returns the moves."""
        moves = 0
        for _ in range(REFINE_ROUNDS_PER_TABLE * len(self.candidates)):
            if not self._improve_once():
                break
            moves += 1
        return moves

    def _improve_once(self) -> bool:
        load = self.load
        slowest = int(np.argmax(load))
        peak = float(load[slowest])
        on_slowest = []
        for t, placement in enumerate(self.placements):
            if placement is not None and slowest in placement.ranks:
                costs = self.candidates[t][placement.index].costs.seconds
                on_slowest.append((-float(costs[placement.ranks.index(slowest)]), t))
        for _, t in sorted(on_slowest):
            old = self.placements[t]
            self.remove(t)
            new = self.best(t)
            if new is not None and new != old:
                self.place(t, new)
                if self.peak() < peak * (1 - 1e-9):
                    return True
                self.remove(t)
            self.place(t, old)
        return False

    def best(self, t: int) -> Placement | None:
        """The placement of table ``t`` that minimises a lower bound on the final slowest
        rank, then the cost it adds; ``None`` if no option fits in memory.

        The bound is the larger of the peak after placing ``t`` and the mean load once every
        table is placed (the tables not placed yet counted at their cheapest option), so a
        table takes more ranks only where that pays for its extra total cost.
        """
        load = self.load
        peak = float(load.max())
        others = float(load.sum()) + self._unplaced_cheapest - self._cheapest[t]  # t is not placed
        free = self.capacity - self.memory
        best: tuple[float, float] | None = None
        chosen: Placement | None = None
        for index, candidate in enumerate(self.candidates[t]):
            seconds, memory = candidate.costs.seconds, candidate.costs.memory
            ranks = candidate.option.ranks or _least_loaded(load, free, seconds, memory)
            if ranks is None:
                continue
            index_array = np.asarray(ranks)
            if (free[index_array] < memory).any():
                continue
            new_peak = max(peak, float((load[index_array] + seconds).max()))
            added = candidate.total_seconds
            score = (max(new_peak, (others + added) / self.world_size), added)
            if best is None or score < best:
                best, chosen = score, Placement(index, tuple(ranks))
        return chosen

    # ----------------------------------------------------------------------- bookkeeping
    def place(self, t: int, placement: Placement) -> None:
        self._apply(t, placement, 1.0)
        self.placements[t] = placement
        self._unplaced_cheapest -= self._cheapest[t]

    def remove(self, t: int) -> None:
        placement = self.placements[t]
        self._apply(t, placement, -1.0)
        self.placements[t] = None
        self._unplaced_cheapest += self._cheapest[t]

    def _apply(self, t: int, placement: Placement, sign: float) -> None:
        costs = self.candidates[t][placement.index].costs
        ranks = list(placement.ranks)
        np.add.at(self.compute, ranks, sign * costs.compute)
        np.add.at(self.comm, ranks, sign * costs.comm)
        np.add.at(self.memory, ranks, sign * costs.memory)


def _least_loaded(load: np.ndarray, free: np.ndarray, seconds: np.ndarray, memory: np.ndarray) -> tuple[int, ...] | None:
    """Distinct ranks for shards the assigner places: the least loaded ranks with room for
    the largest shard, heaviest shard to the least loaded rank."""
    room = np.flatnonzero(free >= memory.max())
    if room.size < seconds.size:
        return None
    by_load = room[np.argsort(load[room], kind="stable")][: seconds.size]
    ranks = np.empty(seconds.size, dtype=np.int64)
    ranks[np.argsort(-seconds, kind="stable")] = by_load
    return tuple(int(r) for r in ranks)
