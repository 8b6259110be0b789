"""Dynamic tables in continuous training: raw-id partitions followed one after the other,
ids expiring once unseen for ``ttl`` whole partitions (at partition ends only)."""

from __future__ import annotations

from dataclasses import replace

from neorec.ingest.synth import partitioned_dataset, write_partition
from neorec.trainer.run.train import train
from tests.trainer.follow_helpers import SPEC, follow_config
from tests.trainer.run_records import records

RAW = replace(SPEC, rows=3_600, partitions=3, raw_ids=True, id_space=10**8)
"""Three partitions of 1,200 rows of raw ids."""


def test_partition_ttl_expires_ids_at_partition_ends(tmp_path):
    partitioned_dataset(RAW, tmp_path / "data")
    for index in range(RAW.partitions):
        write_partition(RAW, tmp_path / "data", index)
    dynamic = {f"t_C{i}": {"capacity": 4_000, "ttl": 1, "ttl_unit": "partitions"} for i in range(1, 27)}
    summary = train(follow_config(tmp_path / "data", tmp_path / "run", model={"dynamic": dynamic}))
    assert summary["partitions"] == 3
    trained = [r for r in records(tmp_path / "run", "train")]
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
