"""Training through the embedding store gives the weights and optimizer states of training
with the tables in memory, bit for bit, whatever the cache size (one set, a fraction of the
rows, all of them), the optimizer and the weight type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neorec.embedding_store.segments import SegmentTier
from tests.trainer.reference import random_kjt
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, StoreSettings, StoreTable

TABLES = [TableConfig("mem", 400, 8, ("a",)), TableConfig("big", 20_000, 8, ("b", "c")),
          TableConfig("wide", 5_000, 16, ("d",), pooling="mean")]
STORE = ("big", "wide")


def store_module(tmp_path, optimizer, weight_dtype, cache_rows: dict[str, int], ways: int = 32, policy="lru"):
    def open_tier(key: str, rows: int, row_bytes: int) -> SegmentTier:
        return SegmentTier(tmp_path / key, rows, row_bytes, segment_bytes=64 << 10)

    specs = [StoreTable(name, cache_rows[name], scratch_rows=4096, ways=ways, policy=policy) for name in STORE]
    return StoreBackedEmbeddings(TABLES, optimizer, specs, StoreSettings(open_tier), seed=3, weight_dtype=weight_dtype)


def whole_table(module, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rows = torch.arange([t for t in TABLES if t.name == name][0].num_embeddings)
    return module.read_rows(name, rows)


def train(module, steps: int, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    outputs = []
    for _ in range(steps):
        kjt = random_kjt(TABLES, 32, rng, max_len=3, weighted=True)
        if hasattr(module, "read_ahead"):
            module.read_ahead(kjt)
        out = module(kjt)
        outputs.append(out.detach().clone())
        out.backward(torch.from_numpy(rng.normal(0, 1, out.shape).astype(np.float32)))
    return outputs


OPTIMIZERS = [*(SparseOptimizer(kind, 0.1) for kind in ("sgd", "adagrad", "rowwise_adagrad", "adam")),
              SparseOptimizer("rowwise_adagrad", 0.1, adagrad_decay=0.9)]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o.kind}-decay{o.adagrad_decay}")
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cache", ["one set", "0.5%", "all"])
def test_training_through_the_store_equals_training_in_memory(tmp_path, opt, weight_dtype, cache):
    memory = FusedEmbeddingBagCollection(TABLES, opt, seed=3, weight_dtype=weight_dtype)
    sizes = {"one set": {"big": 32, "wide": 32}, "0.5%": {"big": 100, "wide": 32},
             "all": {"big": 20_000, "wide": 5_000}}[cache]
    store = store_module(tmp_path, opt, weight_dtype, sizes)
    expected, got = train(memory, 200), train(store, 200)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    for t in TABLES:
        weights, states = whole_table(store, t.name)
        assert torch.equal(weights, memory.table_weight(t.name).float()), t.name
        assert all(torch.equal(a, b) for a, b in zip(states, memory.table_state(t.name))), t.name
    assert int(store.optimizer_step) == int(memory.optimizer_step) == 200
    tier = store.store["big"].tier
    counters = tier.counters()
    if cache != "all":
        assert counters.bytes_written > 0 and counters.rows_found > 0  # rows really went down and came back


def test_fp16_and_lfu_through_the_store(tmp_path):
    opt = SparseOptimizer("rowwise_adagrad", 0.1)
    memory = FusedEmbeddingBagCollection(TABLES, opt, seed=3, weight_dtype="fp16")
    store = store_module(tmp_path, opt, "fp16", {"big": 64, "wide": 64}, ways=8, policy="lfu")
    assert all(torch.equal(a, b) for a, b in zip(train(memory, 60), train(store, 60)))
    weights, _ = whole_table(store, "big")
    assert torch.equal(weights, memory.table_weight("big").float())


def test_zeroed_rows_are_zero_wherever_they_are(tmp_path):
    """A row zeroer zeroes the rows of store tables in the cache and on the tier alike, and
    training continues as in memory."""
    opt = SparseOptimizer("rowwise_adagrad", 0.1)
    memory = FusedEmbeddingBagCollection(TABLES, opt, seed=3)
    store = store_module(tmp_path, opt, "fp32", {"big": 64, "wide": 32})
    train(memory, 40), train(store, 40)
    rows = {"big": np.arange(0, 20_000, 97), "wide": np.array([4, 4_999]), "mem": np.array([1, 2])}
    store.row_zeroer(rows)(), memory.row_zeroer(rows)()
    for name, at in rows.items():
        weights, states = store.read_rows(name, torch.from_numpy(at))
        assert not weights.any() and not any(s.any() for s in states), name
    assert all(torch.equal(a, b) for a, b in zip(train(memory, 20, seed=1), train(store, 20, seed=1)))
    for t in TABLES:
        weights, states = whole_table(store, t.name)
        assert torch.equal(weights, memory.table_weight(t.name).float()), t.name
        assert all(torch.equal(a, b) for a, b in zip(states, memory.table_state(t.name))), t.name


def test_rows_never_touched_are_never_stored(tmp_path):
    opt = SparseOptimizer("adagrad", 0.1)
    store = store_module(tmp_path, opt, "fp32", {"big": 64, "wide": 64})
    train(store, 5)
    store.write_back()
    stored = store.store["big"].tier.counters().live_rows
    touched = len({int(r) for r in store.store["big"].cache.tags if r >= 0})
    assert 0 < stored <= 20_000 // 10  # a small share of the table reached the disk
    assert stored >= touched
