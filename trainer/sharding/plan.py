"""What a sharding plan says: for every table, how it is cut and which rank holds each piece.

Sharding types:

- ``table_wise``: the whole table on one rank.
- ``row_wise``: rows split into contiguous ranges, one per rank of the world.
- ``column_wise``: the embedding dimension split into equal column ranges on distinct ranks.
- ``table_row_wise``: rows split over the ranks of one group (a node), not the whole world.
- ``data_parallel``: a full replica on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from neorec.common.errors import UserError

TABLE_WISE = "table_wise"
ROW_WISE = "row_wise"
COLUMN_WISE = "column_wise"
TABLE_ROW_WISE = "table_row_wise"
DATA_PARALLEL = "data_parallel"
SHARDING_TYPES = (TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE, DATA_PARALLEL)
ROW_SPLIT_TYPES = (ROW_WISE, TABLE_ROW_WISE)
"""Types whose shards each hold some rows: a bag's pooled sum is the sum of the shards'."""
WHOLE_ROW_TYPES = (TABLE_WISE, *ROW_SPLIT_TYPES)
"""Types whose shards hold whole rows (every column of each): those a dynamic table may
have (each map shard's block of rows on one rank)."""
STORE_TYPES = WHOLE_ROW_TYPES
"""Types whose shards may live on the embedding store (whole rows each)."""


class PlanError(UserError, ValueError):
    """A plan is invalid, or no plan fits; the message says which table and why."""

    lasting = True


@dataclass(frozen=True)
class Shard:
    """Rows ``[row_offset, row_offset + rows)`` and columns ``[col_offset, col_offset + cols)``
    of a table, held by ``rank``."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int


@dataclass(frozen=True)
class TableSharding:
    """How table ``table`` is sharded: its type and its shards in a fixed order (row-split
    tables by row range, column-wise by column range, data-parallel by rank); and its tier:
    in memory (``cache_fraction`` None) or on the embedding store, each shard's rank
    caching that fraction of the shard's rows."""

    table: str
    sharding_type: str
    shards: tuple[Shard, ...]
    cache_fraction: float | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.shards)


@dataclass(frozen=True)
class ShardingPlan:
    """One :class:`TableSharding` per table, for ``world_size`` ranks."""

    world_size: int
    tables: tuple[TableSharding, ...]

    def of(self, table: str) -> TableSharding:
        for sharding in self.tables:
            if sharding.table == table:
                return sharding
        raise KeyError(f"the plan has no table {table!r}")

    def validate(self, table_shapes: dict[str, tuple[int, int]]) -> None:
        """Raise :class:`PlanError` unless every table of ``table_shapes`` (name → rows, dim)
        is placed exactly once and its shards cover it exactly as its type says."""
        placed = [s.table for s in self.tables]
        repeated = sorted({t for t in placed if placed.count(t) > 1})
        if repeated:
            raise PlanError(f"tables placed more than once: {', '.join(repeated)}")
        missing = [t for t in table_shapes if t not in placed]
        if missing:
            raise PlanError(f"tables the plan does not place: {', '.join(missing)}")
        unknown = [t for t in placed if t not in table_shapes]
        if unknown:
            raise PlanError(f"the plan places tables the model does not have: {', '.join(unknown)}")
        for sharding in self.tables:
            _check_cover(sharding, *table_shapes[sharding.table], self.world_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def on_store(self) -> dict[str, float]:
        """The tables on the embedding store, each with its cache fraction."""
        return {t.table: t.cache_fraction for t in self.tables if t.cache_fraction is not None}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "ShardingPlan":
        return cls(
            world_size=int(obj["world_size"]),
            tables=tuple(
                TableSharding(t["table"], t["sharding_type"], tuple(Shard(**s) for s in t["shards"]),
                              t.get("cache_fraction"))
                for t in obj["tables"]
            ),
        )


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(offset, size)`` ranges covering ``[0, total)``; the first
    ``total % parts`` are one longer."""
    base, extra = divmod(total, parts)
    ranges, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        ranges.append((offset, size))
        offset += size
    return ranges


def _check_cover(sharding: TableSharding, rows: int, dim: int, world_size: int) -> None:
    name, kind, shards = sharding.table, sharding.sharding_type, sharding.shards
    if kind not in SHARDING_TYPES:
        raise PlanError(f"table {name!r}: unknown sharding type {kind!r}; known: {', '.join(SHARDING_TYPES)}")
    if sharding.cache_fraction is not None and (kind not in STORE_TYPES or not 0 < sharding.cache_fraction <= 1):
        raise PlanError(f"table {name!r}: a store table is {' or '.join(STORE_TYPES)} with a cache fraction in "
                        f"(0, 1], got {kind} with {sharding.cache_fraction}")
    if not shards:
        raise PlanError(f"table {name!r}: no shards")
    bad_rank = [s.rank for s in shards if not 0 <= s.rank < world_size]
    if bad_rank:
        raise PlanError(f"table {name!r}: rank {bad_rank[0]} is outside world size {world_size}")
    ranks = [s.rank for s in shards]
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"table {name!r}: two shards on one rank ({ranks})")
    if kind in (TABLE_WISE, DATA_PARALLEL):
        whole = all(s.row_offset == 0 and s.rows == rows and s.col_offset == 0 and s.cols == dim for s in shards)
        if not whole or (kind == TABLE_WISE and len(shards) != 1):
            raise PlanError(f"table {name!r}: a {kind} shard must be the whole {rows} x {dim} table"
                            + (" on exactly one rank" if kind == TABLE_WISE else ""))
        if kind == DATA_PARALLEL and sorted(ranks) != list(range(world_size)):
            raise PlanError(f"table {name!r}: a data_parallel table needs a replica on every rank")
        return
    if kind in ROW_SPLIT_TYPES:
        spans, full, along = [(s.row_offset, s.rows) for s in shards], rows, "rows"
        other_ok = all(s.col_offset == 0 and s.cols == dim for s in shards)
    else:
        spans, full, along = [(s.col_offset, s.cols) for s in shards], dim, "columns"
        other_ok = all(s.row_offset == 0 and s.rows == rows for s in shards)
    offset = 0
    for start, size in spans:
        if start != offset or size <= 0:
            other_ok = False
        offset = start + size
    if not other_ok or offset != full:
        raise PlanError(f"table {name!r}: {kind} shards must tile its {full} {along} in order, "
                        f"got {[(s.rank, s.row_offset, s.rows, s.col_offset, s.cols) for s in shards]}")

