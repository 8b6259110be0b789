"""The planner's parts alone (enumerate, estimate, assign, explain) and as a whole."""

from __future__ import annotations

import time

import numpy as np
import pytest

from neorec.trainer.planner.enumerate import Constraint, enumerate_options
from neorec.trainer.planner.estimate import estimate
from neorec.trainer.planner.inputs import TableSpec, Topology, format_bytes, parse_bytes
from neorec.trainer.planner.planner import plan_tables, round_robin
from neorec.trainer.planner.render import render
from neorec.trainer.sharding.plan import (COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE, PlanError,
                                   Shard, ShardingPlan, TableSharding)

GIB = 2**30


def kinds(options) -> list[str]:
    return [o.sharding_type for o in options]


# ------------------------------------------------------------------------------ enumerate
def test_every_sharding_type_is_enumerated():
    options = enumerate_options(TableSpec("t", 1000, 64), Topology(8, ranks_per_node=4))
    assert kinds(options).count(TABLE_WISE) == 1
    assert kinds(options).count(ROW_WISE) == 1
    assert sorted(len(o.shapes) for o in options if o.sharding_type == COLUMN_WISE) == [2, 4, 8]
    assert [o.ranks for o in options if o.sharding_type == TABLE_ROW_WISE] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert kinds(options).count(DATA_PARALLEL) == 1
    row_wise = next(o for o in options if o.sharding_type == ROW_WISE)
    assert sum(s.rows for s in row_wise.shapes) == 1000 and row_wise.ranks == tuple(range(8))


def test_one_rank_has_only_table_wise_and_narrow_tables_no_column_split():
    assert kinds(enumerate_options(TableSpec("t", 100, 64), Topology(1))) == [TABLE_WISE]
    assert COLUMN_WISE not in kinds(enumerate_options(TableSpec("t", 100, 6), Topology(4)))


def test_constraints_restrict_options_and_reject_nonsense():
    table, topo = TableSpec("t", 100, 16), Topology(4, group_size=2)
    assert [o.ranks for o in enumerate_options(table, topo, Constraint.parse("t", "table_wise:3"))] == [(3,)]
    assert [len(o.shapes) for o in enumerate_options(table, topo, Constraint.parse("t", "column_wise:4"))] == [4]
    assert [o.ranks for o in enumerate_options(table, topo, Constraint.parse("t", "table_row_wise:1"))] == [(2, 3)]
    for text, words in (("diagonal", "unknown sharding type"), ("row_wise:2", "takes no argument"),
                        ("table_wise:x", "must be a number")):
        with pytest.raises(PlanError, match=words):
            Constraint.parse("t", text)
    with pytest.raises(PlanError, match="outside world size 4"):
        enumerate_options(table, topo, Constraint.parse("t", "table_wise:9"))
    with pytest.raises(PlanError, match="cannot be sharded as column_wise:8 .*: column shards split the dimension"):
        enumerate_options(table, topo, Constraint.parse("t", "column_wise:8"))
    with pytest.raises(PlanError, match=r"table_row_wise on 2 ranks \(group size 2\): table_row_wise splits rows "
                                        r"within groups of more than one rank, and needs more than one group"):
        enumerate_options(table, Topology(2), Constraint.parse("t", "table_row_wise"))


# ------------------------------------------------------------------------------- estimate
def test_estimates_split_work_and_memory_as_the_sharding_does():
    # element-wise Adagrad state: column shards split it exactly (row-wise state is per shard, below)
    table, topo = TableSpec("t", 10_000, 64, pooling_factor=10.0, optimizer="adagrad"), Topology(4)
    options = {o.sharding_type: o for o in enumerate_options(table, topo)}
    whole = estimate(table, options[TABLE_WISE], topo, 512)
    rows = estimate(table, options[ROW_WISE], topo, 512)
    replicas = estimate(table, options[DATA_PARALLEL], topo, 512)
    assert whole.memory[0] == table.bytes() == pytest.approx(rows.memory.sum())
    assert rows.compute.sum() == pytest.approx(whole.compute[0])  # each id is looked up once
    assert rows.comm.sum() > whole.comm[0]  # but every shard sends partial sums for every bag
    assert list(replicas.memory) == [table.bytes()] * 4
    columns = estimate(table, next(o for o in enumerate_options(table, topo) if o.sharding_type == COLUMN_WISE),
                       topo, 512)
    assert columns.compute.sum() == pytest.approx(whole.compute[0])
    assert columns.comm.sum() > whole.comm[0]  # ids go to every column shard
    rowwise = TableSpec("t", 10_000, 64, pooling_factor=10.0)
    column_option = next(o for o in enumerate_options(rowwise, topo) if o.sharding_type == COLUMN_WISE)
    assert estimate(rowwise, column_option, topo, 512).compute.sum() > estimate(
        rowwise, options[TABLE_WISE], topo, 512).compute[0]  # each column shard keeps its own row state


def test_state_and_precision_change_memory():
    rowwise = TableSpec("t", 1000, 64)
    assert rowwise.bytes() == 1000 * (64 * 4 + 4 + 1)
    assert TableSpec("t", 1000, 64, optimizer="adam").bytes() == 1000 * (64 * 4 + 2 * 64 * 4 + 1)
    assert TableSpec("t", 1000, 64, weight_bytes=2).bytes() == 1000 * (64 * 2 + 4 + 1)
    assert parse_bytes("16GiB") == 16 * GIB and parse_bytes("512MB") == 512 * 10**6
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


# --------------------------------------------------------------------------------- assign
def skewed_tables() -> list[TableSpec]:
    """Three hot multi-hot tables and 23 small one-hot ones."""
    return [TableSpec(f"t{i}", 5_000_000 if i < 3 else 100_000, 64, pooling_factor=20.0 if i < 3 else 1.0)
            for i in range(26)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_plan_places_every_table_once_and_beats_round_robin(world):
    tables = skewed_tables()
    topo = Topology(world, memory_per_rank=8 * GIB)
    result = plan_tables(tables, topo, 4096)
    placed = [t.table for t in result.plan.tables]
    assert sorted(placed) == sorted(t.name for t in tables) and len(placed) == len(set(placed))
    result.plan.validate({t.name: (t.rows, t.dim) for t in tables})
    baseline = round_robin(tables, topo, 4096)
    assert result.step_seconds < baseline.step_seconds
    assert (result.memory <= topo.memory_per_rank).all()
    assert "estimated step (slowest rank)" in render(result, baseline)


def test_overrides_are_honoured():
    tables = skewed_tables()[:6]
    result = plan_tables(tables, Topology(4, group_size=2), 512, {
        "t0": Constraint.parse("t0", "table_wise:3"), "t1": Constraint.parse("t1", "data_parallel"),
        "t2": Constraint.parse("t2", "table_row_wise:0"), "t3": Constraint.parse("t3", "column_wise:2"),
    })
    assert result.plan.of("t0").ranks == (3,)
    assert result.plan.of("t1").ranks == (0, 1, 2, 3)
    assert result.plan.of("t2").sharding_type == TABLE_ROW_WISE and result.plan.of("t2").ranks == (0, 1)
    assert len(result.plan.of("t3").shards) == 2
    with pytest.raises(PlanError, match="tables the model does not have: nope"):
        plan_tables(tables, Topology(2), 512, {"nope": Constraint.parse("nope", "row_wise")})


def test_thousand_tables_on_128_ranks_are_planned_better_than_round_robin():
    rng = np.random.default_rng(0)
    tables = [TableSpec(f"t{i}", int(rng.integers(1_000, 5_000_000)), int(rng.choice([16, 32, 64, 128])),
                        pooling_factor=float(rng.choice([1, 5, 20]))) for i in range(1000)]
    topo = Topology(128, ranks_per_node=8, memory_per_rank=16 * GIB)
    started = time.process_time()
    result = plan_tables(tables, topo, 4096)
    elapsed = time.process_time() - started
    # a guard against a search that grows out of hand (about 2 s of CPU on a 2-core
    # machine), not a benchmark: shared machines drift by tens of percent
    assert elapsed < 10.0, f"planning took {elapsed:.2f} s of CPU"
    assert len(result.plan.tables) == 1000
    assert result.step_seconds < round_robin(tables, topo, 4096).step_seconds


# -------------------------------------------------------------------------------- explain
def test_a_table_too_big_for_one_rank_is_explained():
    big = TableSpec("huge", 40_000_000, 128)  # ~20 GiB with its state
    with pytest.raises(PlanError) as err:
        plan_tables([big, TableSpec("small", 10, 8)], Topology(4, memory_per_rank=16 * GIB), 512,
                    {"huge": Constraint.parse("huge", "table_wise")})
    message = str(err.value)
    assert "table 'huge'" in message and "does not fit" in message
    assert "the config forces it to be table_wise" in message
    assert "row-wise over 4 ranks" in message and "which fits" in message
    assert "fp16 weights" in message and "embedding store" in message
    # without the override the planner finds the row-wise plan itself
    assert plan_tables([big], Topology(4, memory_per_rank=16 * GIB), 512).plan.of("huge").sharding_type in (
        ROW_WISE, COLUMN_WISE)


def test_tables_too_big_for_all_ranks_are_explained():
    tables = [TableSpec(f"t{i}", 20_000_000, 128) for i in range(4)]
    with pytest.raises(PlanError, match=r"the 4 tables need .* but 2 ranks x 16.00 GiB hold 32.00 GiB"):
        plan_tables(tables, Topology(2, memory_per_rank=16 * GIB), 512)


def test_a_table_s_own_store_fraction_and_a_dynamic_table_s_id_map_are_counted_as_placed():
    from neorec.trainer.embedding.dynamic.config import DynamicTableConfig

    tables = [TableSpec(f"t{i}", 20_000_000, 128) for i in range(4)]
    on_store = {f"t{i}": Constraint(None, cache_fraction=0.1) for i in range(4)}  # ~1 GiB of each in memory
    assert plan_tables(tables, Topology(2, memory_per_rank=16 * GIB), 512, on_store).plan.of("t0")
    dynamic = TableSpec("d", 200_000_000, 16, dynamic=DynamicTableConfig(capacity=200_000_000, shards=1))
    with pytest.raises(PlanError) as err:
        plan_tables([dynamic], Topology(1, memory_per_rank=16 * GIB, store_fraction=0.01), 512)
    message = str(err.value)
    assert f"its id map and admission sketch {format_bytes(dynamic.index_bytes)} of that" in message
    assert "Options: a smaller model.dynamic.d.capacity" in message
    # the map counts on the store too: what is named is what is counted
    assert f"the largest is 'd' ({format_bytes(200_000_000 // 100 * dynamic.row_bytes(16) + dynamic.index_bytes)}" \
           f" on the store" in message


# ---------------------------------------------------------------------------- plan checks
def test_plan_validation_catches_dropped_repeated_and_torn_tables():
    shapes = {"a": (10, 4), "b": (10, 4)}
    whole = TableSharding("a", TABLE_WISE, (Shard(0, 0, 10, 0, 4),))
    with pytest.raises(PlanError, match="does not place: b"):
        ShardingPlan(2, (whole,)).validate(shapes)
    with pytest.raises(PlanError, match="more than once: a"):
        ShardingPlan(2, (whole, whole)).validate(shapes)
    torn = TableSharding("b", ROW_WISE, (Shard(0, 0, 4, 0, 4), Shard(1, 5, 5, 0, 4)))
    with pytest.raises(PlanError, match="must tile its 10 rows"):
        ShardingPlan(2, (whole, torn)).validate(shapes)
    plan = ShardingPlan(2, (whole, TableSharding("b", DATA_PARALLEL, (Shard(0, 0, 10, 0, 4), Shard(1, 0, 10, 0, 4)))))
    plan.validate(shapes)
    assert ShardingPlan.from_dict(plan.to_dict()) == plan


# -------------------------------------------------------------------------- the store tier
def test_tables_memory_cannot_hold_go_to_the_store_the_rest_stay():
    tables = [TableSpec(f"big{i}", 10_000_000, 64) for i in range(4)] + [TableSpec("small", 1000, 64)]
    topology = Topology(2, memory_per_rank=4 * GIB, store_fraction=0.1)
    result = plan_tables(tables, topology, 4096)
    on_store = result.plan.on_store()
    assert on_store and set(on_store) <= {"big0", "big1", "big2", "big3"} and "small" not in on_store
    assert all(fraction == 0.1 for fraction in on_store.values())
    assert (result.memory <= 4 * GIB).all()
    in_memory = plan_tables(tables, Topology(2, memory_per_rank=64 * GIB, store_fraction=0.1), 4096)
    assert not in_memory.plan.on_store()  # the store costs time: not chosen when memory suffices
    assert result.step_seconds > in_memory.step_seconds
    assert "store, 1,000,000 cached" in render(result)


def test_the_store_estimate_counts_misses_from_the_sampled_id_counts():
    skewed = TableSpec("t", 100_000, 64, id_counts=(1000,) * 100 + (1,) * 10_000)
    uniform = TableSpec("t", 100_000, 64)
    topology = Topology(1, store_fraction=0.01)
    store = next(o for o in enumerate_options(skewed, topology) if o.cache_fraction is not None)
    assert skewed.hit_rate(0.01) > 0.9 and uniform.hit_rate(0.01) == pytest.approx(0.01)
    memory = estimate(skewed, next(o for o in enumerate_options(skewed, topology) if o.cache_fraction is None),
                      topology, 1024)
    assert estimate(skewed, store, topology, 1024).memory.sum() < memory.memory.sum() / 50
    assert estimate(uniform, store, topology, 1024).compute.sum() > estimate(skewed, store, topology, 1024).compute.sum()


def test_a_config_constraint_puts_a_table_on_the_store_with_its_cache():
    tables = [TableSpec("a", 50_000, 16), TableSpec("b", 50_000, 16)]
    result = plan_tables(tables, Topology(2), 512, {"a": Constraint("row_wise", cache_fraction=0.05)})
    assert result.plan.on_store() == {"a": 0.05}
    assert result.plan.of("a").sharding_type == ROW_WISE
