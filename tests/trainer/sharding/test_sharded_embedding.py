"""The sharded collection against the single-process fused module on the same global
batch, for every sharding type and a mixed plan, on real gloo groups of 2 and 4 ranks.

Table-wise, column-wise and data-parallel shards see the same ids in the same order as the
single-process module and get the same gradients, so outputs and weights are bit-identical.
Row-split shards (row_wise, table_row_wise) pool a bag in parts that are added after the
all-to-all, so a multi-id bag's sum is rounded differently: within 1e-6 there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.reference import concat_kjts, random_kjt
from tests.trainer.spawn import run_ranks
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.sharding.plan import (COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE, Shard,
                                   ShardingPlan, TableSharding, split_evenly)
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection

TABLES = [
    TableConfig("a", 50, 8, ("a1", "a2")),
    TableConfig("b", 37, 8, ("b1",), pooling="mean", learning_rate=0.2),
    TableConfig("c", 40, 4, ("c1",)),
]
BATCH = 5
STEPS = 3
EXACT = (TABLE_WISE, COLUMN_WISE, DATA_PARALLEL)


def sharding(table: TableConfig, index: int, kind: str, world: int) -> TableSharding:
    rows, dim = table.num_embeddings, table.embedding_dim
    if kind == TABLE_WISE:
        shards = (Shard((index + 1) % world, 0, rows, 0, dim),)
    elif kind == ROW_WISE:
        shards = tuple(Shard(r, off, n, 0, dim) for r, (off, n) in enumerate(split_evenly(rows, world)))
    elif kind == TABLE_ROW_WISE:  # groups of two ranks; table i on group i % 2
        group = [2 * (index % 2), 2 * (index % 2) + 1]
        shards = tuple(Shard(r, off, n, 0, dim) for r, (off, n) in zip(group, split_evenly(rows, 2)))
    elif kind == COLUMN_WISE:
        shards = tuple(Shard(world - 1 - r, 0, rows, off, n) for r, (off, n) in enumerate(split_evenly(dim, 2)))
    else:
        shards = tuple(Shard(r, 0, rows, 0, dim) for r in range(world))
    return TableSharding(table.name, kind, shards)


def plan_of(kinds: list[str], world: int) -> ShardingPlan:
    return ShardingPlan(world, tuple(sharding(t, i, k, world) for i, (t, k) in enumerate(zip(TABLES, kinds))))


def cases(world: int) -> dict[str, tuple[ShardingPlan, SparseOptimizer, str]]:
    """name: (plan, optimizer, weight dtype)."""
    rowwise, adagrad = SparseOptimizer("rowwise_adagrad", 0.1), SparseOptimizer("adagrad", 0.1)
    kinds = [TABLE_WISE, ROW_WISE, COLUMN_WISE, DATA_PARALLEL] + ([TABLE_ROW_WISE] if world == 4 else [])
    found = {}
    for kind in kinds:
        # column-wise shards keep a row-wise state per shard: compared with element-wise Adagrad
        found[kind] = (plan_of([kind] * len(TABLES), world), adagrad if kind == COLUMN_WISE else rowwise, "fp32")
    mixed = [TABLE_ROW_WISE if world == 4 else ROW_WISE, COLUMN_WISE, DATA_PARALLEL]
    found["mixed"] = (plan_of(mixed, world), SparseOptimizer("adam", 0.05), "fp32")
    found["mixed-sgd"] = (plan_of([TABLE_WISE, ROW_WISE, COLUMN_WISE], world), SparseOptimizer("sgd", 0.3), "fp32")
    # a decayed Adagrad sum: each shard decays the rows it updates, as one module does
    found["mixed-decayed"] = (plan_of([ROW_WISE, TABLE_WISE, DATA_PARALLEL], world),
                              SparseOptimizer("rowwise_adagrad", 0.1, adagrad_decay=0.9), "fp32")
    # stochastic rounding noise is drawn per element of the whole table: sharding does not change it
    found["mixed-bf16"] = (plan_of([COLUMN_WISE, TABLE_WISE, DATA_PARALLEL], world), adagrad, "bf16")
    # the CUDA code path (torch ops for routing, lookup and update), run on CPU
    found["mixed-torch-ops"] = (plan_of([ROW_WISE, COLUMN_WISE, DATA_PARALLEL], world), adagrad, "bf16")
    return found


def make_steps(world: int, seed: int) -> list[tuple[list[KeyedJaggedTensor], torch.Tensor]]:
    """Per step: each rank's batch (random key order, empty bags, repeated ids, weights) and
    the upstream gradient of the global batch."""
    rng = np.random.default_rng(seed)
    width = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)
    return [([random_kjt(TABLES, BATCH, rng, weighted=True) for _ in range(world)],
             torch.from_numpy(rng.standard_normal((world * BATCH, width)).astype(np.float32)))
            for _ in range(STEPS)]


def reference(optimizer: SparseOptimizer, weight_dtype: str, steps) -> tuple[torch.Tensor, FusedEmbeddingBagCollection]:
    module = FusedEmbeddingBagCollection(TABLES, optimizer, seed=1, weight_dtype=weight_dtype)
    outputs = []
    for kjts, grad in steps:
        out = module(concat_kjts(kjts))
        outputs.append(out.detach().clone())
        (out * grad).sum().backward()
    return torch.stack(outputs), module


def run_cases(rank: int, world: int, steps) -> dict[str, tuple[torch.Tensor, dict]]:
    results = {}
    for name, (plan, optimizer, weight_dtype) in cases(world).items():
        module = ShardedEmbeddingBagCollection(TABLES, optimizer, plan, seed=1, weight_dtype=weight_dtype,
                                               kernels="torch" if name.endswith("torch-ops") else "auto")
        outputs = []
        for kjts, grad in steps:
            out = module(kjts[rank])
            outputs.append(out.detach().clone())
            (out * grad[rank * BATCH : (rank + 1) * BATCH]).sum().backward()
        results[name] = (torch.stack(outputs), {t.name: module.gather_table(t.name) for t in TABLES})
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_matches_single_process(world):
    steps = make_steps(world, seed=world)
    per_rank = run_ranks(run_cases, world, steps)
    for name, (plan, optimizer, weight_dtype) in cases(world).items():
        expected_out, module = reference(optimizer, weight_dtype, steps)
        got_out = torch.cat([per_rank[r][name][0] for r in range(world)], dim=1)
        exact = all(plan.of(t.name).sharding_type in EXACT for t in TABLES)
        _compare(got_out, expected_out, exact, f"{name}: outputs")
        for table in TABLES:
            weight, states = per_rank[0][name][1][table.name]
            table_exact = plan.of(table.name).sharding_type in EXACT
            _compare(weight, module.table_weight(table.name).float(), table_exact, f"{name}: table {table.name}")
            for got, want in zip(states, module.table_state(table.name)):
                _compare(got, want, table_exact, f"{name}: table {table.name} optimizer state")
        for r in range(1, world):  # every rank gathered the same tables
            for table in TABLES:
                assert torch.equal(per_rank[r][name][1][table.name][0], per_rank[0][name][1][table.name][0])


def _compare(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: not bit-identical (max diff {(got - want).abs().max():.3g})"
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=what)


def bad_id_rank(rank: int, world: int) -> str:
    plan = plan_of([ROW_WISE, TABLE_WISE, DATA_PARALLEL], world)
    module = ShardedEmbeddingBagCollection(TABLES, SparseOptimizer("sgd", 0.1), plan)
    kjt = random_kjt(TABLES, BATCH, np.random.default_rng(rank))
    if rank == 1:
        kjt.values[0] = 50  # outside every table
    try:
        module(kjt)
    except IndexError as err:
        return str(err)
    return "no error"


def test_an_invalid_id_on_one_rank_fails_every_rank():
    messages = run_ranks(bad_id_rank, 2)
    assert "outside its table's rows" in messages[1] and "[0, " in messages[1]
    assert "rank(s) [1]" in messages[0]


def learned_weights_rank(rank: int, world: int) -> str:
    module = ShardedEmbeddingBagCollection(TABLES, SparseOptimizer("sgd", 0.1), plan_of([ROW_WISE] * 3, world))
    kjt = random_kjt(TABLES, BATCH, np.random.default_rng(rank))
    learned = torch.ones(kjt.values.numel(), requires_grad=True)
    try:
        module(KeyedJaggedTensor(kjt.keys, kjt.lengths, kjt.values, learned))
    except NotImplementedError as err:
        return str(err)
    return "no error"


def test_per_id_weights_that_require_grad_are_refused_by_sharded_tables():
    """They would cross the all-to-all as data and get no gradient, silently."""
    assert all("per-id weights that require a gradient are not supported with sharded tables" in message
               for message in run_ranks(learned_weights_rank, 2))
