"""The planner sizes a dynamic table by its capacity, counts its id maps and sketches (one
per map shard), shards it only so that each map shard's rows lie on one rank, and ``neorec
plan`` explains it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.common.errors import UserError
from neorec.trainer.config import ConfigError, TrainConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.planner.from_config import plan_for_config
from neorec.trainer.planner.render import render
from neorec.trainer.run.build import check_dynamic_plan
from neorec.trainer.sharding.plan import Shard, ShardingPlan, TableSharding
from tests.cli import neorec_in_process


@pytest.fixture(scope="module")
def raw_dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return generate(SynthSpec(rows=600, row_group_rows=300, seed=5, raw_ids=True, id_space=10**8),
                    tmp_path_factory.mktemp("raw"))


def test_dynamic_tables_are_planned_by_capacity_with_their_map(raw_dataset: Dataset) -> None:
    dynamic = {f.table: {"capacity": 1000 + 2 * i, "min_count": 2, "ttl": 5, "sketch_width": 4096}
               for i, f in enumerate(raw_dataset.schema.sparse)}
    config = TrainConfig.from_dict({"data": {"path": str(raw_dataset.root)},
                                    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "dynamic": dynamic}})
    result = plan_for_config(raw_dataset, config, 2)  # shards 0: one map shard per rank
    specs = {t.name: t for t in result.tables}
    assert {name: spec.rows for name, spec in specs.items()} == {name: d["capacity"] + 2 for name, d in dynamic.items()}
    resolved = replace(config.model.dynamic["t_C1"], shards=2)
    maps = [DynamicTable("t_C1", 0, 8, resolved, shard) for shard in range(2)]
    assert specs["t_C1"].index_bytes == sum(t.map.nbytes + t.sketch.counts.nbytes for t in maps)
    total_rows_bytes = sum(t.rows * t.row_bytes(t.dim) for t in result.tables)
    total_index = sum(t.index_bytes for t in result.tables)
    assert sum(result.memory) == pytest.approx(total_rows_bytes + total_index)
    assert {t.sharding_type for t in result.plan.tables} <= {"table_wise", "row_wise", "table_row_wise"}
    text = render(result)
    assert "dynamic tables" in text
    assert ("t_C1: capacity 1,000 rows, 2 map shards of 500 slots, min_count 2, ttl 5 steps, LRU when full; "
            "admission sketch 4 x 2,048 counters a map shard") in text
    narrow = replace(config.model.dynamic["t_C1"], shards=2, sketch_width=256).describe()
    assert narrow.endswith("admission sketch 4 x 128 counters a map shard (fewer than its slots: ids share counters "
                           "and reach min_count early)")
    halving = replace(config.model.dynamic["t_C1"], sketch_half_life=10).describe()
    assert halving.endswith("admission sketch 4 x 4,096 counters a map shard, halved every 10 steps")


@pytest.mark.parametrize("kind", ["column_wise", "data_parallel"])
def test_a_dynamic_table_is_never_split_by_columns_or_replicated(raw_dataset: Dataset, kind: str) -> None:
    dynamic = {f.table: {"capacity": 64} for f in raw_dataset.schema.sparse}
    config = TrainConfig.from_dict({"data": {"path": str(raw_dataset.root)},
                                    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "dynamic": dynamic},
                                    "sharding": {"tables": {"t_C1": kind}}})
    with pytest.raises(ConfigError, match=f"^sharding.tables.t_C1: t_C1 is a dynamic table, .*not {kind}$"):
        plan_for_config(raw_dataset, config, 2)


def test_a_plan_must_keep_each_map_shard_on_one_rank_in_memory(raw_dataset: Dataset) -> None:
    config = TrainConfig.from_dict({"data": {"path": str(raw_dataset.root)},
                                    "model": {"dynamic": {"t_C1": {"capacity": 8, "shards": 2}}}})
    rows, dim = config.model.dynamic["t_C1"].rows, config.model.embedding_dim  # 2 map shards of 4 slots + 1
    row_wise = (Shard(0, 0, 5, 0, dim), Shard(1, 5, 5, 0, dim))

    def plan(kind: str, shards: tuple[Shard, ...], cache_fraction: float | None = None) -> ShardingPlan:
        return ShardingPlan(2, (TableSharding("t_C1", kind, shards, cache_fraction),))

    check_dynamic_plan(plan("row_wise", row_wise), config)
    check_dynamic_plan(plan("table_wise", (Shard(1, 0, rows, 0, dim),)), config)
    with pytest.raises(ConfigError, match=r"^model.dynamic.t_C1: a dynamic table is sharded table_wise, row_wise, "
                                          r"table_row_wise; the plan makes it column_wise"):
        check_dynamic_plan(plan("column_wise", (Shard(0, 0, rows, 0, dim // 2), Shard(1, 0, rows, dim // 2, dim // 2))),
                           config)
    with pytest.raises(ConfigError, match=r"^model.dynamic.t_C1.shards: the plan's 2 row_wise shards cut its 2 map "
                                          r"shards of 5 rows"):
        check_dynamic_plan(plan("row_wise", (Shard(0, 0, 4, 0, dim), Shard(1, 4, 6, 0, dim))), config)
    with pytest.raises(ConfigError, match=r"^embedding_store.tables: dynamic tables train beside store tables in one "
                                          r"process only; with 2 ranks keep every table in memory"):
        check_dynamic_plan(plan("row_wise", row_wise, 0.5), config)


@pytest.mark.parametrize("cache_fraction", [0.25, 0.0])
def test_one_process_refuses_sketches_beyond_its_memory_as_the_plan_does(raw_dataset: Dataset, tmp_path,
                                                                         cache_fraction: float) -> None:
    """An admission sketch of 2**40 counters a row (4 TiB): named before it is allocated,
    as ``neorec plan`` names it, whether or not tables may go to the store."""
    from neorec.trainer.run.train import train

    config = TrainConfig.from_dict({
        "data": {"path": str(raw_dataset.root)},
        "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1],
                  "dynamic": {f.table: {"capacity": 64} for f in raw_dataset.schema.sparse}
                  | {"t_C1": {"capacity": 64, "min_count": 5, "sketch_width": 2**40}}},
        "train": {"batch_size": 64}, "embedding_store": {"cache_fraction": cache_fraction},
        "run": {"dir": str(tmp_path / "run")}})
    with pytest.raises(UserError, match="4.00 TiB"):
        train(config)


def test_what_the_ranks_would_refuse_is_one_line_before_they_start(raw_dataset: Dataset, tmp_path) -> None:
    """``neorec train --nproc 2`` finds a dynamic table that cannot shard, a plan that puts
    dynamic tables beside store tables, and a split the dataset lacks before torchrun
    starts (one line, no rank's copy, no torchrun report); ``neorec plan`` refuses the plan
    the ranks would."""
    tables = "".join(f"[model.dynamic.{f.table}]\ncapacity = 300\n" for f in raw_dataset.schema.sparse)
    config = tmp_path / "c.toml"
    config.write_text(f"[data]\npath = '{raw_dataset.root}'\n[model]\nembedding_dim = 8\nbottom_mlp = [16, 8]\n{tables}"
                      f"[run]\ndir = '{tmp_path / 'run'}'\n")
    for setting, said in (("model.dynamic.t_C1.capacity=301", "model.dynamic.t_C1.capacity: 301 rows do not split"),
                          ("embedding_store.tables.t_C2=0.1", "dynamic tables train beside store tables in one"),
                          ("data.eval_split='nosuch'", "the dataset has no split 'nosuch'")):
        refused = neorec_in_process("train", config, "--nproc", "2", "--set", setting)
        assert refused.returncode == 2 and refused.stderr.count("neorec: error:") == 1, refused.stderr
        assert said in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert not (tmp_path / "run").exists()  # no rank started
    planned = neorec_in_process("plan", config, "--world-size", "2", "--set", "embedding_store.tables.t_C2=0.1")
    assert planned.returncode == 2 and "dynamic tables train beside store tables" in planned.stderr, planned.stderr
    assert neorec_in_process("plan", config, "--world-size", "1", "--set", "embedding_store.tables.t_C2=0.1"
                             ).returncode == 0  # one process trains them beside store tables


def test_a_follower_started_before_its_first_partition_is_not_refused_before_its_ranks(tmp_path) -> None:
    """The ranks of a following run plan once a partition lands; the check before them
    must not ask for a partition to sample."""
    from neorec.ingest.synth import partitioned_dataset
    from neorec.trainer.planner.from_config import check_before_ranks

    empty = partitioned_dataset(SynthSpec(rows=600, partitions=2, raw_ids=True, id_space=10**8), tmp_path / "d")
    config = TrainConfig.from_dict({"data": {"path": str(empty.root), "follow": True},
                                    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8],
                                              "dynamic": {f.table: {"capacity": 64} for f in empty.schema.sparse}}})
    check_before_ranks(empty, config, 2, 2)
