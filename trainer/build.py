"""Build tables, model and dense optimizer from a :class:`TrainConfig` and a dataset."""

from __future__ import annotations

import torch

from ingest.decoder import DecodeOptions
from ingest.schema import Dataset, DatasetSchema
from trainer.config import TrainConfig
from trainer.embedding_config import SparseOptimizer, TableConfig
from trainer.fused_embedding import FusedEmbeddingBagCollection
from trainer.model import DLRM


def table_configs(schema: DatasetSchema, config: TrainConfig) -> list[TableConfig]:
    """One table per distinct ``table`` of the schema, in first-use order, holding
    ``min(cardinality, model.max_table_rows)`` rows."""
    model = config.model
    features: dict[str, list[str]] = {}
    for feature in schema.sparse:
        features.setdefault(feature.table, []).append(feature.name)
    cardinality = schema.table_cardinalities()
    return [
        TableConfig(
            name=table,
            num_embeddings=min(cardinality[table], model.max_table_rows),
            embedding_dim=model.embedding_dim,
            feature_names=tuple(names),
            pooling=model.pooling,
        )
        for table, names in features.items()
    ]


def decode_options(schema: DatasetSchema, config: TrainConfig) -> DecodeOptions:
    """Decoding that maps every feature's ids into the rows of its table."""
    rows = {t.name: t.num_embeddings for t in table_configs(schema, config)}
    return DecodeOptions(
        table_rows=tuple(rows[f.table] for f in schema.sparse),
        dense_transform=config.data.dense_transform,
        id_mapping=config.data.id_mapping,
    )


def sparse_optimizer(config: TrainConfig) -> SparseOptimizer:
    opt = config.optimizer
    return SparseOptimizer(
        kind=opt.sparse, learning_rate=opt.sparse_lr, eps=opt.sparse_eps, weight_decay=opt.sparse_weight_decay
    )


def build_model(dataset: Dataset, config: TrainConfig) -> DLRM:
    """The DLRM with a fused embedding module over all tables, initialised from the seed."""
    schema = dataset.schema
    seed = config.train.seed
    embeddings = FusedEmbeddingBagCollection(table_configs(schema, config), sparse_optimizer(config), seed=seed)
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
    )


def dense_optimizer(model: DLRM, config: TrainConfig) -> torch.optim.Optimizer:
    params = model.dense_parameters()
    kind, lr = config.optimizer.dense, config.optimizer.dense_lr
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)
