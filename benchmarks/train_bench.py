"""DLRM training QPS: fused embeddings against one ``nn.EmbeddingBag(sparse=True)`` per
table with ``torch.optim.Adagrad``, same model, same initial weights, same batches.

And the anchor model (26 tables x 100k rows x 64, bottom MLP 512-256-64, top 512-512-256-1,
batch 2048, row-wise Adagrad + Adagrad) against its dense-only ceiling: the same DLRM with
the embeddings replaced by a fixed tensor (no lookup, no update; the MLPs, the interaction
and its gradient remain): the fraction of that ceiling the whole step reaches; beside it,
the embeddings' step alone and what they add inside the whole step (:func:`embedding_cost`)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn

from neorec.benchmarks.timing import interleaved_rates, interleaved_round_rates, medians
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer.batch import Batch
from neorec.trainer.run.build import build_model, decode_options, dense_optimizer, table_configs
from neorec.trainer.config import TrainConfig
from neorec.trainer.embedding.config import TableConfig
from neorec.benchmarks.baselines import EmbeddingBagCollectionReference
from neorec.trainer.model import DLRM
from neorec.trainer.run.step import set_threads, train_step


def run(quick: bool = False) -> dict[str, Any]:
    threads = set_threads(0)
    batch_size = 512
    steps, rounds = (5, 2) if quick else (40, 3)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = generate(SynthSpec(rows=20_000 if quick else 120_000), tmp)
        config = TrainConfig.from_dict({
            "data": {"path": tmp},
            "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05, "sparse_eps": 1e-10},
            "train": {"batch_size": batch_size},
        })
        batches = _load_batches(dataset, config)
        fused = build_model(dataset, config)
        fused_opt = dense_optimizer(fused, config)
        baseline, baseline_opt = _baseline_model(dataset, config, fused)
        candidates = {
            "fused": lambda i: _step(fused, [fused_opt], batches[i % len(batches)]),
            "baseline": lambda i: _step(baseline, baseline_opt, batches[i % len(batches)]),
        }
        rates = interleaved_rates(candidates, steps=steps, rounds=rounds)
        difference = _max_table_difference(fused, baseline, table_configs(dataset.schema, config))
    return {
        "benchmark": "train",
        "model": "DLRM criteo profile, 26 tables x dim 16 (<= 200k rows), batch 512, Adagrad",
        "threads": threads,
        "fused_qps": rates["fused"],
        "baseline_qps": rates["baseline"],
        "ratio": rates["fused"] / rates["baseline"],
        "max_table_difference": difference,
        "dense_ceiling": _dense_ceiling(quick),
    }


class FixedPooled(nn.Module):
    """Stands for the embeddings at no cost: the same pooled tensor every step, no lookup,
    no update. It takes its gradient as the fused module does (the interaction's backward
    computes it) and drops it where it is: a leaf parameter would copy it, a slice of the
    interaction's wider gradient, into a ``.grad`` of its own."""

    def __init__(self, batch_size: int, output_dim: int) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(0))  # puts the backward in the graph
        self.register_buffer("pooled", torch.randn(batch_size, output_dim,
                                                   generator=torch.Generator().manual_seed(0)))

    def forward(self, sparse) -> torch.Tensor:
        return _DroppedGradient.apply(self.anchor, self.pooled)


class _DroppedGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return pooled.view_as(pooled)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


CEILING_BATCHES = 64
"""Distinct batches the anchor model's steps cycle over: at least as many as its steps, so
that (as in training) a step's rows are mostly not those the previous steps left in the
caches."""


def _dense_ceiling(quick: bool) -> dict[str, Any]:
    """The anchor model's step against the same step with fixed embeddings. Every table has
    its 100k rows (ids Zipf-distributed over them, as the synthetic data's), and the steps
    take batches they have not taken before."""
    batch_size = 256 if quick else 2048
    steps, rounds = (3, 2) if quick else (20, 5)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = generate(SynthSpec(rows=(8 if quick else CEILING_BATCHES) * batch_size * 5 // 4, id_space=100_000,
                                     row_group_rows=batch_size * 8), tmp)
        config = TrainConfig.from_dict({
            "data": {"path": tmp},
            "model": {"embedding_dim": 64, "max_table_rows": 100_000, "bottom_mlp": [512, 256, 64],
                      "top_mlp": [512, 512, 256, 1]},
            "optimizer": {"sparse": "rowwise_adagrad", "dense": "adagrad"},
            "train": {"batch_size": batch_size},
        })
        batches = _load_batches(dataset, config)
        model = build_model(dataset, config)
        optimizer = dense_optimizer(model, config)
        ceiling = build_model(dataset, config)
        ceiling.embeddings = FixedPooled(batch_size, model.embeddings.output_dim)
        ceiling_opt = dense_optimizer(ceiling, config)
        by_round = interleaved_round_rates({
            "dlrm": lambda i: _step(model, [optimizer], batches[i % len(batches)]),
            "dense_only": lambda i: _step(ceiling, [ceiling_opt], batches[i % len(batches)]),
        }, steps=steps, rounds=rounds)
        # after the two models' rounds, not between them: a third candidate there moves their ratio
        upstream = torch.randn(batch_size, model.embeddings.output_dim, generator=torch.Generator().manual_seed(0))
        alone = interleaved_rates({
            "embeddings": lambda i: _embeddings_step(model, batches[i % len(batches)], upstream),
        }, steps=steps, rounds=rounds)["embeddings"]
    rates = medians(by_round)
    return {"model": "26 x 100k x 64, bottom 512-256-64, top 512-512-256-1, rowwise Adagrad + Adagrad",
            "distinct_batches": len(batches),
            "batch_size": batch_size, "dlrm_qps": rates["dlrm"], "dense_only_qps": rates["dense_only"],
            "fraction_of_ceiling": rates["dlrm"] / rates["dense_only"],
            "fraction_of_ceiling_by_round": [a / b for a, b in zip(by_round["dlrm"], by_round["dense_only"])],
            **embedding_cost(rates["dlrm"], rates["dense_only"], alone, batch_size)}


def embedding_cost(dlrm_qps: float, dense_only_qps: float, embeddings_qps: float, batch_size: int) -> dict[str, float]:
    """What the embeddings cost the anchor step, from the rates (samples/s) of the whole
    step, of the dense-only step and of the embeddings' forward and backward alone:

    - ``embeddings_alone_ms``: their step alone, beside nothing;
    - ``embeddings_in_step_ms``: the whole step's time less the dense-only step's: what they
      add to it (more than alone where they and the MLPs slow each other down, less where
      they overlap);
    - ``fraction_at_standalone_cost``: the fraction of the ceiling a step reaches whose
      embeddings add what they cost alone, ``dense / (dense + alone)``: above it only by
      overlap, below it by interference.
    """
    dense_ms, dlrm_ms, alone_ms = (1e3 * batch_size / qps for qps in (dense_only_qps, dlrm_qps, embeddings_qps))
    return {"embeddings_alone_ms": alone_ms, "embeddings_in_step_ms": dlrm_ms - dense_ms,
            "fraction_at_standalone_cost": dense_ms / (dense_ms + alone_ms)}


def _embeddings_step(model: DLRM, batch: Batch, upstream: torch.Tensor) -> int:
    """The model's embeddings alone on ``batch``: the lookup, and its backward from a fixed
    upstream gradient (float32 ``[B, output_dim]``), which updates the tables."""
    model.embeddings(batch.sparse).backward(upstream)
    return batch.num_valid


def _load_batches(dataset: Dataset, config: TrainConfig) -> list[Batch]:
    reader = InProcessReader(dataset, "train", decode_options(dataset.schema, config),
                             ReaderConfig(batch_size=config.train.batch_size))
    return [Batch.from_host(b) for b in reader.epoch(0)]


def _baseline_model(dataset: Dataset, config: TrainConfig, fused: DLRM) -> tuple[DLRM, list[torch.optim.Optimizer]]:
    tables = table_configs(dataset.schema, config)
    weights = [fused.embeddings.table_weight(t.name).clone() for t in tables]
    model = build_model(dataset, config)
    model.embeddings = EmbeddingBagCollectionReference(tables, weights)  # MLPs: same seed, same init
    sparse = torch.optim.Adagrad(model.embeddings.parameters(), lr=config.optimizer.sparse_lr, eps=1e-10)
    return model, [dense_optimizer(model, config), sparse]


def _max_table_difference(fused: DLRM, baseline: DLRM, tables: list[TableConfig]) -> float:
    """The largest difference between the two sides' embedding weights: both took the same
    steps on the same batches, so they agree when the comparison is fair: to float rounding,
    which Adagrad's first update of a row (about lr * sign(gradient), eps 1e-10) magnifies for
    tiny gradients, against about lr for a side that trained otherwise."""
    return max(float((fused.embeddings.table_weight(t.name) - baseline.embeddings.bags[t.name].weight).abs().max())
               for t in tables)


def _step(model: DLRM, optimizers: list[torch.optim.Optimizer], batch: Batch) -> int:
    for extra in optimizers[1:]:
        extra.zero_grad(set_to_none=True)
    train_step(model, optimizers[0], batch)
    for extra in optimizers[1:]:
        extra.step()
    return batch.num_valid
