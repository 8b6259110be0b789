"""The dynamic table's map and sketch against the plain-Python reference, and its edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from neorec.trainer.embedding.dynamic.admission import SATURATED, CountMinSketch
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from tests.trainer.dynamic.reference_map import ReferenceMap, ReferenceSketch


def zipf_batches(seed: int, batches: int, size: int, space: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(-2**63, 2**63 - 1, size=space, dtype=np.int64)
    return [keys[np.minimum(rng.zipf(1.3, size) - 1, space - 1)] for _ in range(batches)]


def table(capacity: int, min_count: int = 1, ttl: int = 0, width: int = 64, depth: int = 2,
          half_life: int = 0) -> DynamicTable:
    return DynamicTable("t", 0, 4, DynamicTableConfig(capacity=capacity, min_count=min_count, ttl=ttl,
                                                      sketch_width=width, sketch_depth=depth,
                                                      sketch_half_life=half_life))


@pytest.mark.parametrize("capacity,min_count,ttl,half_life", [
    (8, 1, 0, 0), (32, 2, 0, 0), (32, 3, 2, 0), (100, 2, 1, 0), (1, 1, 0, 0), (1, 2, 3, 0), (500, 1, 4, 0),
    (32, 2, 0, 1), (100, 3, 1, 4), (64, 2, 0, 7)])
def test_map_matches_the_reference(capacity: int, min_count: int, ttl: int, half_life: int) -> None:
    kernel = table(capacity, min_count, ttl, half_life=half_life)
    reference = ReferenceMap(capacity, min_count, ttl, half_life=half_life)
    for batch in zipf_batches(capacity + min_count + ttl, 40, 64, 300):
        slots, reinit = kernel.train_ids(batch)
        expected, expected_reinit = reference.train(batch.tolist())
        assert slots.tolist() == expected
        assert list(zip(reinit.slots.tolist(), reinit.generations.tolist())) == expected_reinit
    counters = kernel.counters()
    assert (counters["admitted"], counters["rejected"], counters["evicted"]) == \
        (reference.admitted, reference.rejected, reference.evicted)
    assert counters["live"] == len(reference.slot_of)
    assert counters["evicted"] > 0 or capacity == 500
    lookup = kernel.map.lookup(np.array(list(reference.slot_of), dtype=np.int64))
    assert lookup.tolist() == list(reference.slot_of.values())


def test_the_recency_queue_stays_bounded_and_exact_over_many_batches() -> None:
    """Stale queue entries are dropped before a batch that would not fit (many times here),
    the queue grows only for a batch longer than its room, and the LRU order stays exact."""
    kernel, reference = table(16, min_count=1, ttl=0), ReferenceMap(16, 1, 0)
    for batch in zipf_batches(9, 300, 24, 60):
        slots, reinit = kernel.train_ids(batch)
        assert (slots.tolist(), list(zip(reinit.slots.tolist(), reinit.generations.tolist()))) == \
            reference.train(batch.tolist())
        assert len(kernel.map.recency) <= 2 * (16 + 24)
    assert kernel.counters()["evicted"] > 100


def test_extreme_ids_are_ordinary_keys() -> None:
    ids = np.array([0, -1, 2**63 - 1, -2**63, 0, -1, 2**63 - 1], dtype=np.int64)
    kernel = table(4)
    slots, _ = kernel.train_ids(ids)
    assert slots.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert kernel.map.lookup(np.array([2**63 - 1, 5, -1], dtype=np.int64)).tolist() == [2, -1, 1]


def test_capacity_one_and_min_count_one() -> None:
    kernel = table(1)
    slots, reinit = kernel.train_ids(np.array([7, 7, 9], dtype=np.int64))
    assert slots.tolist() == [0, 0, -1]  # the only slot serves 7 in this batch: 9 reads zeros
    slots, reinit = kernel.train_ids(np.array([9], dtype=np.int64))
    assert slots.tolist() == [0] and reinit.slots.tolist() == [0] and reinit.generations.tolist() == [1]
    assert kernel.counters() == {"admitted": 2, "rejected": 1, "evicted": 1, "live": 1}


def test_min_count_admits_at_the_nth_sighting() -> None:
    kernel = table(8, min_count=3, width=1024)
    slots, _ = kernel.train_ids(np.array([5, 6, 5, 5, 6], dtype=np.int64))
    assert slots.tolist() == [-1, -1, -1, 0, -1]
    assert kernel.train_ids(np.array([6, 5], dtype=np.int64))[0].tolist() == [1, 0]


def test_evaluation_lookups_change_nothing() -> None:
    kernel = table(4, min_count=2)
    kernel.train_ids(np.array([1, 1, 2], dtype=np.int64))
    before = kernel.delta(full=True)
    assert kernel.map.lookup(np.array([1, 2, 3], dtype=np.int64)).tolist() == [0, -1, -1]
    after = kernel.delta(full=True)
    assert all(np.array_equal(before["map"][k], after["map"][k]) for k in before["map"])


def test_sketch_counts_never_below_the_truth_and_match_the_reference() -> None:
    sketch, reference = CountMinSketch(16, 3, 5), ReferenceSketch(16, 3, 5)
    truth: dict[int, int] = {}
    for key in zipf_batches(1, 1, 2000, 500)[0].tolist():
        truth[key] = truth.get(key, 0) + 1
        count = sketch.add(key)
        assert count == reference.add(key)
        assert count >= min(truth[key], SATURATED)


def test_halving_fades_old_sightings_and_marks_what_it_changed() -> None:
    """An id seen once a half-life never reaches ``min_count`` 2 (without decay, its second
    sighting admits it); an id seen twice within one is admitted. The halved counters are
    in the next incremental delta."""
    decaying, lasting = table(8, min_count=2, width=1024, half_life=2), table(8, min_count=2, width=1024)
    for step in range(6):
        ids = np.array([5] if step % 2 == 0 else [7, 7] if step == 3 else [], dtype=np.int64)
        decaying.train_ids(ids)
        lasting.train_ids(ids)
    assert decaying.map.lookup(np.array([5, 7])).tolist() == [-1, 0]
    assert lasting.map.lookup(np.array([5, 7])).tolist() == [0, 1]
    by_partition = DynamicTable("t", 0, 4, DynamicTableConfig(capacity=8, min_count=2, sketch_width=1024,
                                                              ttl_unit="partitions", sketch_half_life=1))
    for _ in range(3):  # steps do not move a partition clock: 5's count reaches 2 within a partition
        by_partition.train_ids(np.array([9], dtype=np.int64))
        by_partition.advance_partition()  # ... and halves at every partition's end
        by_partition.train_ids(np.array([5], dtype=np.int64))
        by_partition.train_ids(np.array([5], dtype=np.int64))
        by_partition.advance_partition()
    assert by_partition.map.lookup(np.array([9, 5])).tolist() == [-1, 0]
    sketch = CountMinSketch(4096, 2, 0)
    for key in range(3):
        sketch.add(key)
    sketch.delta(full=False)
    sketch.halve()
    changed = sketch.delta(full=False)
    assert 0 < changed["blocks"].size < sketch.dirty.size and not changed["values"].any()


def test_counts_of_wider_counters_restore_saturated() -> None:
    sketch = CountMinSketch(1024, 2, 0)
    sketch.apply({"blocks": np.array([0]), "values": np.full((1, 1024), 300, dtype=np.uint32)})
    assert sketch.counts.dtype == np.uint8 and int(sketch.counts[0].min()) == SATURATED


def test_partition_ttl_expires_only_at_partition_ends() -> None:
    kernel = DynamicTable("t", 0, 4, DynamicTableConfig(capacity=4, ttl=1, ttl_unit="partitions"))
    kernel.train_ids(np.array([1, 2], dtype=np.int64))
    for _ in range(5):
        kernel.train_ids(np.array([2], dtype=np.int64))
    assert kernel.counters()["evicted"] == 0
    kernel.advance_partition()
    assert kernel.counters()["evicted"] == 0  # unseen for one partition: still within its TTL
    kernel.advance_partition()
    assert kernel.counters()["evicted"] == 2 and kernel.map.lookup(np.array([1, 2])).tolist() == [-1, -1]


@pytest.mark.parametrize("half_life", [0, 3])
def test_restored_state_continues_identically(half_life: int) -> None:
    """(With a half-life, the chain's last increments are taken after halvings.)"""
    batches = zipf_batches(4, 30, 50, 400)
    original = table(64, min_count=2, ttl=3, width=1024, half_life=half_life)
    chain = []
    for i, batch in enumerate(batches[:20]):
        original.train_ids(batch)
        if i in (5, 14, 18, 19):
            chain.append(original.delta(full=(i == 5)))
    restored = table(64, min_count=2, ttl=3, width=1024, half_life=half_life)
    restored.apply(chain)
    for batch in batches[20:]:
        a, ra = original.train_ids(batch)
        b, rb = restored.train_ids(batch)
        assert a.tolist() == b.tolist() and ra.slots.tolist() == rb.slots.tolist()
    assert original.counters() == restored.counters()
    assert original.counters()["evicted"] > 0
    assert len(chain[3]["map"]["slots"]) < 64  # increments hold the changed slots only
    assert np.array_equal(original.sketch.counts, restored.sketch.counts)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="capacity"):
        DynamicTableConfig(capacity=0).validate()
    with pytest.raises(ValueError, match=r"min_count: must lie in \[1, 255\]"):
        DynamicTableConfig(capacity=3, min_count=256).validate()
    with pytest.raises(ValueError, match="sketch_width"):
        DynamicTableConfig(capacity=3, sketch_width=100).validate()
    with pytest.raises(ValueError, match="ttl_unit"):
        DynamicTableConfig(capacity=3, ttl_unit="hours").validate()
    with pytest.raises(ValueError, match="sketch_half_life: must be >= 0"):
        DynamicTableConfig(capacity=3, sketch_half_life=-1).validate()
