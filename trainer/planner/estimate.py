"""The cost model: estimated step time (lookup compute + communication) and memory of each
shard of an option, for the way neorec's sharded module runs it.

Every shard serves the whole global batch ``G = world_size * batch_size``: its rank
receives the ids that fall in it (lengths int32 + ids int64), pools them, sends the pooled
float32 blocks back and receives their gradients (a row-split shard sends a partial sum
for every bag). A data-parallel replica pools the global batch and receives the all-gathered
gradients of its outputs. Lookups read and write the rows and their optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from neorec.trainer.planner.enumerate import Option
from neorec.trainer.planner.inputs import TableSpec, Topology
from neorec.trainer.sharding.plan import DATA_PARALLEL, ROW_SPLIT_TYPES

LOOKUP_PASSES = 3
"""Row traffic per looked-up id: read in the forward, read and written in the update."""
STORE_PASSES = 2
"""Store tier traffic per cache miss: the row read, a row written back."""


@dataclass(frozen=True)
class ShardCosts:
    """Per shard of an option (arrays of the option's shard count): ``compute`` and
    ``comm`` seconds per step, ``memory`` bytes."""

    compute: np.ndarray
    comm: np.ndarray
    memory: np.ndarray

    @cached_property
    def seconds(self) -> np.ndarray:
        return self.compute + self.comm


def estimate(table: TableSpec, option: Option, topology: Topology, batch_size: int) -> ShardCosts:
    """Costs of each shard of ``option`` for ``table`` with ``batch_size`` samples per rank."""
    rows = np.array([s.rows for s in option.shapes], dtype=np.float64)
    cols = np.array([s.cols for s in option.shapes], dtype=np.float64)
    bags = topology.world_size * batch_size * table.num_features
    ids = bags * table.pooling_factor
    shard_ids = ids * rows / table.rows if option.sharding_type in ROW_SPLIT_TYPES else np.full(rows.size, ids)
    row_traffic = cols * table.weight_bytes + 4 * table.state_floats(cols)
    compute = LOOKUP_PASSES * shard_ids * row_traffic / topology.lookup_bandwidth
    outputs = (1 if option.sharding_type == DATA_PARALLEL else 2) * bags * cols * 4
    comm = (bags * 4 + shard_ids * 8 + outputs) * topology.seconds_per_byte()
    memory = rows * table.row_bytes(cols)
    if option.cache_fraction is not None:  # the store: a cache in memory, misses read and written back
        misses = shard_ids * (1.0 - table.hit_rate(option.cache_fraction))
        compute = compute + STORE_PASSES * misses * row_traffic / topology.store_bandwidth
        memory = np.ceil(rows * option.cache_fraction) * table.row_bytes(cols)
    memory = memory + table.index_bytes * rows / table.rows  # a dynamic table's map, beside its rows
    return ShardCosts(compute, comm, memory)


def miss_rate(table: TableSpec, cache_fraction: float) -> float:
    """The share of a store table's lookups the estimate counts as cache misses."""
    return 1.0 - table.hit_rate(cache_fraction)
