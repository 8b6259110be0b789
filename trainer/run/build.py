"""Build tables, model and dense optimizer from a :class:`TrainConfig` and a dataset."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch

from neorec.common.confine import confined
from neorec.common.errors import ConfigError
from neorec.embedding_store.segments import SegmentTier
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.schema import Dataset, DatasetSchema
from neorec.trainer.config import TrainConfig
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.model import DLRM
from neorec.trainer.run.run_dir import CHECKPOINTS
from neorec.trainer.sharding.plan import WHOLE_ROW_TYPES, ShardingPlan
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, StoreSettings

def table_configs(schema: DatasetSchema, config: TrainConfig) -> list[TableConfig]:
    """One table per distinct ``table`` of the schema, in first-use order, holding
    ``min(cardinality, model.max_table_rows)`` rows (a dynamic table: its slots and, per map
    shard, the default row that ids without a slot read)."""
    model = config.model
    features: dict[str, list[str]] = {}
    for feature in schema.sparse:
        features.setdefault(feature.table, []).append(feature.name)
    check_table_names(schema, config)
    check_dynamic(schema, config)
    cardinality = schema.table_cardinalities()
    return [
        TableConfig(
            name=table,
            num_embeddings=model.dynamic[table].rows if table in model.dynamic
            else min(cardinality[table], model.max_table_rows),
            embedding_dim=model.embedding_dim,
            feature_names=tuple(names),
            pooling=model.pooling,
        )
        for table, names in features.items()
    ]


def check_table_names(schema: DatasetSchema, config: TrainConfig) -> None:
    """:class:`ConfigError` when ``model.dynamic``, ``sharding.tables`` or
    ``embedding_store.tables`` names a table the data does not have: whatever the world
    size, also where the key does not apply (``sharding.tables`` on one rank)."""
    tables = {f.table for f in schema.sparse}
    for key, named in (("model.dynamic", config.model.dynamic), ("sharding.tables", config.sharding.tables),
                       ("embedding_store.tables", config.embedding_store.tables)):
        for name in named:
            if name not in tables:
                raise ConfigError(f"{key}.{name}: the dataset has no table {name!r} "
                                  f"(it has {', '.join(sorted(tables))})")


def check_dynamic(schema: DatasetSchema, config: TrainConfig) -> None:
    """:class:`ConfigError` when a feature of raw 64-bit ids feeds a table that is not
    dynamic."""
    for feature in schema.sparse:
        if feature.raw and feature.table not in config.model.dynamic:
            raise ConfigError(f"model.dynamic: feature {feature.name!r} holds raw 64-bit ids (encoding = \"raw\"); "
                              f"declare its table dynamic: [model.dynamic.{feature.table}] capacity = ROWS")


def check_dynamic_plan(plan: ShardingPlan, config: TrainConfig) -> None:
    """:class:`ConfigError` unless every dynamic table of a sharded run is table-wise,
    row-wise or table-row-wise with each map shard's rows on one rank, and no table is on
    the embedding store."""
    for name, dynamic in config.model.dynamic.items():
        sharding = plan.of(name)
        if sharding.sharding_type not in WHOLE_ROW_TYPES:
            raise ConfigError(f"model.dynamic.{name}: a dynamic table is sharded {', '.join(WHOLE_ROW_TYPES)}; "
                              f"the plan makes it {sharding.sharding_type} (see sharding.tables.{name})")
        if not dynamic.keeps_map_shards_whole(sharding.shards):
            raise ConfigError(f"model.dynamic.{name}.shards: the plan's {len(sharding.shards)} "
                              f"{sharding.sharding_type} shards cut its {dynamic.map_shards} map shards "
                              f"of {dynamic.block_rows} rows; make shards a multiple of the ranks the table is "
                              "split over")
    if config.model.dynamic and plan.on_store():
        raise ConfigError(f"embedding_store.tables: dynamic tables train beside store tables in one process only; "
                          f"with {plan.world_size} ranks keep every table in memory "
                          f"(the plan puts {', '.join(sorted(plan.on_store()))} on the store)")


def decode_options(schema: DatasetSchema, config: TrainConfig) -> DecodeOptions:
    """Decoding that maps every feature's ids into the rows of its table (a dynamic table's
    ids pass unchanged: the trainer maps them)."""
    rows = {t.name: t.num_embeddings for t in table_configs(schema, config)}
    return DecodeOptions(
        table_rows=tuple(rows[f.table] for f in schema.sparse),
        dense_transform=config.data.dense_transform,
        id_mapping=config.data.id_mapping,
        raw_features=tuple(f.name for f in schema.sparse if f.table in config.model.dynamic),
    )


def sparse_optimizer(config: TrainConfig) -> SparseOptimizer:
    opt = config.optimizer
    return SparseOptimizer(
        kind=opt.sparse, learning_rate=opt.sparse_lr, eps=opt.sparse_eps, weight_decay=opt.sparse_weight_decay,
        adagrad_decay=opt.sparse_adagrad_decay,
    )


def store_settings(config: TrainConfig, directory: Path, reset: bool) -> StoreSettings:
    """``config.embedding_store`` resolved: tiers under ``directory`` (or in the store
    service it names, held by the run: its directory as written, made absolute but not
    resolved, so that every rank given the same path names it alike),
    emptied first when ``reset`` (a fresh run)."""
    store = config.embedding_store
    settings = StoreSettings(partial(_segment_tier, directory, store.direct_io, reset), ways=store.ways,
                             policy=store.policy, scratch_rows=store.scratch_rows,
                             batch_size=max(config.train.batch_size, config.train.eval_batch_size))
    if not store.service:
        return settings
    from neorec.embedding_store.client import StoreClient

    client = StoreClient(store.service, tls_ca=config.security.tls_ca, token_file=config.security.token_file)
    try:
        roots = [Path(root) for root in client.status().data_roots]  # a service that cannot serve: refused now
        if config.checkpoint.every_steps or config.checkpoint.final:
            _check_checkpoints_reachable(config, roots)
    except BaseException:
        client.close()
        raise
    return replace(settings, open_tier=partial(client.open_tier, reset=reset, owner=os.path.abspath(config.run.dir)),
                   close=client.close)


def _check_checkpoints_reachable(config: TrainConfig, roots: list[Path]) -> None:
    """A :class:`ConfigError` when the store service's data ``roots`` (resolved, on its host,
    which shares this one's paths) do not hold the run's checkpoint directory, where its
    tables' segments are linked at every checkpoint: found now, not at the first checkpoint
    hours in. No roots: a service too old to tell them."""
    checkpoints = Path(config.run.dir).absolute() / CHECKPOINTS
    if roots and confined(checkpoints, roots) is None:
        raise ConfigError(f"embedding_store.service {config.embedding_store.service}: its data roots "
                          f"({', '.join(map(str, roots))}) do not hold this run's checkpoints ({checkpoints}): start "
                          f"it with --data-root {Path(config.run.dir).absolute()} (neorec launch does), or train "
                          f"without checkpoints")


def _segment_tier(directory: Path, direct_io: bool, reset: bool, key: str, rows: int, row_bytes: int) -> SegmentTier:
    return SegmentTier(directory / key, rows, row_bytes, direct_io=direct_io, reset=reset, store_root=directory)


def build_model(dataset: Dataset, config: TrainConfig, plan: ShardingPlan | None = None,
                table_weights: dict[str, torch.Tensor] | None = None, store: StoreSettings | None = None) -> DLRM:
    """The DLRM with a fused embedding module over all tables (or, given a ``plan`` of more
    than one rank, this rank's :class:`ShardedEmbeddingBagCollection`; given a plan that
    puts tables on the embedding store, ``store`` says where), initialised from the seed:
    the same weights whichever it is. Dynamic tables keep their map shards in this process,
    or, sharded, on the ranks holding their rows (:func:`check_dynamic_plan`).
    ``table_weights``: float32 ``[rows, dim]`` of every table, to start the fused module
    from instead. A model this host cannot allocate (``sharding.memory_per_rank`` promised
    more than it has) is a :class:`ConfigError`."""
    try:
        return _build_model(dataset, config, plan, table_weights, store)
    except (MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "can't allocate memory" not in str(err):  # torch's allocator's words
            raise
        raise ConfigError(f"the model does not fit this host's memory ({' '.join(str(err).split())}): lower "
                          "model.max_table_rows or the dynamic tables' capacity, or shard over more ranks "
                          "(`neorec plan` shows what each table needs; sharding.memory_per_rank is "
                          f"{config.sharding.memory_per_rank})") from None


def _build_model(dataset: Dataset, config: TrainConfig, plan: ShardingPlan | None,
                 table_weights: dict[str, torch.Tensor] | None, store: StoreSettings | None) -> DLRM:
    schema = dataset.schema
    seed = config.train.seed
    config = config.for_world(1 if plan is None else plan.world_size)
    tables = table_configs(schema, config)
    storage = {"weight_dtype": config.model.weight_dtype, "stochastic_rounding": config.model.stochastic_rounding,
               "kernels": config.train.kernels, "bounds_check": config.train.bounds_check}
    on_store = {} if plan is None else plan.on_store()
    if plan is not None and plan.world_size > 1:
        check_dynamic_plan(plan, config)
        embeddings = ShardedEmbeddingBagCollection(
            tables, sparse_optimizer(config), plan, seed=seed,
            timeout=timedelta(seconds=config.train.collective_timeout_s), store=store,
            comm_precision=config.sharding.precision(), dynamic=config.model.dynamic, **storage)
    elif on_store:
        if store is None:
            raise ValueError("the plan puts tables on the embedding store: give the store's settings")
        caches = [store.table(t.name, t.num_embeddings, on_store[t.name], len(t.feature_names))
                  for t in tables if t.name in on_store]
        initial = None if table_weights is None else [table_weights.get(t.name) for t in tables]
        embeddings = StoreBackedEmbeddings(tables, sparse_optimizer(config), caches, store, seed=seed,
                                           initial_weights=initial, **storage)
    else:
        initial = None if table_weights is None else [table_weights[t.name] for t in tables]
        embeddings = FusedEmbeddingBagCollection(tables, sparse_optimizer(config), seed=seed,
                                                 initial_weights=initial, **storage)
    if config.model.dynamic and not isinstance(embeddings, ShardedEmbeddingBagCollection):
        embeddings = DynamicEmbeddings(embeddings, [
            DynamicTable(t.name, i, t.embedding_dim, config.model.dynamic[t.name], shard)
            for i, t in enumerate(tables) if t.name in config.model.dynamic
            for shard in range(config.model.dynamic[t.name].map_shards)], seed)
    if embeddings.feature_names != schema.feature_names:
        raise AssertionError("tables must list the schema's features in schema order")
    return DLRM(
        num_dense=len(schema.dense),
        num_sparse=len(schema.sparse),
        embedding_dim=config.model.embedding_dim,
        bottom_mlp=config.model.bottom_mlp,
        top_mlp=config.model.top_mlp,
        embeddings=embeddings,
        seed=seed,
        init=config.model.init,
    )


def dense_optimizer(model: DLRM, config: TrainConfig) -> torch.optim.Optimizer:
    """The MLPs' optimizer, in torch's fused implementation (one kernel over all parameters:
    much faster than the per-tensor loop for Adam on the demo's MLPs, same results within
    float rounding)."""
    params = model.dense_parameters()
    kind, lr = config.optimizer.dense, config.optimizer.dense_lr
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, fused=True)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, fused=True)
    return torch.optim.Adam(params, lr=lr, fused=True)
