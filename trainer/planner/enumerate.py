"""Every way a table may be sharded on a topology, as shard shapes (ranks chosen later)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from neorec.trainer.planner.inputs import TableSpec, Topology
from neorec.trainer.sharding.plan import (COLUMN_WISE, DATA_PARALLEL, ROW_WISE, SHARDING_TYPES, STORE_TYPES,
                                   TABLE_ROW_WISE, TABLE_WISE, WHOLE_ROW_TYPES, PlanError, split_evenly)

MIN_COLUMN_SHARD = 4
"""Narrowest column shard considered (narrower ones cost more in per-row overhead than
they save)."""


class ShardShape(NamedTuple):
    """Rows and columns of a table one shard holds."""

    row_offset: int
    rows: int
    col_offset: int
    cols: int


@dataclass(frozen=True)
class Option:
    """A way to shard a table: its shard shapes, and either the ranks they go to
    (``ranks``) or ``None`` when the assigner picks distinct ranks for them."""

    sharding_type: str
    shapes: tuple[ShardShape, ...]
    ranks: tuple[int, ...] | None = None
    cache_fraction: float | None = None
    """None: in memory; else on the store, this fraction of each shard's rows cached."""


@dataclass(frozen=True)
class Constraint:
    """A user's override for one table: a sharding type and optionally its argument (the
    rank of ``table_wise``, the shard count of ``column_wise``, the group of
    ``table_row_wise``), and/or its tier (``cache_fraction``: on the store)."""

    sharding_type: str | None
    argument: int | None = None
    cache_fraction: float | None = None

    @classmethod
    def parse(cls, table: str, text: str) -> "Constraint":
        """``"row_wise"``, ``"table_wise:3"``, ``"column_wise:2"``, ``"table_row_wise:1"``."""
        kind, _, arg = text.partition(":")
        if kind not in SHARDING_TYPES:
            raise PlanError(f"table {table!r}: unknown sharding type {kind!r}; known: {', '.join(SHARDING_TYPES)}")
        if arg and kind in (ROW_WISE, DATA_PARALLEL):
            raise PlanError(f"table {table!r}: {kind} takes no argument, got {text!r}")
        if arg and not arg.isdigit():
            raise PlanError(f"table {table!r}: the argument of {kind} must be a number, got {text!r}")
        return cls(kind, int(arg) if arg else None)


def enumerate_options(table: TableSpec, topology: Topology, constraint: Constraint | None = None) -> list[Option]:
    """All options for ``table`` (only those ``constraint`` allows), in a fixed order."""
    world = topology.world_size
    whole = ShardShape(0, table.rows, 0, table.dim)
    options = [Option(TABLE_WISE, (whole,))]
    if world > 1:
        if table.rows >= world:
            options.append(Option(ROW_WISE, _row_shapes(table, world), tuple(range(world))))
        k = 2
        while k <= world and table.dim % k == 0 and table.dim // k >= MIN_COLUMN_SHARD:
            shapes = tuple(ShardShape(0, table.rows, off, size) for off, size in split_evenly(table.dim, k))
            options.append(Option(COLUMN_WISE, shapes))
            k *= 2
        if 1 < topology.group_size < world and table.rows >= topology.group_size:
            group_shapes = _row_shapes(table, topology.group_size)
            options.extend(Option(TABLE_ROW_WISE, group_shapes, group) for group in topology.groups())
        options.append(Option(DATA_PARALLEL, (whole,) * world, tuple(range(world))))
    if table.dynamic is not None:
        options = [o for o in options if dynamic_allows(table, o)]
    if topology.store_fraction:
        options += [replace(o, cache_fraction=topology.store_fraction) for o in options
                     if o.sharding_type in STORE_TYPES]
    if constraint is None:
        return options
    if constraint.cache_fraction is not None:
        options = [replace(o, cache_fraction=constraint.cache_fraction) for o in options
                   if o.sharding_type in STORE_TYPES and o.cache_fraction is None]
    if constraint.sharding_type is None:
        return options
    return _constrained(table, topology, options, constraint)


def dynamic_allows(table: TableSpec, option: Option) -> bool:
    """Whether a dynamic table may be sharded as ``option``: whole rows per shard, each
    dynamic map shard's block of rows on one rank."""
    return option.sharding_type in WHOLE_ROW_TYPES and table.dynamic.keeps_map_shards_whole(option.shapes)


def _constrained(table: TableSpec, topology: Topology, options: list[Option], c: Constraint) -> list[Option]:
    kind, arg = c.sharding_type, c.argument
    if kind == TABLE_WISE and arg is not None:
        if not 0 <= arg < topology.world_size:
            raise PlanError(f"table {table.name!r}: rank {arg} is outside world size {topology.world_size}")
        return [replace(o, ranks=(arg,)) for o in options if o.sharding_type == TABLE_WISE]
    if kind == TABLE_ROW_WISE and arg is not None:
        groups = topology.groups()
        if not 0 <= arg < len(groups):
            raise PlanError(f"table {table.name!r}: there are {len(groups)} table_row_wise groups, not group {arg}")
        allowed = [o for o in options if o.sharding_type == kind and o.ranks == groups[arg]]
    elif kind == COLUMN_WISE and arg is not None:
        allowed = [o for o in options if o.sharding_type == kind and len(o.shapes) == arg]
    else:
        allowed = [o for o in options if o.sharding_type == kind]
    if not allowed:
        raise PlanError(f"table {table.name!r} ({table.rows} x {table.dim}) cannot be sharded as "
                        f"{kind}{'' if arg is None else f':{arg}'} on {topology.world_size} ranks "
                        f"(group size {topology.group_size}){_why_not(kind, table, topology)}")
    return allowed


def _why_not(kind: str, table: TableSpec, topology: Topology) -> str:
    """Why ``table`` has no option of sharding ``kind`` on ``topology``, where one reason is
    certain: ": ..." (else "")."""
    world, group = topology.world_size, topology.group_size
    if table.dynamic is not None:
        return ""  # its map shards' blocks constrain it too
    if world == 1 and kind != TABLE_WISE:
        return ": one rank holds every table whole"
    if kind == TABLE_ROW_WISE and not 1 < group < world:
        return (f": table_row_wise splits rows within groups of more than one rank, and needs more than one group "
                f"(sharding.group_size, or ranks_per_node: {world} ranks make no groups of {group})")
    if kind in (ROW_WISE, TABLE_ROW_WISE) and table.rows < (world if kind == ROW_WISE else group):
        return ": fewer rows than ranks to split them over"
    if kind == COLUMN_WISE:
        return (f": column shards split the dimension {table.dim} evenly in 2, 4, ... parts of at least "
                f"{MIN_COLUMN_SHARD} columns")
    return ""


def _row_shapes(table: TableSpec, parts: int) -> tuple[ShardShape, ...]:
    return tuple(ShardShape(off, size, 0, table.dim) for off, size in split_evenly(table.rows, parts))
