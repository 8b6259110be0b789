"""The public Python API given hostile tensors: a malformed batch is refused when it is made
(mismatched or negative lengths, wrong dtypes or shapes), ids outside a table (-1, >= rows)
are refused by the fused, sharded (a real gloo group of 2) and store-backed collections,
named, in training and evaluation, with the weights, optimizer state and touched rows
unchanged; empty batches, zero-length bags and non-contiguous tensors give the result of
``nn.functional.embedding_bag``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neorec.embedding_store.segments import SegmentTier
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import MAX_UNREAD_CHECKS, FusedEmbeddingBagCollection
from neorec.trainer.embedding.kernels.forward import LANES
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, StoreSettings, StoreTable
from neorec.trainer.sharding.plan import ROW_WISE, TABLE_WISE, Shard, ShardingPlan, TableSharding
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from tests.trainer.reference import reference_pooled
from tests.trainer.spawn import run_ranks

TABLES = [TableConfig("t", 10, 4, ("a",)), TableConfig("u", 30, 4, ("b",), pooling="mean")]
KEYS = ("a", "b")
SEED = 3


def _kjt(lengths, values, weights=None, keys=KEYS) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys, torch.tensor(lengths, dtype=torch.int32), torch.tensor(values, dtype=torch.int64),
                             None if weights is None else torch.tensor(weights, dtype=torch.float32))


# ------------------------------------------------------------------ the batch itself
@pytest.mark.parametrize("lengths, values, weights, error, match", [
    ([1, 1, 1, 1], [0, 1, 2], None, ValueError, "add up to 4 ids, values holds 3"),
    ([1, 1, 1, 1], [0, 1, 2, 3, 4], None, ValueError, "add up to 4 ids, values holds 5"),
    ([2, -1, 1, 1], [0, 1, 2], None, ValueError, "lengths must be >= 0, got -1"),
    ([1, 1, 1], [0, 1, 2], None, ValueError, "3 lengths do not split into 2 features"),
    ([], [0], None, ValueError, "no lengths for 1 values"),
    ([1, 1, 1, 1], [0, 1, 2, 3], [1.0, 2.0], ValueError, "2 weights for 4 values"),
])
def test_inconsistent_batches_are_refused_when_made(lengths, values, weights, error, match):
    with pytest.raises(error, match=match):
        _kjt(lengths, values, weights)


def test_keys_are_distinct_feature_names_and_the_module_takes_only_a_batch():
    with pytest.raises(ValueError, match=r"a feature appears twice in the keys \('a', 'a'\)"):
        _kjt([1, 1], [0, 1], keys=("a", "a"))
    with pytest.raises(TypeError, match="keys is a sequence of feature names, got the string 'ab'"):
        _kjt([1, 1], [0, 1], keys="ab")
    module = FusedEmbeddingBagCollection(TABLES, SparseOptimizer("sgd", 0.1))
    with pytest.raises(TypeError, match="looks up a KeyedJaggedTensor, got Tensor"):
        module(torch.arange(4))


@pytest.mark.parametrize("lengths, values, weights, match", [
    (torch.ones(4, dtype=torch.int64), torch.arange(4), None, "lengths must be torch.int32"),
    (torch.ones(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32), None, "values must be torch.int64"),
    (torch.ones(4, dtype=torch.int32), torch.arange(4), torch.ones(4, dtype=torch.float64),
     "weights must be torch.float32"),
    (torch.ones(4, dtype=torch.int32), np.arange(4), None, "values must be a torch.Tensor"),
])
def test_wrong_dtypes_are_refused_when_made(lengths, values, weights, match):
    with pytest.raises(TypeError, match=match):
        KeyedJaggedTensor(KEYS, lengths, values, weights)


def test_new_values_keep_the_checked_lengths_and_must_match_the_old():
    kjt = KeyedJaggedTensor(KEYS, torch.tensor([1, 0, 2, 1], dtype=torch.int32), torch.arange(4))
    moved = kjt.with_values(torch.tensor([7, 8, 9, 10]))
    assert moved.values.tolist() == [7, 8, 9, 10] and moved.lengths is kjt.lengths
    assert kjt.values.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"int64 of shape \(4,\)"):
        kjt.with_values(torch.arange(3))
    with pytest.raises(ValueError, match="int64"):
        kjt.with_values(torch.arange(4, dtype=torch.int32))


def test_copies_keep_the_checked_block_and_must_match_it():
    kjt = KeyedJaggedTensor(KEYS, torch.tensor([1, 0, 2, 1], dtype=torch.int32), torch.arange(4),
                            torch.ones(4))
    copied = kjt.to(torch.device("cpu"))
    assert copied.keys == kjt.keys and all(torch.equal(a, b) for a, b in
                                           ((copied.lengths, kjt.lengths), (copied.values, kjt.values),
                                            (copied.weights, kjt.weights)))
    with pytest.raises(ValueError, match="values: a copy must keep the dtype and shape"):
        kjt.copied_to(kjt.lengths, torch.arange(3), kjt.weights)
    with pytest.raises(ValueError, match="lengths: a copy must keep the dtype and shape"):
        kjt.copied_to(kjt.lengths.long(), kjt.values, kjt.weights)
    with pytest.raises(ValueError, match="weights: a copy must keep the dtype and shape"):
        kjt.copied_to(kjt.lengths, kjt.values, None)


def test_wrong_shapes_are_refused_when_made():
    with pytest.raises(ValueError, match=r"lengths must be 1-D, got shape \(2, 2\)"):
        KeyedJaggedTensor(KEYS, torch.ones(2, 2, dtype=torch.int32), torch.arange(4))


# ------------------------------------------------------------------ the collections
def _fused(bounds_check: str = "fatal") -> FusedEmbeddingBagCollection:
    return FusedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), seed=SEED, bounds_check=bounds_check)


def _store_backed(tmp_path) -> StoreBackedEmbeddings:
    def open_tier(key: str, rows: int, row_bytes: int) -> SegmentTier:
        return SegmentTier(tmp_path / key, rows, row_bytes)

    return StoreBackedEmbeddings(TABLES, SparseOptimizer("adagrad", 0.1), [StoreTable("u", 8, scratch_rows=16, ways=4)],
                                 StoreSettings(open_tier), seed=SEED)


def _weights(module) -> list[torch.Tensor]:
    """Every tensor the module trains (the store-backed module: its cache slots), and its
    touched rows."""
    inner = module.module if isinstance(module, StoreBackedEmbeddings) else module
    return [inner.weights.clone(), inner.state1.clone(), inner.optimizer_step.clone(), inner.touched.clone()]


def _train_step(module, kjt: KeyedJaggedTensor) -> torch.Tensor:
    out = module(kjt)
    out.sum().backward()
    return out


HOSTILE_IDS = [([1, 1, 1, 1], [0, -1, 2, 3], "id -1 of feature 'a' is outside its table's rows t: \\[0, 10\\)"),
               ([1, 1, 1, 1], [0, 1, 30, 3], "id 30 of feature 'b' is outside its table's rows u: \\[0, 30\\)"),
               ([1, 1, 1, 1], [10, 1, 2, 3], "id 10 of feature 'a' is outside its table's rows t: \\[0, 10\\)")]


@pytest.fixture(params=["fused", "fused-torch-ops", "store-backed"])
def module(request, tmp_path):
    if request.param == "store-backed":
        return _store_backed(tmp_path)
    kernels = "torch" if request.param == "fused-torch-ops" else "auto"
    return FusedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), seed=SEED, kernels=kernels)


@pytest.mark.parametrize("lengths, values, match", HOSTILE_IDS)
def test_ids_outside_a_table_are_refused_and_nothing_is_written(module, lengths, values, match):
    _train_step(module, _kjt([1, 1, 1, 1], [0, 1, 2, 3]))
    before = _weights(module)
    with pytest.raises(IndexError, match=match):
        _train_step(module, _kjt(lengths, values))
    module.eval()
    with torch.no_grad(), pytest.raises(IndexError, match=match):
        module(_kjt(lengths, values))
    for got, want in zip(_weights(module), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("bad_first", [True, False])
def test_a_bad_batch_among_several_forwards_is_refused_before_any_update(kernels, bad_first):
    """Two forwards, then one backward over both (the torch-ops lookup reads its counts of
    bad ids when an update is due: every count since the last update is read before it)."""
    module = FusedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), seed=SEED, kernels=kernels)
    before = _weights(module)
    good, bad = _kjt([1, 1, 1, 1], [0, 1, 2, 3]), _kjt([1, 1, 1, 1], [10, 1, 2, 3])
    with pytest.raises(IndexError, match=r"id 10 of feature 'a' is outside its table's rows t: \[0, 10\)"):
        first, second = (bad, good) if bad_first else (good, bad)
        (module(first).sum() + module(second).sum()).backward()
    for got, want in zip(_weights(module), before):
        assert torch.equal(got, want)


def test_torch_ops_forwards_without_an_update_are_checked_when_asked_or_when_many():
    """A training-mode forward that no backward follows: its count waits for ``check_ids``
    (the loop's log lines), or is read once ``MAX_UNREAD_CHECKS`` wait."""
    module = FusedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), seed=SEED, kernels="torch")
    good, bad = _kjt([1, 1, 1, 1], [0, 1, 2, 3]), _kjt([1, 1, 1, 1], [10, 1, 2, 3])
    module(bad)
    with pytest.raises(IndexError, match="id 10 of feature 'a'"):
        module.check_ids()
    module.check_ids()  # read: nothing left
    module(bad)
    for _ in range(MAX_UNREAD_CHECKS - 1):
        module(good)
    with pytest.raises(IndexError, match="id 10 of feature 'a'"):
        module(good)


def test_torch_ops_without_the_check_leave_bad_ids_out_and_raise_at_the_next_check():
    """``bounds_check = "none"``: the torch-ops step trains the batch's good ids (the bad
    one left out, unwritten) and ``check_ids`` raises with the count."""
    module = FusedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), seed=SEED, kernels="torch",
                                         bounds_check="none")
    before = module.table_weight("t").clone()
    _train_step(module, _kjt([1, 1, 1, 1], [10, 1, 2, 3]))  # a: 10 (outside t), 1; b: 2, 3
    changed = (module.table_weight("t") != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [1]
    with pytest.raises(IndexError, match=r"1 ids are outside their table's rows t: \[0, 10\)"):
        module.check_ids()
    module.check_ids()


@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_lookup_names_the_bad_id_whichever_kernel_pools(weighted):
    """A float32 sum table 64 wide pools in registers (``pooled_sum_lanes``), weighted ids
    in the general kernel: either way, in training and evaluation, the bad id is named by
    its feature (one of its table's two), nothing is written, and a batch key the module
    does not look up is not checked."""
    module = FusedEmbeddingBagCollection([TableConfig("wide", 5, LANES, ("x", "y"))],
                                         SparseOptimizer("rowwise_adagrad", 0.1), seed=SEED)
    keys = ("z", "y", "x")  # z: not looked up, its ids beyond any row

    def batch(y_ids: list[int]) -> KeyedJaggedTensor:
        return _kjt([1] * 6, [100, 7] + y_ids + [1, 2], [1.0, 2.0, 0.5, 3.0, 1.5, 1.0] if weighted else None, keys)

    _train_step(module, batch([0, 4]))
    before = _weights(module)
    match = r"id 9 of feature 'y' is outside its table's rows wide: \[0, 5\)"
    with pytest.raises(IndexError, match=match):
        _train_step(module, batch([0, 9]))
    module.eval()
    with torch.no_grad(), pytest.raises(IndexError, match=match):
        module(batch([0, 9]))
    for got, want in zip(_weights(module), before):
        assert torch.equal(got, want)


def _expected(kjt: KeyedJaggedTensor) -> torch.Tensor:
    reference = _fused()
    return reference_pooled(TABLES, {t.name: reference.table_weight(t.name) for t in TABLES}, kjt)


@pytest.mark.parametrize("case", ["empty-batch", "zero-length-bags", "non-contiguous", "weighted-non-contiguous"])
def test_edge_batches_give_embedding_bag_results(module, case):
    if case == "empty-batch":
        kjt = _kjt([], [])
    elif case == "zero-length-bags":
        kjt = _kjt([0, 3, 0, 0, 0, 2], [9, 9, 0, 29, 0])
    else:
        lengths = torch.tensor([[2, 0], [1, 0], [3, 0], [1, 0]], dtype=torch.int32)[:, 0]  # a strided view
        values = torch.tensor([[4, -7], [5, -7], [6, -7], [1, -7], [28, -7], [0, -7], [7, -7]])[:, 0]
        weights = torch.arange(14, dtype=torch.float32)[::2] if case.startswith("weighted") else None
        assert not lengths.is_contiguous() and not values.is_contiguous()
        kjt = KeyedJaggedTensor(KEYS, lengths, values, weights)
    module.eval()
    with torch.no_grad():
        got = module(kjt)
    assert got.shape == (kjt.batch_size, 8)
    if kjt.batch_size:
        torch.testing.assert_close(got, _expected(kjt), rtol=1e-6, atol=1e-6)
    module.train()
    before = _weights(module)
    _train_step(module, kjt)
    assert torch.equal(_weights(module)[0], before[0]) == (case == "empty-batch")  # no ids: nothing to update


def test_bounds_check_none_skips_the_up_front_check_and_the_kernel_still_guards():
    module = _fused(bounds_check="none")
    with pytest.raises(IndexError, match=r"outside their table's rows"):  # the Numba kernel's own guard
        module(_kjt([1, 1, 1, 1], [0, 1, 30, 3]))
    with pytest.raises(ValueError, match="bounds_check must be one of"):
        _fused(bounds_check="warn")


# ------------------------------------------------------------------ sharded, two ranks
def _plan() -> ShardingPlan:
    return ShardingPlan(2, (TableSharding("t", ROW_WISE, (Shard(0, 0, 5, 0, 4), Shard(1, 5, 5, 0, 4))),
                            TableSharding("u", TABLE_WISE, (Shard(1, 0, 30, 0, 4),))))


def _sharded_rank(rank: int, world: int) -> dict:
    module = ShardedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), _plan(), seed=SEED)
    good = _kjt([1, 2, 0, 1], [rank, 9, 3, 28])
    _train_step(module, good)
    before = [module.gather_table(t.name)[0].clone() for t in TABLES]
    refused = {}
    for i, (lengths, values, _) in enumerate(HOSTILE_IDS):
        hostile = _kjt(lengths, values) if rank == i % 2 else good  # one rank at a time is hostile
        try:
            _train_step(module, hostile)
            refused[i] = "no error"
        except IndexError as err:
            refused[i] = str(err)
    unchanged = all(torch.equal(module.gather_table(t.name)[0], w) for t, w in zip(TABLES, before))
    module.eval()
    with torch.no_grad():
        edge = module(KeyedJaggedTensor(KEYS, torch.tensor([[0, 9], [3, 9]], dtype=torch.int32)[:, 0],
                                        torch.tensor([[1, 0], [2, 0], [29, 0]])[:, 0]))
    return {"refused": refused, "unchanged": unchanged, "edge": edge,
            "tables": {t.name: module.gather_table(t.name)[0] for t in TABLES}}


def test_sharded_collection_refuses_bad_ids_on_every_rank_and_handles_edge_batches():
    results = run_ranks(_sharded_rank, 2)
    for i, (_, values, _) in enumerate(HOSTILE_IDS):
        bad_id = [v for v in values if not 0 <= v < 10][0] if i != 1 else 30
        hostile, other = results[i % 2]["refused"][i], results[1 - i % 2]["refused"][i]
        assert f"id {bad_id} is outside its table's rows" in hostile, hostile
        assert f"rank(s) [{i % 2}]" in other, other
    for rank in (0, 1):
        assert results[rank]["unchanged"]
    edge = KeyedJaggedTensor(KEYS, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 2, 29]))
    want = reference_pooled(TABLES, results[0]["tables"], edge)
    for rank in (0, 1):
        torch.testing.assert_close(results[rank]["edge"], want, rtol=1e-6, atol=1e-6)
