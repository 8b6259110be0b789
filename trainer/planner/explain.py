"""Why a table does not fit, in words, with what would make it fit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from neorec.trainer.planner.inputs import TableSpec, Topology, format_bytes


def explain_unplaceable(table: TableSpec, topology: Topology, free_memory: np.ndarray,
                        constrained_to: str | None, placed_bytes: float, cache_fraction: float | None = None) -> str:
    """A sentence for :class:`~neorec.trainer.sharding.plan.PlanError`: what ``table`` needs, what
    the ranks have left (``free_memory`` bytes per rank, after ``placed_bytes`` of other
    tables), and the changes that would fit it; ``cache_fraction``: the table's own store
    cache fraction (default: the topology's)."""
    world = topology.world_size
    whole = table.bytes()
    row_wise = -(-table.rows // world) * table.row_bytes(table.dim) if world > 1 else whole
    most_free = float(free_memory.max())
    least_free = float(free_memory.min())
    text = (f"table {table.name!r} ({table.rows:,} rows x {table.dim}, {format_bytes(whole)} with its "
            f"{table.optimizer} state) does not fit: table-wise it needs {format_bytes(whole)} on one rank, "
            f"and the most free memory on any rank is {format_bytes(most_free)} "
            f"(of {format_bytes(topology.memory_per_rank)}; other tables take {format_bytes(placed_bytes)})")
    if table.index_bytes:
        text += f"; its id map and admission sketch take {format_bytes(table.index_bytes)} of that, in memory always"
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
    fraction = cache_fraction if cache_fraction is not None else topology.store_fraction
    if fraction:
        fixes.append(f"on the embedding store its cache of {fraction:.0%} of its rows "
                     f"{'and its id map need' if table.index_bytes else 'needs'} "
                     f"{format_bytes(_on_store_bytes(table, fraction))}: a smaller cache fraction "
                     f"(embedding_store.tables.{table.name} or embedding_store.cache_fraction)")
    else:
        fixes.append("or serve it from the embedding store (only hot rows on the trainers: "
                     "embedding_store.cache_fraction)")
    return text + ". Options: " + "; ".join(fixes) + "."


def explain_total(tables: list[TableSpec], topology: Topology, fractions: dict[str, float] | None = None) -> str | None:
    """A sentence when all tables together exceed the memory of all ranks, else ``None``.
    A table the store may take is counted at its cache's size (and a dynamic table's id
    map): ``fractions`` by table, the topology's for the others."""
    fractions = fractions or {}
    least = {t.name: _least_bytes(t, fractions.get(t.name, topology.store_fraction)) for t in tables}
    total = sum(least.values())
    capacity = topology.world_size * topology.memory_per_rank
    if total <= capacity:
        return None
    biggest = max(tables, key=lambda t: least[t.name])
    what = format_bytes(least[biggest.name]) + (" on the store" if least[biggest.name] < biggest.bytes() else "")
    options = [f"more ranks or memory per rank (at least {format_bytes(total / topology.world_size)} each)",
               "fp16 weights", "the embedding store"]
    if biggest.index_bytes:
        what += f", its id map and admission sketch {format_bytes(biggest.index_bytes)} of that, in memory always"
        options.insert(0, f"a smaller model.dynamic.{biggest.name}.capacity")
    return (f"the {len(tables)} tables need {format_bytes(total)} with optimizer state, but {topology.world_size} "
            f"ranks x {format_bytes(topology.memory_per_rank)} hold {format_bytes(capacity)}; the largest is "
            f"{biggest.name!r} ({what}). Options: {', '.join(options[:-1])} or {options[-1]}.")


def _on_store_bytes(table: TableSpec, fraction: float) -> float:
    """Memory ``table`` takes on the embedding store: its cache of ``fraction`` of its rows
    and a dynamic table's id map and sketch (which stay in memory)."""
    return float(np.ceil(table.rows * fraction) * table.row_bytes(table.dim) + table.index_bytes)


def _least_bytes(table: TableSpec, fraction: float) -> float:
    return min(table.bytes(), _on_store_bytes(table, fraction)) if fraction else table.bytes()
