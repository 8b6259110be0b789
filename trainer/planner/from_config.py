"""Planner inputs from a training config and its dataset."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from ingest.reader import InProcessReader, ReaderConfig
from ingest.schema import Dataset
from trainer.build import decode_options, table_configs
from trainer.config import TrainConfig
from trainer.distributed import DistributedContext
from trainer.embedding_config import WEIGHT_DTYPES, TableConfig
from trainer.planner.enumerate import Constraint
from trainer.planner.inputs import TableSpec, Topology, parse_bytes
from trainer.planner.planner import PlanResult, plan_tables
from trainer.sharding.plan import ShardingPlan

POOLING_SAMPLE_ROWS = 4096
"""Rows of the train split read to measure each feature's mean ids per bag."""


def topology(config: TrainConfig, world_size: int) -> Topology:
    s = config.sharding
    return Topology(
        world_size=world_size, ranks_per_node=s.ranks_per_node, memory_per_rank=parse_bytes(s.memory_per_rank),
        group_size=s.group_size, intra_node_bandwidth=s.intra_node_gbps * 1e9,
        inter_node_bandwidth=s.inter_node_gbps * 1e9, lookup_bandwidth=s.lookup_gbps * 1e9,
    )


def pooling_factors(dataset: Dataset, config: TrainConfig) -> dict[str, float]:
    """Mean ids per bag of every feature over the first rows of the train split."""
    reader = InProcessReader(dataset, config.data.train_split, decode_options(dataset.schema, config),
                             ReaderConfig(batch_size=POOLING_SAMPLE_ROWS, remainder="pad", shuffle="none"))
    try:
        batch = next(iter(reader.epoch(0)))
    finally:
        reader.close()
    lengths = batch.lengths.reshape(len(batch.keys), -1)[:, : batch.num_valid]
    return {key: float(np.mean(row)) if row.size else 1.0 for key, row in zip(batch.keys, lengths)}


def table_specs(tables: list[TableConfig], config: TrainConfig, pooling: dict[str, float]) -> list[TableSpec]:
    return [
        TableSpec(t.name, t.num_embeddings, t.embedding_dim, num_features=len(t.feature_names),
                  pooling_factor=max(float(np.mean([pooling[f] for f in t.feature_names])), 1e-3),
                  weight_bytes=WEIGHT_DTYPES[config.model.weight_dtype], optimizer=config.optimizer.sparse)
        for t in tables
    ]


def planner_inputs(dataset: Dataset, config: TrainConfig,
                   world_size: int) -> tuple[list[TableSpec], Topology, dict[str, Constraint]]:
    """``config``'s tables, its topology for ``world_size`` ranks and its overrides."""
    specs = table_specs(table_configs(dataset.schema, config), config, pooling_factors(dataset, config))
    constraints = {name: Constraint.parse(name, text) for name, text in config.sharding.tables.items()}
    return specs, topology(config, world_size), constraints


def plan_for_config(dataset: Dataset, config: TrainConfig, world_size: int) -> PlanResult:
    """The plan for ``config``'s tables on ``world_size`` ranks, honouring its overrides."""
    specs, topo, constraints = planner_inputs(dataset, config, world_size)
    return plan_tables(specs, topo, config.train.batch_size, constraints)


def shared_plan(dataset: Dataset, config: TrainConfig, context: DistributedContext) -> ShardingPlan:
    """Rank 0's plan for the job, sent to every rank (so all ranks shard alike even if their
    hosts' arithmetic differed)."""
    holder: list[ShardingPlan | None] = [None]
    if context.is_main:
        holder[0] = plan_for_config(dataset, config, context.world_size).plan
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
