"""The planner's entry points: plan tables on a topology, or place them round-robin (the
baseline a plan is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neorec.trainer.planner.assign import Assignment, Candidate, Placement, Unplaceable
from neorec.trainer.planner.enumerate import Constraint, Option, ShardShape, enumerate_options
from neorec.trainer.planner.estimate import ShardCosts, estimate
from neorec.trainer.planner.explain import explain_total, explain_unplaceable
from neorec.trainer.planner.inputs import TableSpec, Topology
from neorec.trainer.sharding.plan import TABLE_WISE, PlanError, Shard, ShardingPlan, TableSharding


@dataclass(frozen=True)
class PlanResult:
    """A plan with its estimates: per rank ``compute``/``comm`` seconds per step and
    ``memory`` bytes (float64 ``[world_size]``); ``step_seconds`` is the slowest rank's."""

    plan: ShardingPlan
    topology: Topology
    batch_size: int
    compute: np.ndarray
    comm: np.ndarray
    memory: np.ndarray
    refine_moves: int = 0
    tables: tuple[TableSpec, ...] = ()
    """The tables planned, in the plan's order."""

    @property
    def step_seconds(self) -> float:
        return float((self.compute + self.comm).max())


def plan_tables(tables: list[TableSpec], topology: Topology, batch_size: int,
                constraints: dict[str, Constraint] | None = None) -> PlanResult:
    """The plan minimising the slowest rank's estimated step time under the memory limit.

    Raises :class:`PlanError` (explaining which table does not fit where, and what would)
    when there is none.
    """
    constraints = constraints or {}
    _check_names(tables, constraints)
    message = explain_total(tables, topology, {name: c.cache_fraction for name, c in constraints.items()
                                               if c.cache_fraction is not None})
    if message:
        raise PlanError(message)
    candidates = [_candidates(t, topology, batch_size, constraints.get(t.name)) for t in tables]
    assignment = Assignment(candidates, topology.world_size, topology.memory_per_rank)
    largest_first = sorted(range(len(tables)),
                           key=lambda i: (-float(candidates[i][0].costs.seconds.sum()), tables[i].name))
    try:
        assignment.greedy(largest_first)
    except Unplaceable as err:
        table = tables[err.table]
        constraint = constraints.get(table.name)
        raise PlanError(explain_unplaceable(
            table, topology, err.free_memory,
            None if constraint is None else constraint.sharding_type,
            float(assignment.memory.sum()),
            None if constraint is None else constraint.cache_fraction,
        )) from None
    moves = assignment.refine()
    return _result(tables, topology, batch_size, assignment, moves)


def round_robin(tables: list[TableSpec], topology: Topology, batch_size: int) -> PlanResult:
    """Table ``i`` whole on rank ``i mod world_size``, memory ignored: the naive baseline."""
    candidates = []
    for i, table in enumerate(tables):
        option = Option(TABLE_WISE, (ShardShape(0, table.rows, 0, table.dim),), (i % topology.world_size,))
        candidates.append([Candidate(option, estimate(table, option, topology, batch_size))])
    assignment = Assignment(candidates, topology.world_size, float("inf"))
    for i, candidate in enumerate(candidates):
        assignment.place(i, Placement(0, candidate[0].option.ranks))
    return _result(tables, topology, batch_size, assignment, 0)


def _candidates(table: TableSpec, topology: Topology, batch_size: int,
                constraint: Constraint | None) -> list[Candidate]:
    costs: dict[tuple[int, float | None], ShardCosts] = {}  # table_row_wise options share one shapes tuple
    candidates = []
    for option in enumerate_options(table, topology, constraint):
        key = (id(option.shapes), option.cache_fraction)
        if key not in costs:
            costs[key] = estimate(table, option, topology, batch_size)
        candidates.append(Candidate(option, costs[key]))
    return candidates


def _check_names(tables: list[TableSpec], constraints: dict[str, Constraint]) -> None:
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise PlanError(f"table names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    unknown = sorted(set(constraints) - set(names))
    if unknown:
        raise PlanError(f"sharding overrides name tables the model does not have: {', '.join(unknown)}")


def _result(tables: list[TableSpec], topology: Topology, batch_size: int, assignment: Assignment,
            moves: int) -> PlanResult:
    shardings = []
    for table, placement, candidates in zip(tables, assignment.placements, assignment.candidates):
        option = candidates[placement.index].option
        shards = tuple(Shard(rank, s.row_offset, s.rows, s.col_offset, s.cols)
                       for rank, s in zip(placement.ranks, option.shapes))
        shardings.append(TableSharding(table.name, option.sharding_type, shards, option.cache_fraction))
    plan = ShardingPlan(topology.world_size, tuple(shardings))
    plan.validate({t.name: (t.rows, t.dim) for t in tables})
    return PlanResult(plan, topology, batch_size, assignment.compute.copy(), assignment.comm.copy(),
                      assignment.memory.copy(), moves, tuple(tables))
