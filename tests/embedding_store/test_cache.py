"""The set-associative cache: random admissions keep every row in exactly one slot of its
set; pinned rows are never evicted; 32-way LRU hits within a point of fully associative LRU
on skewed ids."""

from __future__ import annotations

import numpy as np
import pytest

from neorec.embedding_store.cache import SetAssociativeCache
from tests.embedding_store.reference import fully_associative_lru_hits


def test_random_admissions_keep_every_row_in_one_slot_of_its_set():
    rng = np.random.default_rng(1)
    cache = SetAssociativeCache(256, ways=8)
    for batch in range(1, 400):
        rows = np.unique(rng.zipf(1.3, 40) % 2000).astype(np.int64)
        slots, evicted, _, _ = cache.admit(rows, batch)
        placed = slots >= 0
        assert (cache.tags[slots[placed]] == rows[placed]).all()
        assert len(set(slots[placed].tolist())) == placed.sum()
        assert not set(evicted[evicted >= 0].tolist()) & set(rows.tolist())  # a batch never evicts its own rows
        tags = cache.tags[cache.tags >= 0]
        assert len(tags) == len(set(tags.tolist()))  # every cached row in exactly one slot
        lookup = cache.lookup(rows)
        assert (lookup[placed] == slots[placed]).all()
        assert (cache.pins[slots[placed]] == batch).all()
        sets = slots[placed] // cache.ways
        assert (sets == cache.lookup(rows[placed]) // cache.ways).all()


def test_a_set_full_of_the_batch_s_rows_overflows():
    cache = SetAssociativeCache(4, ways=4)  # one set
    slots, _, _, _ = cache.admit(np.arange(6, dtype=np.int64), batch=1)
    assert (slots >= 0).sum() == 4 and (slots < 0).sum() == 2
    assert cache.counters.overflows == 2


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.2])
def test_32_way_lru_is_within_a_point_of_exact_lru_on_zipf_ids(fraction):
    rows = 50_000
    ids = (np.random.default_rng(2).zipf(1.05, 150_000) - 1) % rows
    capacity = int(rows * fraction)
    exact = fully_associative_lru_hits(ids, capacity) / ids.size
    cache = SetAssociativeCache(capacity, ways=32, policy="lru")
    for batch, row in enumerate(ids.tolist(), 1):  # one id per batch: nothing pinned past its access
        cache.admit(np.array([row], dtype=np.int64), batch)
    ours = cache.counters.hits / ids.size
    assert exact > fraction + 0.1  # far above uniform ids' hit rate: the comparison says something
    assert abs(ours - exact) <= 0.01, (ours, exact)
