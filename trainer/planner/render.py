"""A plan as text: per table its sharding and shards, per rank its memory and costs."""

from __future__ import annotations

from typing import Sequence

from neorec.trainer.planner.estimate import miss_rate
from neorec.trainer.planner.inputs import TableSpec, format_bytes
from neorec.trainer.planner.planner import PlanResult


def render(result: PlanResult, baseline: PlanResult | None = None) -> str:
    """The table the ``neorec plan`` command prints."""
    topo = result.topology
    lines = [f"sharding plan: {len(result.plan.tables)} tables on {topo.world_size} ranks "
             f"({topo.ranks_per_node} per node, table_row_wise groups of {topo.group_size}), "
             f"batch {result.batch_size} per rank, {format_bytes(topo.memory_per_rank)} per rank",
             "", f"{'table':<16} {'sharding':<15} {'ranks':<16} {'tier':<28} shards (rows x cols)"]
    specs = {t.name: t for t in result.tables}
    for sharding in result.plan.tables:
        ranks = ",".join(str(r) for r in sharding.ranks)
        shapes = sorted({(s.rows, s.cols) for s in sharding.shards})
        shape_text = ", ".join(f"{rows:,} x {cols}" for rows, cols in shapes)
        if len(sharding.shards) > 1:
            shape_text = f"{len(sharding.shards)} of {shape_text}"
        tier = "memory"
        if sharding.cache_fraction is not None:
            cached = sum(int(s.rows * sharding.cache_fraction) for s in sharding.shards)
            tier = f"store, {cached:,} cached, {miss_rate(specs[sharding.table], sharding.cache_fraction):.0%} miss"
        lines.append(f"{sharding.table:<16} {sharding.sharding_type:<15} {ranks:<16} {tier:<28} {shape_text}")
    lines += dynamic_lines(result.tables)
    lines += ["", f"{'rank':<6} {'memory':>12} {'compute ms':>11} {'comm ms':>9} {'step ms':>9}"]
    for rank in range(topo.world_size):
        compute, comm = result.compute[rank] * 1e3, result.comm[rank] * 1e3
        lines.append(f"{rank:<6} {format_bytes(result.memory[rank]):>12} {compute:>11.3f} {comm:>9.3f} "
                     f"{compute + comm:>9.3f}")
    lines += ["", f"estimated step (slowest rank): {result.step_seconds * 1e3:.3f} ms "
                  f"(the local search moved {result.refine_moves} tables off the slowest rank)"]
    if baseline is not None:
        lines.append(f"round-robin table-wise would take {baseline.step_seconds * 1e3:.3f} ms "
                     f"({baseline.step_seconds / result.step_seconds:.2f}x the plan)")
    return "\n".join(lines)


def dynamic_lines(tables: Sequence[TableSpec]) -> list[str]:
    """How the plan sized the dynamic tables (none: no lines)."""
    dynamic = [t for t in tables if t.dynamic is not None]
    if not dynamic:
        return []
    lines = ["", "dynamic tables (raw 64-bit ids mapped to slots; sized by capacity, not by the ids in the data):"]
    for t in dynamic:
        lines.append(f"  {t.name}: {t.dynamic.describe()}; rows {format_bytes(t.bytes() - t.index_bytes)} "
                     f"+ id map and sketch {format_bytes(t.index_bytes)}")
    return lines
