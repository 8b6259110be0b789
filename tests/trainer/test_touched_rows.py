"""The touched bitmap: one bit per row, set by both kernel families for exactly the rows
an update wrote, whatever the threads and however the update's work is cut."""

import numba
import numpy as np
import pytest
import torch

from tests.trainer.reference import random_kjt, touched_rows
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.embedding.kernels import backward
from neorec.trainer.embedding.touched import TouchedRows, bitmap_offsets

# rows not multiples of 8: the tables' flags start on bytes of their own
TABLES = [TableConfig("a", 13, 8, ("f",)), TableConfig("b", 1003, 4, ("g", "h")), TableConfig("c", 5, 8, ("i",))]


def test_tables_start_on_bytes_of_their_own():
    assert bitmap_offsets(np.array([13, 1003, 5, 8])).tolist() == [0, 16, 1024, 1032, 1040]


def test_touched_rows_mark_mask_count_clear():
    bits = torch.zeros(2, dtype=torch.uint8)
    touched = TouchedRows(bits, 13)
    touched.mark(torch.tensor([12, 0, 7, 8, 0]))
    assert touched.mask().nonzero().flatten().tolist() == [0, 7, 8, 12]
    assert touched.indices().tolist() == [0, 7, 8, 12] and touched.indices().dtype == torch.int64
    assert bits.tolist() == [0b1000_0001, 0b0001_0001]
    assert touched.count() == 4
    touched.mark(torch.tensor([1]))
    assert touched.mask().nonzero().flatten().tolist() == [0, 1, 7, 8, 12]
    touched.clear()
    assert touched.count() == 0 and touched.indices().numel() == 0 and not bits.any()
    with pytest.raises(ValueError, match="13 rows need 2 uint8 bytes"):
        TouchedRows(torch.zeros(3, dtype=torch.uint8), 13)


def _every_row(table: TableConfig, batch_size: int, first: int) -> np.ndarray:
    """ids of ``feature`` for ``batch_size`` one-id bags: rows ``first, first + 1, ...``
    (wrapping), so neighbouring rows share their flags' bytes."""
    return (first + np.arange(batch_size)) % table.num_embeddings


def _dense_batch(batch_size: int, first: int) -> KeyedJaggedTensor:
    keys, values = [], []
    for table in TABLES:
        for k, feature in enumerate(table.feature_names):
            keys.append(feature)
            values.append(_every_row(table, batch_size, first + 3 * k))
    lengths = torch.ones(len(keys) * batch_size, dtype=torch.int32)
    return KeyedJaggedTensor(tuple(keys), lengths, torch.from_numpy(np.concatenate(values)))


@pytest.mark.parametrize("kernels", ["numba", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
def test_update_sets_the_bits_of_exactly_the_rows_written(kernels, threads, restore_threads):
    """Runs of neighbouring rows across many work chunks (the update cuts its work where
    two rows' bits are in different bytes), flags that accumulate over steps (a second
    step re-marks some rows) and tables whose flags start mid-bitmap."""
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("needs two cores")
    numba.set_num_threads(threads)
    module = FusedEmbeddingBagCollection(TABLES, SparseOptimizer("rowwise_adagrad", 0.1), seed=1, kernels=kernels)
    rng = np.random.default_rng(3)
    expected = {t.name: set() for t in TABLES}
    batches = [_dense_batch(300, 0), _dense_batch(300, 250), random_kjt(TABLES, 64, rng, max_len=5)]
    for kjt in batches:
        before = {t.name: module.table_weight(t.name).clone() for t in TABLES}
        module(kjt).sum().backward()
        for t in TABLES:
            written = (module.table_weight(t.name) != before[t.name]).any(dim=1).nonzero().flatten().tolist()
            rows = touched_rows(TABLES, kjt)[t.name].tolist()
            assert set(written) <= set(rows)
            expected[t.name] |= set(rows)
        for t in TABLES:
            assert module.table_touched(t.name).nonzero().flatten().tolist() == sorted(expected[t.name]), t.name
    indices = {v.table: v.touched.indices().tolist() for v in module.shard_views()}
    assert indices == {name: sorted(rows) for name, rows in expected.items()}
    counts = {v.table: v.touched.count() for v in module.shard_views()}
    assert counts == {name: len(rows) for name, rows in expected.items()}
    padding = [int(module.touched[16 // 8 - 1]) >> 5, int(module.touched[1016 // 8]) >> 3]
    assert padding == [0, 0]  # the bytes' bits past a table's last row stay clear
    module.clear_touched()
    assert not any(module.table_touched(t.name).any() for t in TABLES)


def test_both_kernel_families_set_the_same_bitmap():
    rng = np.random.default_rng(5)
    modules = [FusedEmbeddingBagCollection(TABLES, SparseOptimizer("sgd", 0.1), seed=2, kernels=k)
               for k in ("numba", "torch")]
    for _ in range(3):
        kjt = random_kjt(TABLES, 200, rng, max_len=6)
        for m in modules:
            m(kjt).sum().backward()
    assert modules[0].touched.any()
    assert torch.equal(modules[0].touched, modules[1].touched)


def test_update_work_is_cut_between_bytes():
    """No two chunks of the update's work hold rows whose bits share a byte (two threads
    would then write it at once)."""
    rng = np.random.default_rng(7)
    offsets = bitmap_offsets(np.array([13, 7, 1003, 5]))
    rows = [np.unique(rng.integers(0, n, k)) for n, k in ((13, 9), (7, 0), (1003, 700), (5, 5))]  # one empty
    run_table = np.concatenate([np.full(r.size, t) for t, r in enumerate(rows)]).astype(np.int64)
    table_runs = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
    # each table's runs at its ids' place (group_by_row's layout), here 3 ids more than runs
    table_starts = table_runs + 3 * np.arange(len(rows) + 1)
    run_rows = np.full(table_starts[-1], -1, dtype=np.int64)
    for t, r in enumerate(rows):
        run_rows[table_starts[t] : table_starts[t] + r.size] = r
    num_runs = run_table.size
    byte = (offsets[run_table] + np.concatenate(rows)) >> 3
    for chunks in (1, 2, 7, 32, num_runs):
        starts = [backward._chunk_start(c, chunks, num_runs, table_starts, table_runs, run_rows, offsets)
                  for c in range(chunks + 1)]
        assert starts[0] == 0 and starts[-1] == num_runs and starts == sorted(starts)
        inner = [s for s in starts[1:-1] if 0 < s < num_runs]
        assert all(byte[s - 1] != byte[s] for s in inner), chunks
