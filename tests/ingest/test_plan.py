import pytest

from ingest.plan import RowGroupInfo, plan_epoch

GROUPS = [RowGroupInfo(f, g, n) for f, sizes in enumerate([[700, 700, 301], [650, 90]]) for g, n in enumerate(sizes)]
TOTAL = sum(g.num_rows for g in GROUPS)


def _rows(plan):
    return [(r.file_index, r.row_group, i) for r in plan.ranges for i in range(r.start, r.stop)]


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
