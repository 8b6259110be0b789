"""Dynamic tables in continuous training: raw-id partitions followed one after the other,
ids expiring once unseen for ``ttl`` whole partitions (at partition ends only)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from neorec.ingest.synth import partitioned_dataset, write_partition
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import DistributedContext
from neorec.trainer.run.train import train
from neorec.trainer.embedding.dynamic.id_map import LIVE
from tests.trainer.dynamic.test_dynamic_training import map_state
from tests.trainer.follow_helpers import SPEC, follow_config
from tests.trainer.run_records import records
from tests.trainer.spawn import run_ranks

RAW = replace(SPEC, rows=3_600, partitions=3, raw_ids=True, id_space=10**8)
"""Three partitions of 1,200 rows of raw ids."""


def followed(tmp_path, **dynamic: int | str) -> TrainConfig:
    """A follow run over :data:`RAW`'s three partitions (all written) with every table
    dynamic: 4,000 slots, ids expiring after a whole partition unseen, ``dynamic`` besides."""
    partitioned_dataset(RAW, tmp_path / "data")
    for index in range(RAW.partitions):
        write_partition(RAW, tmp_path / "data", index)
    tables = {f"t_C{i}": {"capacity": 4_000, "ttl": 1, "ttl_unit": "partitions", **dynamic} for i in range(1, 27)}
    return follow_config(tmp_path / "data", tmp_path / "run", model={"dynamic": tables})


def test_partition_ttl_expires_ids_at_partition_ends(tmp_path):
    reports = []
    summary = train(followed(tmp_path), progress=reports.append)
    assert_expiry_at_partition_ends(tmp_path / "run", summary)
    waiting = [r for r in reports if r.phase == "waiting"]  # after the third partition, until idle_exit_s
    assert waiting and all(r.global_step == summary["steps"] for r in waiting)
    assert waiting[-1].dynamic == {table: {key: summary["dynamic"][table][key] for key in counts}
                                   for table, counts in waiting[-1].dynamic.items()}  # the counters stay shown
    assert waiting[-1].dynamic.keys() == summary["dynamic"].keys()
    assert waiting[-1].last_checkpoint and waiting[-1].loss > 0  # and so do the newest checkpoint and the loss


def train_on_rank(rank: int, world: int, config: TrainConfig) -> dict:
    return train(config, context=DistributedContext(rank, world, world, rank))


@pytest.mark.slow
def test_two_ranks_expire_at_partition_ends_and_count_every_map_shard(tmp_path):
    """Following on 2 ranks, each holding one map shard of every table: the partition ends
    reach both ranks' maps, and the counters in the records and summary are the sums of the
    two shards' (the same on both ranks)."""
    summaries = run_ranks(train_on_rank, 2, followed(tmp_path, shards=2))
    assert summaries[0]["dynamic"] == summaries[1]["dynamic"]
    assert_expiry_at_partition_ends(tmp_path / "run", summaries[0])
    shards = map_state(tmp_path / "run")[-1]  # the final checkpoint's increment: both ranks' map shards
    live = [int(shards[f"t_C3/{s}"]["map"]["stats"][LIVE]) for s in range(2)]
    assert min(live) > 0 and sum(live) == summaries[0]["dynamic"]["t_C3"]["live"]


def assert_expiry_at_partition_ends(run_dir, summary: dict) -> None:
    """The run's train records show no expiry while a partition trains, expiry at the
    second and third partitions' ends, and live = admitted - evicted."""
    assert summary["partitions"] == 3
    trained = [r for r in records(run_dir, "train")]
    by_partition: dict[str, list[dict]] = {}
    for line in trained:
        by_partition.setdefault(line["partition"], []).append(line["dynamic"]["t_C3"])
    first, second, third = (by_partition[name] for name in sorted(by_partition))
    assert all(c["evicted"] == 0 and c["live"] == c["admitted"] for c in first + second)
    # the second partition's end: the ids last seen in the first had a whole partition unseen
    expired = third[0]["evicted"]
    assert expired > 0 and all(c["evicted"] == expired for c in third)  # none while a partition trains
    final = summary["dynamic"]["t_C3"]  # the third partition's end: the second's ids unseen in it left
    assert final["evicted"] > expired and final["live"] == final["admitted"] - final["evicted"]
