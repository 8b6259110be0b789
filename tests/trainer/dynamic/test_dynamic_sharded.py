"""Dynamic tables across ranks: a table's ids are split into map shards by hash, each an
independent map; one process holding every map shard and 2 ranks each holding some (their
raw ids routed to them by the Numba or the torch-ops router) take the same decisions, so the
maps, counters and weights are the same, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.shards import shard_of, shard_of_jit, shard_of_torch
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.sharding.plan import ROW_WISE, TABLE_WISE, Shard, ShardingPlan, TableSharding
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from tests.trainer.dynamic.reference_map import ReferenceMap
from tests.trainer.reference import concat_kjts
from tests.trainer.spawn import run_ranks

DIM, SEED, B, STEPS, WORLD = 4, 1, 6, 12, 2
EXTREMES = [0, -1, 2**63 - 1, -2**63]
OPTIMIZER = SparseOptimizer("adagrad", 0.3)


def dynamic_config(shards: int) -> DynamicTableConfig:
    """8 slots for about 40 distinct ids: admissions, rejections and evictions every step."""
    return DynamicTableConfig(capacity=8, min_count=2, ttl=3, sketch_width=64, sketch_depth=2, shards=shards)


def tables(shards: int) -> list[TableConfig]:
    return [TableConfig("d", dynamic_config(shards).rows, DIM, ("d1", "d2")), TableConfig("s", 20, DIM, ("s1",))]


def rank_batches(seed: int) -> list[list[KeyedJaggedTensor]]:
    """Per step, each rank's batch: multi-hot raw ids (Zipf over 40, extreme values among
    them, empty bags) for d1 and d2, one id of 20 rows for s1."""
    rng = np.random.default_rng(seed)
    space = np.array([*EXTREMES, *rng.integers(-2**62, 2**62, 36)], dtype=np.int64)
    steps = []
    for _ in range(STEPS):
        kjts = []
        for _ in range(WORLD):
            lengths = rng.integers(0, 4, 2 * B).astype(np.int32)
            raw = space[np.minimum(rng.zipf(1.3, int(lengths.sum())) - 1, space.size - 1)]
            kjts.append(KeyedJaggedTensor(("d1", "d2", "s1"),
                                          torch.from_numpy(np.concatenate([lengths, np.ones(B, np.int32)])),
                                          torch.from_numpy(np.concatenate([raw, rng.integers(0, 20, B)]))))
        steps.append(kjts)
    return steps


def plan(kind: str, shards: int) -> ShardingPlan:
    rows = dynamic_config(shards).rows
    d = (Shard(1, 0, rows, 0, DIM),) if kind == TABLE_WISE else \
        (Shard(0, 0, rows // 2, 0, DIM), Shard(1, rows // 2, rows // 2, 0, DIM))
    return ShardingPlan(WORLD, (TableSharding("d", kind, d), TableSharding("s", TABLE_WISE, (Shard(0, 0, 20, 0, DIM),))))


def gradient(step: int) -> torch.Tensor:
    """The upstream gradient of the global batch's output at ``step``."""
    return torch.linspace(-1, 1, WORLD * B * 3 * DIM).view(WORLD * B, 3 * DIM) * (1 + step % 3)


CASES = [(TABLE_WISE, 2, "auto"), (ROW_WISE, 2, "auto"), (ROW_WISE, 4, "auto"), (ROW_WISE, 2, "torch"),
         (ROW_WISE, 4, "torch")]


def single_process(shards: int, kernels: str, steps) -> dict:
    fused = FusedEmbeddingBagCollection(tables(shards), OPTIMIZER, seed=SEED, kernels=kernels)
    module = DynamicEmbeddings(fused, [DynamicTable("d", 0, DIM, dynamic_config(shards), s) for s in range(shards)],
                               SEED)
    outputs = []
    for step, kjts in enumerate(steps):
        out = module(concat_kjts(kjts))
        outputs.append(out.detach().clone())
        (out * gradient(step)).sum().backward()
    with torch.no_grad():
        outputs.append(module.eval()(concat_kjts(steps[0])))
    return {"outputs": torch.cat(outputs), "counters": module.counters(), "maps": module.dynamic_state(full=True),
            "tables": {t.name: (fused.table_weight(t.name), fused.table_state(t.name)) for t in fused.tables}}


def sharded(rank: int, world: int, steps) -> dict:
    results = {}
    for kind, shards, kernels in CASES:
        module = ShardedEmbeddingBagCollection(tables(shards), OPTIMIZER, plan(kind, shards), seed=SEED,
                                               kernels=kernels, dynamic={"d": dynamic_config(shards)})
        outputs = []
        for step, kjts in enumerate(steps):
            out = module(kjts[rank])
            outputs.append(out.detach().clone())
            (out * gradient(step)[rank * B : (rank + 1) * B]).sum().backward()
        with torch.no_grad():
            outputs.append(module.eval()(steps[0][rank]))
        results[(kind, shards, kernels)] = {
            "outputs": torch.cat(outputs), "counters": module.counters(), "maps": module.dynamic_state(full=True),
            "held": [t.shard for t in module.local.map_shards()] if isinstance(module.local, DynamicEmbeddings) else [],
            "tables": {t.name: module.gather_table(t.name) for t in module.tables}}
    return results


def test_two_ranks_make_the_single_process_decisions_and_weights() -> None:
    steps = rank_batches(seed=4)
    per_rank = run_ranks(sharded, WORLD, steps)
    for case in CASES:
        kind, shards, kernels = case
        expected = single_process(shards, kernels, steps)
        ranks = [per_rank[r][case] for r in range(WORLD)]
        counters = expected["counters"]["d"]
        assert counters["admitted"] > 8 and counters["rejected"] > 0 and counters["evicted"] > 0, case
        assert ranks[0]["counters"] == ranks[1]["counters"] == expected["counters"], case
        assert ranks[0]["maps"].keys() == expected["maps"].keys() == {f"d/{s}" for s in range(shards)}, case
        for key, state in expected["maps"].items():
            got = ranks[0]["maps"][key]
            assert got["clock"] == state["clock"], (case, key)
            for part in ("map", "sketch"):
                for name, value in state[part].items():
                    assert torch.equal(got[part][name], value), (case, key, part, name)
        held = [ranks[r]["held"] for r in range(WORLD)]
        assert held == ([[], list(range(shards))] if kind == TABLE_WISE else
                        [list(range(shards // 2)), list(range(shards // 2, shards))]), case
        for name, (weight, states) in expected["tables"].items():
            got_weight, got_states = ranks[0]["tables"][name]
            assert torch.equal(got_weight, weight), (case, name)
            assert all(torch.equal(g, w) for g, w in zip(got_states, states)), (case, name)
        got = torch.cat([torch.stack(r["outputs"].split(B)) for r in ranks], dim=1).flatten(0, 1)
        if kind == TABLE_WISE:
            assert torch.equal(got, expected["outputs"]), case
        else:  # a bag's rows on two ranks are summed in two parts
            torch.testing.assert_close(got, expected["outputs"], rtol=1e-6, atol=1e-6, msg=str(case))


def test_every_map_shard_decides_as_the_reference_map_of_its_ids() -> None:
    shards, capacity = 3, 9
    config = DynamicTableConfig(capacity=capacity, min_count=2, ttl=2, sketch_width=64, sketch_depth=2, shards=shards)
    fused = FusedEmbeddingBagCollection([TableConfig("d", config.rows, DIM, ("d1", "d2")),
                                         TableConfig("s", 20, DIM, ("s1",))], OPTIMIZER, seed=SEED)
    module = DynamicEmbeddings(fused, [DynamicTable("d", 0, DIM, config, s) for s in range(shards)], SEED)
    block = capacity // shards + 1
    references = [ReferenceMap(capacity // shards, 2, 2, config.sketch_columns(), 2, table=0) for _ in range(shards)]
    evicted = 0
    for kjts in rank_batches(seed=5):
        batch = concat_kjts(kjts)
        ids = batch.values[: int(batch.lengths[: 2 * WORLD * B].sum())].numpy()  # d1's bags, then d2's
        rows = module.remap(batch).values[: ids.size].numpy()
        shard = shard_of(ids, shards)
        expected = np.empty_like(rows)
        for s, reference in enumerate(references):
            slots, _ = reference.train(ids[shard == s].tolist())
            expected[shard == s] = [s * block + (slot if slot >= 0 else block - 1) for slot in slots]
        assert np.array_equal(rows, expected)
        evicted = sum(r.evicted for r in references)
    assert module.counters()["d"] == {"admitted": sum(r.admitted for r in references),
                                      "rejected": sum(r.rejected for r in references), "evicted": evicted,
                                      "live": sum(len(r.slot_of) for r in references)}
    assert evicted > 0 and all(len(r.slot_of) for r in references)


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_the_numpy_numba_and_torch_shard_functions_agree(shards: int) -> None:
    ids = np.array([*EXTREMES, *np.random.default_rng(0).integers(-2**63, 2**63 - 1, 1000)], dtype=np.int64)
    numpy_shards = shard_of(ids, shards)
    assert numpy_shards.min() >= 0 and numpy_shards.max() < shards
    assert np.array_equal(numpy_shards, [shard_of_jit(np.int64(i), np.int64(shards)) for i in ids])
    assert np.array_equal(numpy_shards, shard_of_torch(torch.from_numpy(ids), shards).numpy())
    if shards > 1:  # every shard gets a fair share
        assert np.bincount(numpy_shards, minlength=shards).min() > 1000 / shards / 2
