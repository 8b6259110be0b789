"""The module in front of the embeddings against plain PyTorch: the reference map picks the
slots, ``F.embedding_bag`` pools them, SGD updates them, re-used slots start again from
their generation's initial row; ids without a slot read the zero default row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neorec.embedding_store.initial import initial_rows
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.run.follow import PARTITION_END_HOOK
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection, initial_table_weight
from tests.trainer.dynamic.reference_map import ReferenceMap

CAPACITY, DIM, SEED, LR, B = 6, 4, 1, 0.5, 8
ROWS = CAPACITY + 1
"""The dynamic table's rows: its slots and the default row."""


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(lengths of f, raw ids of f, ids of g) per step: f multi-hot over 14 raw ids (extreme
    values among them), g one id of 10 rows."""
    rng = np.random.default_rng(0)
    space = np.array([0, -1, 2**63 - 1, -2**63, *rng.integers(-2**40, 2**40, 10)], dtype=np.int64)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 4, B).astype(np.int32)
        out.append((lengths, space[np.minimum(rng.zipf(1.5, int(lengths.sum())) - 1, space.size - 1)],
                    rng.integers(0, 10, B)))
    return out


def kjt(lengths: np.ndarray, f_ids: np.ndarray, g_ids: np.ndarray) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(("f", "g"), torch.from_numpy(np.concatenate([lengths, np.ones(B, np.int32)])),
                             torch.from_numpy(np.concatenate([f_ids, g_ids]).astype(np.int64)))


def pooled(weight: torch.Tensor, ids: np.ndarray, lengths: np.ndarray, mode: str = "sum") -> torch.Tensor:
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
    return F.embedding_bag(torch.from_numpy(ids.astype(np.int64)), weight, offsets, mode=mode)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_training_and_evaluation_match_plain_pytorch(pooling: str) -> None:
    tables = [TableConfig("a", ROWS, DIM, ("f",), pooling=pooling), TableConfig("b", 10, DIM, ("g",))]
    fused = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", LR), seed=SEED)
    config = DynamicTableConfig(capacity=CAPACITY, min_count=2, ttl=2, sketch_width=64, sketch_depth=2)
    module = DynamicEmbeddings(fused, [DynamicTable("a", 0, DIM, config)], SEED)
    reference = ReferenceMap(CAPACITY, 2, 2, 64, 2, table=0)
    wa = initial_table_weight(0, ROWS, DIM, SEED).clone().requires_grad_()
    wb = initial_table_weight(1, 10, DIM, SEED).clone().requires_grad_()
    reinitialised = 0
    for lengths, f_ids, g_ids in batches(30):
        target = torch.linspace(-1, 1, B * 2 * DIM).view(B, 2 * DIM)
        out = module(kjt(lengths, f_ids, g_ids))
        (out * target).sum().backward()

        slots, reinit = reference.train(f_ids.tolist())
        with torch.no_grad():
            for slot, generation in reinit:
                wa[slot] = torch.from_numpy(initial_rows(SEED, 0, np.array([generation * ROWS + slot]),
                                                         ROWS, DIM))[0]
            if min(slots, default=0) < 0:  # the default row is read: zero again
                wa[CAPACITY] = 0.0
        reinitialised += len(reinit)
        slots = np.where(np.array(slots, dtype=np.int64) < 0, CAPACITY, slots)
        expected = torch.cat([pooled(wa, slots, lengths, pooling), pooled(wb, g_ids, np.ones(B, np.int64))], dim=1)
        torch.testing.assert_close(out.detach(), expected.detach(), rtol=0, atol=1e-6)
        (expected * target).sum().backward()
        with torch.no_grad():
            for w in (wa, wb):
                w -= LR * w.grad
                w.grad = None
        torch.testing.assert_close(fused.table_weight("a"), wa.detach(), rtol=0, atol=1e-5)  # default row too
        torch.testing.assert_close(fused.table_weight("b"), wb.detach(), rtol=0, atol=1e-5)
    assert reinitialised > 0 and module.counters()["a"]["evicted"] > 0

    lengths, f_ids, g_ids = batches(31)[-1]
    before = module.dynamic_state(full=True)
    with torch.no_grad():
        out = module.eval()(kjt(lengths, f_ids, g_ids))
    known = np.array([reference.slot_of.get(i, CAPACITY) for i in f_ids.tolist()], dtype=np.int64)
    with torch.no_grad():
        wa[CAPACITY] = 0.0 if (known == CAPACITY).any() else wa[CAPACITY]
    torch.testing.assert_close(out[:, :DIM], pooled(wa.detach(), known, lengths, pooling), rtol=0, atol=1e-6)
    after = module.dynamic_state(full=True)
    assert np.array_equal(before["a"]["map"]["meta"], after["a"]["map"]["meta"])  # evaluation changes no map


def test_the_partition_end_hook_expires_partition_ttl_tables() -> None:
    tables = [TableConfig("a", ROWS, DIM, ("f",)), TableConfig("b", 10, DIM, ("g",))]
    fused = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", LR), seed=SEED)
    config = DynamicTableConfig(capacity=CAPACITY, ttl=1, ttl_unit="partitions")
    module = DynamicEmbeddings(fused, [DynamicTable("a", 0, DIM, config)], SEED)
    module(kjt(np.ones(B, np.int32), np.arange(B, dtype=np.int64) % 3, np.zeros(B, np.int64)))
    assert module.counters()["a"]["live"] == 3
    end_of = getattr(module, PARTITION_END_HOOK)  # what the follow loop calls
    end_of("2024-01-01T00")
    assert module.counters()["a"]["live"] == 3
    end_of("2024-01-01T01")
    assert module.counters()["a"] == {"admitted": 3, "rejected": 0, "evicted": 3, "live": 0}
