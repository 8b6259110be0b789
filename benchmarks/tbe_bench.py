"""Embedding train step (forward, backward through a fixed upstream gradient, optimizer
update): the fused module with row-wise Adagrad against one
``nn.EmbeddingBag(mode="sum", sparse=True)`` per table with ``torch.optim.Adagrad``, on the
same ids, plus a random-gather bound (``torch.index_select`` of as many random rows from a
matrix of the same size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.timing import interleaved_rates
from trainer.batch import KeyedJaggedTensor
from trainer.embedding_config import SparseOptimizer, TableConfig
from benchmarks.baselines import EmbeddingBagCollectionReference
from trainer.fused_embedding import FusedEmbeddingBagCollection
from trainer.train import set_threads


@dataclass(frozen=True)
class TBEConfig:
    name: str
    num_tables: int
    rows: int
    dim: int
    ids_per_bag: int
    batch_size: int


CONFIGS = (
    TBEConfig("criteo-like", 26, 100_000, 64, 1, 4096),
    TBEConfig("multi-hot", 8, 1_000_000, 64, 20, 1024),
)
QUICK_CONFIGS = (
    TBEConfig("criteo-like-quick", 4, 10_000, 64, 1, 1024),
    TBEConfig("multi-hot-quick", 2, 50_000, 64, 20, 256),
)
NUM_BATCHES = 8


def run(quick: bool = False) -> dict[str, Any]:
    threads = set_threads(0)
    steps, rounds = (3, 2) if quick else (10, 3)
    results = [_run_config(c, steps, rounds) for c in (QUICK_CONFIGS if quick else CONFIGS)]
    return {"benchmark": "tbe", "threads": threads, "optimizer": "rowwise_adagrad (ours) vs torch Adagrad",
            "configs": results}


def _zipf_batches(config: TBEConfig, seed: int = 0) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    keys = tuple(f"f{i}" for i in range(config.num_tables))
    ids_per_batch = config.num_tables * config.batch_size * config.ids_per_bag
    lengths = torch.full((config.num_tables * config.batch_size,), config.ids_per_bag, dtype=torch.int32)
    return [KeyedJaggedTensor(keys, lengths, torch.from_numpy(rng.zipf(1.1, ids_per_batch) % config.rows))
            for _ in range(NUM_BATCHES)]


def _run_config(config: TBEConfig, steps: int, rounds: int) -> dict[str, Any]:
    tables = [TableConfig(f"t{i}", config.rows, config.dim, (f"f{i}",)) for i in range(config.num_tables)]
    batches = _zipf_batches(config)
    ids_per_step = int(batches[0].values.numel())
    upstream = torch.randn(config.batch_size, config.num_tables * config.dim,
                           generator=torch.Generator().manual_seed(1))

    fused = FusedEmbeddingBagCollection(tables, SparseOptimizer("rowwise_adagrad", 0.01), seed=0)
    naive = EmbeddingBagCollectionReference(tables, [fused.table_weight(t.name) for t in tables])
    naive_opt = torch.optim.Adagrad(naive.parameters(), lr=0.01)

    def fused_step(i: int) -> int:
        fused(batches[i % NUM_BATCHES]).backward(upstream)
        return config.batch_size

    def naive_step(i: int) -> int:
        naive_opt.zero_grad(set_to_none=True)
        naive(batches[i % NUM_BATCHES]).backward(upstream)
        naive_opt.step()
        return config.batch_size

    matrix = torch.empty(config.num_tables * config.rows, config.dim).uniform_()  # real pages, not the zero page
    random_rows = [torch.randint(0, matrix.shape[0], (ids_per_step,), generator=torch.Generator().manual_seed(i))
                   for i in range(NUM_BATCHES)]

    def gather(i: int) -> int:
        torch.index_select(matrix, 0, random_rows[i % NUM_BATCHES])
        return config.batch_size

    # Phases of our step: the forward alone, and a bare gather of the very rows it reads.
    all_rows = fused.weights.view(-1, config.dim)
    table_of_id = torch.arange(config.num_tables).repeat_interleave(config.batch_size * config.ids_per_bag)
    global_rows = [b.values + table_of_id * config.rows for b in batches]

    def fused_forward(i: int) -> int:
        with torch.no_grad():
            fused(batches[i % NUM_BATCHES])
        return config.batch_size

    def same_rows_gather(i: int) -> int:
        torch.index_select(all_rows, 0, global_rows[i % NUM_BATCHES])
        return config.batch_size

    rates = interleaved_rates({"fused": fused_step, "naive": naive_step, "gather": gather,
                               "fused_forward": fused_forward, "same_rows_gather": same_rows_gather},
                              steps, rounds)
    del naive, naive_opt, matrix
    step_ms = 1e3 / rates["fused"] * config.batch_size
    forward_ms = 1e3 / rates["fused_forward"] * config.batch_size
    return {
        "config": config.__dict__,
        "fused_samples_per_s": rates["fused"],
        "naive_samples_per_s": rates["naive"],
        "fused_ids_per_s": rates["fused"] * ids_per_step / config.batch_size,
        "naive_ids_per_s": rates["naive"] * ids_per_step / config.batch_size,
        "gather_rows_per_s": rates["gather"] * ids_per_step / config.batch_size,
        "ratio_fused_over_naive": rates["fused"] / rates["naive"],
        "fused_fraction_of_gather_bound": rates["fused"] / rates["gather"],
        "fused_step_ms": step_ms,
        "fused_forward_ms": forward_ms,
        "fused_backward_update_ms": step_ms - forward_ms,
        "same_rows_gather_ms": 1e3 / rates["same_rows_gather"] * config.batch_size,
    }
