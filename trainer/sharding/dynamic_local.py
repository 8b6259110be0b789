"""Dynamic tables in a sharded collection: a rank owns whole map shards of each dynamic
table (:mod:`~neorec.trainer.embedding.dynamic.shards`) and maps their raw ids to rows of
its local module, at the step; their counters and checkpoint state travel between ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings, as_arrays, as_tensors
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.sharding.layout import ShardedLayout

COUNTERS = ("admitted", "rejected", "evicted", "live")


def with_map_shards(local: nn.Module, layout: ShardedLayout, dynamic: dict[str, DynamicTableConfig],
                    seed: int) -> nn.Module:
    """``local`` (a rank's module over its shards) behind the map shards whose row blocks
    its dynamic tables' shards hold (a :class:`DynamicEmbeddings`); ``local`` itself when
    it holds no dynamic table. The plan must keep every map shard's block on one rank."""
    maps: list[DynamicTable] = []
    pieces: dict[str, tuple[str, int]] = {}
    for piece in layout.local_shards:
        table = layout.tables[piece.table]
        config = dynamic.get(table.name)
        if config is None:
            continue
        first, count = piece.shard.row_offset // config.block_rows, piece.shard.rows // config.block_rows
        maps += [DynamicTable(table.name, piece.table, table.embedding_dim, config, s)
                 for s in range(first, first + count)]
        pieces[table.name] = (piece.config.name, piece.shard.row_offset)
    return DynamicEmbeddings(local, maps, seed, pieces) if maps else local


def summed_counters(local: nn.Module | None, names: list[str], group: dist.ProcessGroup | None
                    ) -> dict[str, dict[str, int]]:
    """Per dynamic table of ``names``, its counters summed over the map shards of every rank
    (a collective: every rank calls it; ``local``: this rank's local module)."""
    mine = local.counters() if isinstance(local, DynamicEmbeddings) else {}
    totals = torch.tensor([[mine.get(name, {}).get(key, 0) for key in COUNTERS] for name in names],
                          dtype=torch.int64)
    dist.all_reduce(totals, group=group)
    return {name: dict(zip(COUNTERS, map(int, row))) for name, row in zip(names, totals.tolist())}


def gathered_state(local: nn.Module | None, full: bool, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """The :meth:`DynamicEmbeddings.dynamic_state` of every rank's map shards, merged on the
    group's rank 0 (a collective: every rank calls it; the others get nothing)."""
    mine = as_arrays(local.dynamic_state(full)) if isinstance(local, DynamicEmbeddings) else {}
    first = dist.get_rank(group) == 0
    everyone: list[dict[str, Any] | None] | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(mine, everyone, group=group, group_dst=0)  # (numpy: tensors on numpy memory do not pickle)
    return as_tensors({key: state for states in everyone for key, state in states.items()}) if first else {}
