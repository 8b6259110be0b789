import pytest

from neorec.ingest.plan import plan_epoch
from neorec.ingest.rows import RowGroupInfo

GROUPS = [RowGroupInfo(f, g, n) for f, sizes in enumerate([[700, 700, 301], [650, 90]]) for g, n in enumerate(sizes)]
TOTAL = sum(g.num_rows for g in GROUPS)


def _rows(plan):
    return [tuple(row) for s in plan.spans for row in s.locations().tolist()]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("batch_size", [64, 100])
def test_drop_gives_equal_whole_batches_and_disjoint_rows(world_size, batch_size):
    plans = [plan_epoch(GROUPS, seed=7, epoch=1, rank=r, world_size=world_size, batch_size=batch_size)
             for r in range(world_size)]
    rows = [row for p in plans for row in _rows(p)]
    assert len(rows) == len(set(rows))
    assert {p.num_batches for p in plans} == {TOTAL // (world_size * batch_size)}
    for p in plans:
        assert p.num_rows == p.num_batches * batch_size
        assert p.dropped_rows == TOTAL - len(rows) < world_size * batch_size


@pytest.mark.parametrize("world_size", [1, 3])
def test_pad_reads_every_row_once(world_size):
    plans = [plan_epoch(GROUPS, seed=7, epoch=0, rank=r, world_size=world_size, batch_size=128, remainder="pad")
             for r in range(world_size)]
    rows = [row for p in plans for row in _rows(p)]
    assert len(rows) == len(set(rows)) == TOTAL
    assert sum(p.padded_samples for p in plans) == world_size * plans[0].num_batches * 128 - TOTAL


def test_order_depends_on_seed_and_epoch_only():
    def order(seed, epoch):
        return _rows(plan_epoch(GROUPS, seed=seed, epoch=epoch, rank=0, world_size=1, batch_size=10,
                                remainder="pad"))

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != order(1, 1)
    assert sorted(order(1, 0)) == sorted(order(2, 3))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size"):
        plan_epoch(GROUPS, seed=0, epoch=0, rank=0, world_size=1, batch_size=0)
    with pytest.raises(ValueError, match="rank 2"):
        plan_epoch(GROUPS, seed=0, epoch=0, rank=2, world_size=2, batch_size=8)
    with pytest.raises(ValueError, match="remainder"):
        plan_epoch(GROUPS, seed=0, epoch=0, rank=0, world_size=1, batch_size=8, remainder="keep")


def _group_of_rows(plan):
    return [(f, g) for f, g, _ in _rows(plan)]


def test_row_shuffle_mixes_rows_of_a_window_and_is_a_pure_function():
    def plan(seed, epoch, window=2):
        return plan_epoch(GROUPS, seed=seed, epoch=epoch, rank=0, world_size=1, batch_size=50, remainder="pad",
                          shuffle="rows", window=window)

    rows = _rows(plan(1, 0))
    assert sorted(rows) == sorted(_rows(plan(1, 0, window=0))) == sorted(_rows(plan(1, 1)))  # every row once
    assert len(rows) == len(set(rows)) == TOTAL
    assert rows == _rows(plan(1, 0)) != _rows(plan(1, 1))
    assert rows != _rows(plan(2, 0))
    windows = [s.window for s in plan(1, 0).spans]
    assert [len(w.groups) for w in windows] == [2, 2, 1] and all(w.permuted for w in windows)
    # the first 50 rows come from both row groups of the first window, not in file order
    first = rows[:50]
    assert len({(f, g) for f, g, _ in first}) == 2
    assert first != sorted(first)


def test_a_one_row_group_split_is_fully_shuffled_every_epoch():
    single = [RowGroupInfo(0, 0, 1000)]
    orders = [[r for _, _, r in _rows(plan_epoch(single, seed=3, epoch=e, rank=0, world_size=1, batch_size=100))]
              for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(1000))
        assert order != list(range(1000))
    assert orders[0] != orders[1] != orders[2]


def test_row_group_shuffle_and_file_order_keep_rows_in_file_order():
    in_order = _rows(plan_epoch(GROUPS, seed=1, epoch=0, rank=0, world_size=1, batch_size=10, remainder="pad",
                                shuffle="none"))
    assert in_order == sorted(in_order)
    by_group = _rows(plan_epoch(GROUPS, seed=1, epoch=0, rank=0, world_size=1, batch_size=10, remainder="pad",
                                shuffle="row_groups"))
    assert sorted(by_group) == in_order and by_group != in_order
    runs = [rows for rows in (by_group[i : i + 90] for i in range(0, len(by_group), 90))]
    assert all(rows == sorted(rows) for rows in runs if len({(f, g) for f, g, _ in rows}) == 1)


def test_auto_window_holds_a_few_hundred_thousand_rows():
    from neorec.ingest.plan import WINDOW_ROWS, auto_window

    assert auto_window([RowGroupInfo(0, g, 65_536) for g in range(10)]) == 4
    assert auto_window([RowGroupInfo(0, 0, 1_000_000)]) == 1
    assert auto_window([RowGroupInfo(0, g, 1000) for g in range(3)]) * 1000 >= WINDOW_ROWS


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_row_shuffled_batches_mix_many_row_groups(world_size):
    groups = [RowGroupInfo(f, g, 500) for f in range(2) for g in range(8)]
    for rank in range(world_size):
        plan = plan_epoch(groups, seed=5, epoch=2, rank=rank, world_size=world_size, batch_size=200,
                          shuffle="rows", window=4)
        task = plan.whole()
        for step in range(plan.num_batches):
            groups_in_batch = {(f, g) for s in task.batch_rows(step) for f, g, _ in s.locations().tolist()}
            assert len(groups_in_batch) >= 3  # 200 rows drawn from 4 groups of 500: all but surely >= 3
