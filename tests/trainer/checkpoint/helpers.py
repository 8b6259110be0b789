"""A small fused module trained a few steps, and checkpointing it without a training loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.trainer.reference import random_kjt
from neorec.trainer.checkpoint.checkpointer import Checkpointer
from neorec.trainer.config import CheckpointConfig
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection

TABLES = [TableConfig("t0", 300, 8, ("a",)), TableConfig("t1", 1000, 4, ("b", "c"))]


def module(optimizer: str = "rowwise_adagrad", weight_dtype: str = "fp32", seed: int = 0) -> FusedEmbeddingBagCollection:
    return FusedEmbeddingBagCollection(TABLES, SparseOptimizer(optimizer, 0.1), seed=seed, weight_dtype=weight_dtype)


def train_steps(embeddings: FusedEmbeddingBagCollection, steps: int, seed: int, batch: int = 16) -> None:
    """``steps`` updates from random ids and gradients (rows they touch are marked)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        kjt = random_kjt(TABLES, batch, rng)
        out = embeddings(kjt)
        out.backward(torch.from_numpy(rng.normal(0, 1, out.shape).astype(np.float32)))


def tables_info(embeddings: FusedEmbeddingBagCollection) -> dict:
    return {t.name: {"rows": t.num_embeddings, "dim": t.embedding_dim, "storage": embeddings.weight_dtype,
                     "optimizer": embeddings.optimizer.kind, "states": embeddings.optimizer.num_states}
            for t in TABLES}


def checkpointer(root: Path, embeddings: FusedEmbeddingBagCollection, run_config: dict | None = None,
                 **config) -> Checkpointer:
    return Checkpointer(root, CheckpointConfig(**config), rank=0, world_size=1, attempt="test",
                        views=embeddings.shard_views, store=list,
                        local_optimizer_steps=embeddings.local_optimizer_steps, tables=tables_info(embeddings),
                        run_config=run_config or {}, plan=None,
                        sum_over_ranks=lambda v: list(v), commit_timeout_s=10.0)


def state(embeddings: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Copies of the module's flat buffers: ``weights``, ``state1``, ``state2``, ``optimizer_step``."""
    return {k: getattr(embeddings, k).clone() for k in ("weights", "state1", "state2", "optimizer_step")}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
