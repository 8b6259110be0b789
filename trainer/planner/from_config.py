"""Planner inputs from a training config and its dataset."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch.distributed as dist

from neorec.common.errors import ConfigError
from neorec.ingest.partitions import PARTITIONS, PartitionError, first_ready, partition_view
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.schema import Dataset
from neorec.trainer.run.build import check_dynamic_plan, decode_options, table_configs
from neorec.trainer.config import TrainConfig
from neorec.trainer.device import cuda_devices
from neorec.trainer.distributed import DistributedContext, check_same_local_world
from neorec.trainer.embedding.config import WEIGHT_DTYPES, TableConfig
from neorec.trainer.planner.enumerate import Constraint
from neorec.trainer.planner.inputs import TableSpec, Topology, parse_bytes
from neorec.trainer.planner.planner import PlanResult, plan_tables
from neorec.trainer.sharding.plan import WHOLE_ROW_TYPES, ShardingPlan

POOLING_SAMPLE_ROWS = 4096
"""Rows of the train split read to measure each feature's mean ids per bag."""
STORE_SAMPLE_ROWS = 65536
"""Rows read instead when a table may go to the embedding store: how often each row is
looked up there is what the planner estimates the store cache's hit rate from."""


def topology(config: TrainConfig, world_size: int) -> Topology:
    """``config``'s hardware for ``world_size`` ranks; a :class:`ConfigError` when its
    ``sharding.ranks_per_node`` or ``sharding.group_size`` does not divide them into whole
    nodes or groups."""
    s = config.sharding
    if s.ranks_per_node and world_size % s.ranks_per_node:
        raise ConfigError(f"sharding.ranks_per_node: {world_size} ranks do not split into nodes of "
                          f"{s.ranks_per_node} ranks")
    if s.group_size and world_size % s.group_size:
        raise ConfigError(f"sharding.group_size: {world_size} ranks do not split into table_row_wise groups of "
                          f"{s.group_size} ranks")
    return Topology(
        world_size=world_size, ranks_per_node=s.ranks_per_node, memory_per_rank=parse_bytes(s.memory_per_rank),
        group_size=s.group_size, intra_node_bandwidth=s.intra_node_gbps * 1e9,
        inter_node_bandwidth=s.inter_node_gbps * 1e9, lookup_bandwidth=s.lookup_gbps * 1e9,
        store_fraction=config.embedding_store.cache_fraction,
    )


@dataclass(frozen=True)
class Sample:
    """What the first rows of the train split say about each table's lookups."""

    pooling: dict[str, float]
    """Mean ids per bag of every feature."""
    id_counts: dict[str, tuple[int, ...]]
    """Per table, how often each distinct row was looked up, most frequent first."""


def sampled_split(dataset: Dataset, config: TrainConfig) -> tuple[Dataset, str]:
    """The split lookups are sampled from: the train split; following partitions
    (``data.follow``), the first ready partition in name order (:class:`PartitionError`
    while none is)."""
    if not config.data.follow:
        return dataset, config.data.train_split
    partition = first_ready(dataset.root)
    if partition is None:
        raise PartitionError(f"following partitions: none of {dataset.root / PARTITIONS} is ready yet to sample "
                             f"the tables' lookups from")
    return partition_view(dataset, partition), partition.split


def sample_lookups(dataset: Dataset, config: TrainConfig, rows: int = POOLING_SAMPLE_ROWS) -> Sample:
    """Lookups of the first ``rows`` rows of the train split (:func:`sampled_split`)."""
    dataset, split = sampled_split(dataset, config)
    reader = InProcessReader(dataset, split, decode_options(dataset.schema, config),
                             ReaderConfig(batch_size=rows, remainder="pad", shuffle="none"))
    try:
        batch = next(iter(reader.epoch(0)))
    finally:
        reader.close()
    per_feature = batch.lengths.reshape(len(batch.keys), -1)
    lengths = per_feature[:, : batch.num_valid]
    pooling = {key: float(np.mean(row)) if row.size else 1.0 for key, row in zip(batch.keys, lengths)}
    bounds = np.concatenate([[0], np.cumsum(per_feature.sum(axis=1))])
    ids: dict[str, list[np.ndarray]] = {}
    table_of = {feature.name: feature.table for feature in dataset.schema.sparse}
    for f, key in enumerate(batch.keys):
        ids.setdefault(table_of[key], []).append(batch.values[bounds[f] : bounds[f + 1]])
    counts = {table: tuple(sorted(np.unique(np.concatenate(parts), return_counts=True)[1].tolist(), reverse=True))
              for table, parts in ids.items()}
    return Sample(pooling, counts)


def table_specs(tables: list[TableConfig], config: TrainConfig, sample: Sample) -> list[TableSpec]:
    return [
        TableSpec(t.name, t.num_embeddings, t.embedding_dim, num_features=len(t.feature_names),
                  pooling_factor=max(float(np.mean([sample.pooling[f] for f in t.feature_names])), 1e-3),
                  weight_bytes=WEIGHT_DTYPES[config.model.weight_dtype], optimizer=config.optimizer.sparse,
                  id_counts=sample.id_counts.get(t.name, ()), dynamic=config.model.dynamic.get(t.name))
        for t in tables
    ]


def constraints(config: TrainConfig, world_size: int) -> dict[str, Constraint]:
    """The config's overrides: ``sharding.tables`` (a sharding type; not for one rank,
    which has one place for a table) and ``embedding_store.tables`` (the store, with a
    cache fraction)."""
    out = {name: Constraint.parse(name, text) for name, text in config.sharding.tables.items()} \
        if world_size > 1 else {}
    for name, constraint in out.items():
        if name in config.model.dynamic and constraint.sharding_type not in (None, *WHOLE_ROW_TYPES):
            raise ConfigError(f"sharding.tables.{name}: {name} is a dynamic table, sharded "
                              f"{', '.join(WHOLE_ROW_TYPES)}; not {constraint.sharding_type}")
    for name, fraction in config.embedding_store.tables.items():
        out[name] = replace(out.get(name, Constraint(None)), cache_fraction=fraction)
    return out


def may_use_store(tables: list[TableConfig], config: TrainConfig) -> bool:
    """Whether a single process needs a plan for the store: the config puts tables there,
    or they do not all fit its memory budget; or its dynamic tables' id maps and admission
    sketches, which never go to the store, do not fit it alone (the plan then says so)."""
    if config.embedding_store.tables:
        return True
    weight_bytes = WEIGHT_DTYPES[config.model.weight_dtype]
    specs = [TableSpec(t.name, t.num_embeddings, t.embedding_dim, weight_bytes=weight_bytes,
                       optimizer=config.optimizer.sparse, dynamic=config.model.dynamic.get(t.name)) for t in tables]
    budget = parse_bytes(config.sharding.memory_per_rank)
    if sum(s.index_bytes for s in specs) > budget:
        return True
    return bool(config.embedding_store.cache_fraction) and sum(s.bytes() for s in specs) > budget


def planner_inputs(dataset: Dataset, config: TrainConfig,
                   world_size: int) -> tuple[list[TableSpec], Topology, dict[str, Constraint]]:
    """``config``'s tables, its topology for ``world_size`` ranks and its overrides."""
    config = config.for_world(world_size)
    topo = topology(config, world_size)
    sample = sample_lookups(dataset, config, STORE_SAMPLE_ROWS if topo.store_fraction or config.embedding_store.tables
                            else POOLING_SAMPLE_ROWS)
    specs = table_specs(table_configs(dataset.schema, config), config, sample)
    return specs, topo, constraints(config, world_size)


def plan_for_config(dataset: Dataset, config: TrainConfig, world_size: int) -> PlanResult:
    """The plan for ``config``'s tables on ``world_size`` ranks, honouring its overrides."""
    specs, topo, constraints = planner_inputs(dataset, config, world_size)
    return plan_tables(specs, topo, config.train.batch_size, constraints)


def check_before_ranks(dataset: Dataset, config: TrainConfig, world_size: int, ranks_per_node: int) -> None:
    """Refuse, in the command that would start them, what ``world_size`` ranks
    (``ranks_per_node`` a node) would refuse of ``config`` once started: a split the
    dataset lacks, dynamic tables' shards that do not split over the ranks, a plan that
    does not fit or that puts dynamic tables beside store tables; so that the user reads
    one error line, not one a rank and torchrun's report. (A CUDA run's plan is left to
    its ranks: only they know the device.)"""
    if not config.data.follow:
        dataset.files(config.data.train_split)
        dataset.files(config.data.eval_split)
    config = config.for_world(world_size)
    if config.train.device == "cuda" or (config.train.device == "auto" and cuda_devices()):
        return
    if config.data.follow and first_ready(dataset.root) is None:
        return  # the ranks plan once the first partition lands
    plan = plan_for_config(dataset, _with_ranks_per_node(config, ranks_per_node), world_size).plan
    if world_size > 1:
        check_dynamic_plan(plan, config)


def shared_plan(dataset: Dataset, config: TrainConfig, context: DistributedContext) -> ShardingPlan:
    """Rank 0's plan for the job, sent to every rank (so all ranks shard alike even if their
    hosts' arithmetic differed)."""
    holder: list[ShardingPlan | None] = [None]
    if context.is_main:
        holder[0] = plan_for_config(dataset, config, context.world_size).plan
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def job_plan(dataset: Dataset, config: TrainConfig, context: DistributedContext) -> ShardingPlan | None:
    """The plan a run trains with: the ranks' shared plan, or a single process's when it
    may need the embedding store (else None: every table in memory, unsharded).

    The plan is made for the job's real topology: ``sharding.ranks_per_node`` = 0 means
    the ranks per node torchrun started (``LOCAL_WORLD_SIZE``, the same on every node). On
    CUDA the store is not a tier (it trains on the CPU only), so no table goes there.
    """
    config = for_job(config, context)
    if context.distributed:
        return shared_plan(dataset, config, context)
    if may_use_store(table_configs(dataset.schema, config), config):
        return plan_for_config(dataset, config, 1).plan
    return None


def for_job(config: TrainConfig, context: DistributedContext) -> TrainConfig:
    """``config`` with the topology and store settings of the job ``context`` runs in."""
    if context.device.type == "cuda":
        if config.embedding_store.tables:
            raise ConfigError("embedding_store.tables: store-backed tables train on the CPU only; this run is on "
                              f"{context.device} (set train.device = 'cpu' or keep every table in device memory)")
        config = replace(config, embedding_store=replace(config.embedding_store, cache_fraction=0.0))
    if context.distributed and not config.sharding.ranks_per_node:
        check_same_local_world(context)
        config = _with_ranks_per_node(config, context.local_world_size)
    return config


def _with_ranks_per_node(config: TrainConfig, ranks_per_node: int) -> TrainConfig:
    """``config`` planned for ``ranks_per_node`` ranks a node where it leaves that to the job (0)."""
    if config.sharding.ranks_per_node:
        return config
    return replace(config, sharding=replace(config.sharding, ranks_per_node=ranks_per_node))
