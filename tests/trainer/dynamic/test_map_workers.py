"""Map shards' id steps side by side decide as one after the other."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.dynamic.workers import MapShardWorkers, deal
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection

TABLES, SHARDS, CAPACITY, DIM, B = 3, 2, 8, 4, 16


def test_deal_balances_the_largest_first_and_keeps_each_group_in_order():
    assert deal([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]  # 5, 4, 3 to the lighter, 2 and 1: totals 8 and 7
    assert deal([3, 3, 3], 1) == [[0, 1, 2]]
    assert deal([7], 4) == [[0]]  # empty groups left out
    assert deal([], 3) == []


def test_a_failing_job_fails_the_call_after_every_other_job_ended(restore_threads):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two threads")
    numba.set_num_threads(2)
    done = []

    def fail() -> None:
        raise ValueError("bad shard")

    def slow() -> None:
        done.append(sum(range(200_000)))

    with pytest.raises(ValueError, match="bad shard"):
        MapShardWorkers().run([fail, slow], [2, 1])
    assert done, "the other group ran to its end"


def _module() -> DynamicEmbeddings:
    tables = [TableConfig(f"t{t}", SHARDS * (CAPACITY // SHARDS + 1), DIM, (f"f{t}",)) for t in range(TABLES)]
    inner = FusedEmbeddingBagCollection(tables, SparseOptimizer("rowwise_adagrad", 0.1), seed=2)
    config = DynamicTableConfig(capacity=CAPACITY, min_count=2, sketch_width=64, sketch_depth=2, shards=SHARDS)
    return DynamicEmbeddings(inner, [DynamicTable(f"t{t}", t, DIM, config, shard=s)
                                     for t in range(TABLES) for s in range(SHARDS)], seed=2)


def _train(threads: int) -> tuple[list[torch.Tensor], list[np.ndarray], list[dict]]:
    numba.set_num_threads(threads)
    module = _module()
    rng = np.random.default_rng(7)
    outputs = []
    for _ in range(25):
        lengths = rng.integers(0, 4, TABLES * B).astype(np.int32)
        ids = rng.integers(-40, 40, int(lengths.sum())) * 1_000_003  # a few dozen raw ids per table
        batch = KeyedJaggedTensor(tuple(f"f{t}" for t in range(TABLES)), torch.from_numpy(lengths),
                                  torch.from_numpy(ids.astype(np.int64)))
        out = module(batch)
        out.sum().backward()
        outputs.append(out.detach())
    maps = [a.copy() for table in module.map_shards() for a in (table.map.meta, table.map.entries)]
    return outputs, maps, [table.counters() for table in module.map_shards()]


def test_two_threads_give_the_maps_and_outputs_of_one(restore_threads):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two threads")
    one, two = _train(1), _train(2)
    assert all(torch.equal(a, b) for a, b in zip(one[0], two[0]))
    assert all(np.array_equal(a, b) for a, b in zip(one[1], two[1]))
    assert one[2] == two[2] and sum(c["evicted"] for c in one[2]) > 0
