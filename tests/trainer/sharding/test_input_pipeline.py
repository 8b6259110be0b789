"""The input all-to-alls kept in flight ahead of the step (InputPipeline) deliver what the
synchronous input distribution delivers, in order, and fail every rank on a bad id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.reference import random_kjt
from tests.trainer.sharding.test_sharded_embedding import BATCH, TABLES, plan_of
from tests.trainer.spawn import run_ranks
from neorec.trainer.embedding.config import SparseOptimizer
from neorec.trainer.sharding.input_pipeline import InputPipeline
from neorec.trainer.sharding.plan import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection


def _module(world: int) -> ShardedEmbeddingBagCollection:
    kinds = [TABLE_ROW_WISE if world == 4 else ROW_WISE, COLUMN_WISE, DATA_PARALLEL]
    return ShardedEmbeddingBagCollection(TABLES, SparseOptimizer("sgd", 0.1), plan_of(kinds, world))


def _batches(rank: int, count: int):
    rng = np.random.default_rng(100 + rank)
    return [random_kjt(TABLES, BATCH, rng, weighted=True) for _ in range(count)]


def pipelined_and_synchronous(rank: int, world: int, count: int) -> list[list[tuple[torch.Tensor, ...]]]:
    module = _module(world)
    kjts = _batches(rank, count)
    pipelined = [(label, sparse) for label, sparse in
                 InputPipeline(module)((i, module.prepare(kjt)) for i, kjt in enumerate(kjts))]
    assert [label for label, _ in pipelined] == list(range(count))
    synchronous = []
    for kjt in kjts:
        prepared = module.prepare(kjt)
        synchronous.append((module.input_dist(prepared.routed, module.group), prepared.lengths))
    return [[(s.local.lengths, s.local.values, s.local.weights, s.lengths) for _, s in pipelined],
            [(local.lengths, local.values, local.weights, lengths) for local, lengths in synchronous]]


@pytest.mark.parametrize("world, count", [(2, 1), (2, 2), (2, 5), (4, 4)])
def test_pipelined_distribution_equals_the_synchronous_one(world, count):
    for pipelined, synchronous in run_ranks(pipelined_and_synchronous, world, count):
        assert len(pipelined) == len(synchronous) == count
        for got, want in zip(pipelined, synchronous):
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def bad_id_in_flight(rank: int, world: int) -> str:
    module = _module(world)
    kjts = _batches(rank, 6)
    if rank == 1:
        kjts[3].values[0] = 50  # outside every table
    delivered = 0
    try:
        for _ in InputPipeline(module)((None, module.prepare(kjt)) for kjt in kjts):
            delivered += 1
    except IndexError as err:
        return f"{delivered} delivered; {err}"
    return "no error"


def test_an_invalid_id_in_flight_fails_every_rank():
    messages = run_ranks(bad_id_in_flight, 2)
    # batch 3's ids are sent while batch 2 is being delivered: the error comes before it
    assert messages[1].startswith("2 delivered; ") and "outside its table's rows" in messages[1]
    assert messages[0].startswith("2 delivered; ") and "rank(s) [1]" in messages[0]
