"""Where every piece of a sharded embedding collection lives and travels, derived from the
plan alone (so every rank derives the same layout).

A *slot* is one feature of one shard: the ids one rank sends the shard's rank for that
feature, and the pooled block that comes back. Slots are ordered by destination rank, then
(on each rank) sharded shards before replicated (data-parallel) ones, then table, shard and
feature order. A rank's local fused module holds its shards in that order, so its output
columns are its slots' blocks in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from neorec.trainer.embedding.config import TableConfig
from neorec.common.offsets import exclusive_cumsum
from neorec.trainer.sharding.plan import DATA_PARALLEL, ROW_SPLIT_TYPES, Shard, ShardingPlan


@dataclass(frozen=True)
class Slot:
    table: int
    shard: int
    feature: int
    """Index of the feature in the collection's feature order."""
    rank: int
    cols: int
    replicated: bool


@dataclass(frozen=True)
class LocalShard:
    """A shard this rank holds: rows/columns of table ``table`` (an index), as the local
    fused module's table ``config``."""

    table: int
    shard: Shard
    config: TableConfig


class ShardedLayout:
    """The slots, this rank's shards, and the index maps of the input and output
    distribution, for ``tables`` sharded as ``plan`` on rank ``rank``; ``map_shards``: the
    dynamic tables' map shards (each a block of whole rows on one rank), by table name."""

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, rank: int,
                 map_shards: dict[str, int] | None = None) -> None:
        plan.validate({t.name: (t.num_embeddings, t.embedding_dim) for t in tables})
        self.tables = tables
        self.map_shards = dict(map_shards or {})
        self.world_size = plan.world_size
        self.rank = rank
        self.shardings = [plan.of(t.name) for t in tables]
        self.feature_names = tuple(f for t in tables for f in t.feature_names)
        self.feature_table = [t for t, table in enumerate(tables) for _ in table.feature_names]
        self.feature_rows = [tables[t].num_embeddings for t in self.feature_table]
        feature_index = {f: i for i, f in enumerate(self.feature_names)}

        slots: list[Slot] = []
        self.local_shards: list[LocalShard] = []
        self.slots_per_rank = np.zeros(self.world_size, dtype=np.int64)
        self.sharded_cols = np.zeros(self.world_size, dtype=np.int64)
        for dest in range(self.world_size):
            for replicated in (False, True):
                for t, (table, sharding) in enumerate(zip(tables, self.shardings)):
                    if (sharding.sharding_type == DATA_PARALLEL) != replicated:
                        continue
                    for k, shard in enumerate(sharding.shards):
                        if shard.rank != dest:
                            continue
                        names = []
                        for feature in table.feature_names:
                            slots.append(Slot(t, k, feature_index[feature], dest, shard.cols,
                                              replicated))
                            names.append(f"{feature}@{k}")
                            self.slots_per_rank[dest] += 1
                            if not replicated:
                                self.sharded_cols[dest] += shard.cols
                        if dest == rank:
                            row_split = sharding.sharding_type in ROW_SPLIT_TYPES
                            config = TableConfig(
                                name=f"{table.name}@{k}", num_embeddings=shard.rows, embedding_dim=shard.cols,
                                feature_names=tuple(names), pooling="sum" if row_split else table.pooling,
                                learning_rate=table.learning_rate,
                            )
                            self.local_shards.append(LocalShard(t, shard, config))
        self.slots = slots
        self._build_input_index()
        self._build_output_index()

    @property
    def local_feature_names(self) -> tuple[str, ...]:
        return tuple(f for s in self.local_shards for f in s.config.feature_names)

    # ---------------------------------------------------------------- input distribution
    def _build_input_index(self) -> None:
        """Units and routes for :func:`neorec.trainer.embedding.kernels.routing.route_ids`: a row-split
        table's feature is one unit routed over all its shards by row; other tables'
        features give one unit per shard, which every id goes to."""
        slot_of = {(s.table, s.shard, s.feature): i for i, s in enumerate(self.slots)}
        unit_feature, unit_routes, route_rows, route_slot = [], [0], [], []
        for f, t in enumerate(self.feature_table):
            sharding = self.shardings[t]
            row_split = sharding.sharding_type in ROW_SPLIT_TYPES
            shards = range(len(sharding.shards))
            for group in ([list(shards)] if row_split else [[k] for k in shards]):
                unit_feature.append(f)
                for k in group:
                    route_rows.append(sharding.shards[k].row_offset if row_split else 0)
                    route_slot.append(slot_of[(t, k, f)])
                unit_routes.append(len(route_rows))
        self.unit_feature = np.array(unit_feature, dtype=np.int64)
        self.unit_rows = np.array([self.feature_rows[f] for f in unit_feature], dtype=np.int64)
        self.unit_routes = np.array(unit_routes, dtype=np.int64)
        self.unit_shards = np.array([self.map_shards.get(self.tables[self.feature_table[f]].name, 0)
                                     for f in unit_feature], dtype=np.int64)
        self.route_rows = np.array(route_rows, dtype=np.int64)
        self.route_slot = np.array(route_slot, dtype=np.int64)

    # --------------------------------------------------------------- output distribution
    def _build_output_index(self) -> None:
        """Columns of the assembled output ``[B, sum of feature dims]`` (features in
        collection order) as columns of ``[received sharded blocks | local replicated
        blocks]``: ``primary[j]`` is the first contributor of output column ``j``, each
        ``(out_cols, src_cols)`` of ``extra`` adds another row-split shard's partial sum."""
        received_start = {}
        column = 0
        for i, s in enumerate(self.slots):
            if not s.replicated:
                received_start[i] = column
                column += s.cols
        for i, s in enumerate(self.slots):
            if s.replicated and s.rank == self.rank:
                received_start[i] = column
                column += s.cols
        dims = [self.tables[t].embedding_dim for t in self.feature_table]
        out_start = exclusive_cumsum(np.array(dims, dtype=np.int64))
        self.output_dim = int(sum(dims))
        primary = np.full(self.output_dim, -1, dtype=np.int64)
        extra: list[tuple[list[int], list[int]]] = []
        self.mean_row_split: list[tuple[int, int, int]] = []
        for i, s in enumerate(self.slots):
            if i not in received_start:
                continue
            sharding = self.shardings[s.table]
            k = s.shard
            col_offset = sharding.shards[k].col_offset
            out_cols = out_start[s.feature] + col_offset + np.arange(s.cols)
            src_cols = received_start[i] + np.arange(s.cols)
            level = k if sharding.sharding_type in ROW_SPLIT_TYPES else 0
            if level == 0:
                primary[out_cols] = src_cols
            else:
                while len(extra) < level:
                    extra.append(([], []))
                extra[level - 1][0].extend(out_cols.tolist())
                extra[level - 1][1].extend(src_cols.tolist())
            if level == 0 and sharding.sharding_type in ROW_SPLIT_TYPES and self.tables[s.table].pooling == "mean":
                self.mean_row_split.append((int(out_start[s.feature]), int(dims[s.feature]), s.feature))
        if (primary < 0).any():
            raise AssertionError("an output column has no source")
        self.primary = torch.from_numpy(primary)
        self.extra = [(torch.tensor(o, dtype=torch.int64), torch.tensor(c, dtype=torch.int64)) for o, c in extra]
