"""Why a table does not fit, in words, with what would make it fit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from neorec.trainer.planner.inputs import TableSpec, Topology, format_bytes


def explain_unplaceable(table: TableSpec, topology: Topology, free_memory: np.ndarray,
                        constrained_to: str | None, placed_bytes: float) -> str:
    """A sentence for :class:`~neorec.trainer.sharding.plan.PlanError`: what ``table`` needs, what
    the ranks have left (``free_memory`` bytes per rank, after ``placed_bytes`` of other
    tables), and the changes that would fit it."""
    world = topology.world_size
    whole = table.bytes()
    row_wise = -(-table.rows // world) * table.row_bytes(table.dim) if world > 1 else whole
    most_free = float(free_memory.max())
    least_free = float(free_memory.min())
    text = (f"table {table.name!r} ({table.rows:,} rows x {table.dim}, {format_bytes(whole)} with its "
            f"{table.optimizer} state) does not fit: table-wise it needs {format_bytes(whole)} on one rank, "
            f"and the most free memory on any rank is {format_bytes(most_free)} "
            f"(of {format_bytes(topology.memory_per_rank)}; other tables take {format_bytes(placed_bytes)})")
    if constrained_to:
        text += f"; the config forces it to be {constrained_to}"
    fixes = []
    if world > 1:
        verdict = "which fits" if row_wise <= least_free else "which does not fit either"
        fixes.append(f"row-wise over {world} ranks it needs {format_bytes(row_wise)} per rank, {verdict}")
    if table.weight_bytes == 4:
        half = replace(table, weight_bytes=2).bytes()
        fixes.append(f"fp16 weights make it {format_bytes(half)}")
    need = min(whole, row_wise) + (topology.memory_per_rank - least_free if row_wise < whole else
                                   topology.memory_per_rank - most_free)
    fixes.append(f"a memory budget of {format_bytes(need)} per rank fits it")
    if topology.store_fraction:
        cached = np.ceil(table.rows * topology.store_fraction) * table.row_bytes(table.dim)
        fixes.append(f"on the embedding store its cache of {topology.store_fraction:.0%} of its rows needs "
                     f"{format_bytes(cached)}: a smaller embedding_store.cache_fraction")
    else:
        fixes.append("or serve it from the embedding store (only hot rows on the trainers: "
                     "embedding_store.cache_fraction)")
    return text + ". Options: " + "; ".join(fixes) + "."


def explain_total(tables: list[TableSpec], topology: Topology) -> str | None:
    """A sentence when all tables together exceed the memory of all ranks (those the
    store may take counted at their cache's size), else ``None``."""
    total = sum(_least_bytes(t, topology) for t in tables)
    capacity = topology.world_size * topology.memory_per_rank
    if total <= capacity:
        return None
    biggest = max(tables, key=lambda t: t.bytes())
    return (f"the {len(tables)} tables need {format_bytes(total)} with optimizer state, but {topology.world_size} "
            f"ranks x {format_bytes(topology.memory_per_rank)} hold {format_bytes(capacity)}; the largest is "
            f"{biggest.name!r} ({format_bytes(biggest.bytes())}). Options: more ranks or memory per rank "
            f"(at least {format_bytes(total / topology.world_size)} each), fp16 weights, or the embedding store.")


def _least_bytes(table: TableSpec, topology: Topology) -> float:
    if not topology.store_fraction:
        return table.bytes()
    return min(table.bytes(), np.ceil(table.rows * topology.store_fraction) * table.row_bytes(table.dim))
