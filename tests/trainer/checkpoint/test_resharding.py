"""A checkpoint written by 2 ranks restores into 1 and 3 ranks and other plans (table-,
row-, column-wise, data parallel), weights and optimizer states, bit for bit, with real
gloo groups; and a 3-rank checkpoint of the restored model restores the 2-rank original."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.trainer.sharding.test_sharded_embedding import TABLES, make_steps, plan_of
from tests.trainer.spawn import run_ranks
from neorec.trainer.checkpoint.checkpointer import Checkpointer
from neorec.trainer.checkpoint.restore import choose, restore_embeddings
from neorec.trainer.config import CheckpointConfig
from neorec.trainer.embedding.config import SparseOptimizer
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.sharding.plan import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_WISE
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection

CASES = {
    # element-wise state: exact between any plans, column-wise included
    "adagrad": (SparseOptimizer("adagrad", 0.1), [ROW_WISE, COLUMN_WISE, TABLE_WISE], [COLUMN_WISE, ROW_WISE, ROW_WISE]),
    # one state per shard row: exact from whole-width shards into any shards
    "rowwise_adagrad": (SparseOptimizer("rowwise_adagrad", 0.1), [ROW_WISE, TABLE_WISE, DATA_PARALLEL],
                        [COLUMN_WISE, ROW_WISE, TABLE_WISE]),
}


def _sum(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def _tables(optimizer: SparseOptimizer) -> dict:
    return {t.name: {"rows": t.num_embeddings, "dim": t.embedding_dim, "storage": "fp32", "optimizer": optimizer.kind,
                     "states": optimizer.num_states} for t in TABLES}


def _save(module, root: Path, rank: int, world: int, optimizer: SparseOptimizer) -> None:
    writer = Checkpointer(root, CheckpointConfig(mode="full", asynchronous=False), rank=rank, world_size=world,
                          attempt="test", views=module.shard_views, store=list, local_optimizer_steps=module.local_optimizer_steps,
                          tables=_tables(optimizer), run_config={}, plan=None, sum_over_ranks=_sum,
                          commit_timeout_s=60.0)
    writer.save(global_step=3, epoch=0, step_in_epoch=3, dense=None, wait=True)
    dist.barrier()


def _gathered(module: ShardedEmbeddingBagCollection) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    return {t.name: module.gather_table(t.name) for t in TABLES}


def train_and_save(rank: int, world: int, case: str, root: str) -> dict:
    optimizer, kinds, _ = CASES[case]
    module = ShardedEmbeddingBagCollection(TABLES, optimizer, plan_of(kinds, world), seed=1)
    for kjts, grad in make_steps(world, seed=4):
        out = module(kjts[rank])
        (out * grad[rank * out.shape[0] : (rank + 1) * out.shape[0]]).sum().backward()
    _save(module, Path(root), rank, world, optimizer)
    return _gathered(module)


def restore_and_save(rank: int, world: int, case: str, kinds: list[str], source: str, target: str | None) -> dict:
    optimizer = CASES[case][0]
    module = ShardedEmbeddingBagCollection(TABLES, optimizer, plan_of(kinds, world), seed=9)
    views = module.shard_views()
    restore_embeddings(choose(Path(source), views, agree=lambda ok: _sum([0.0 if ok else 1.0])[0] == 0.0,
                              fallback=False, need_dense=False), views)
    if target is not None:
        _save(module, Path(target), rank, world, optimizer)
    return _gathered(module)


def _assert_same_tables(got: dict, expected: dict) -> None:
    for name, (weight, states) in expected.items():
        assert torch.equal(got[name][0], weight), name
        assert all(torch.equal(a, b) for a, b in zip(got[name][1], states)), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_rank_checkpoints_restore_into_one_and_three_ranks_and_back(case, tmp_path):
    optimizer, source_kinds, other_kinds = CASES[case]
    original = run_ranks(train_and_save, 2, case, str(tmp_path / "two"))[0]

    single = FusedEmbeddingBagCollection(TABLES, optimizer, seed=9)  # one process, every table whole
    views = single.shard_views()
    restore_embeddings(choose(tmp_path / "two", views, agree=lambda ok: ok, fallback=False, need_dense=False), views)
    _assert_same_tables({t.name: (single.table_weight(t.name), single.table_state(t.name)) for t in TABLES},
                        {name: (w, [s.view_as(x) for s, x in zip(states, single.table_state(name))])
                         for name, (w, states) in original.items()})

    three = run_ranks(restore_and_save, 3, case, other_kinds, str(tmp_path / "two"), str(tmp_path / "three"))[0]
    _assert_same_tables(three, original)
    back = run_ranks(restore_and_save, 2, case, source_kinds, str(tmp_path / "three"), None)[0]
    _assert_same_tables(back, original)
