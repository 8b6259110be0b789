"""The shuffle permutation: the indices in the order of their hashes, sorted in linear time."""

import numpy as np
import pytest

from neorec.common.hashing import GOLDEN, MAX_BUCKET, SALT, _argsort_spread, permutation, splitmix64


def _by_numpy(key: int, n: int) -> np.ndarray:
    salted = np.uint64(((key & (2**64 - 1)) * GOLDEN + SALT) & (2**64 - 1))
    return np.argsort(splitmix64(np.arange(n, dtype=np.uint64) ^ salted))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 1000, 4097, 65536, 262_144 + 3])
@pytest.mark.parametrize("key", [0, 1, 99, 2**63 + 5])
def test_permutation_is_the_hash_order_numpy_gives(n, key):
    order = permutation(key, n)
    assert order.dtype == np.int64 and np.array_equal(order, _by_numpy(key, n))
    assert np.array_equal(np.sort(order), np.arange(n))


def test_keys_that_crowd_one_bucket_are_still_sorted():
    rng = np.random.default_rng(3)
    crowded = np.arange(10 * MAX_BUCKET, dtype=np.uint64)  # all in the lowest bucket
    edges = np.array([2**64 - 1, 0, 2**63, 5, 2**63 - 1], dtype=np.uint64)
    spread = np.unique(rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64, endpoint=True))
    a_few_per_bucket = np.concatenate([spread, spread[::7] + np.uint64(1)])  # neighbours share buckets
    for keys in (crowded, edges, spread, np.unique(a_few_per_bucket)):
        keys = rng.permutation(keys)
        assert np.array_equal(_argsort_spread(keys), np.argsort(keys))


@pytest.mark.parametrize("n", [1000, 262_144])
def test_a_windows_hashes_spread_over_the_buckets_so_the_linear_sort_runs(n):
    """The bucket sort gives up for np.argsort when a bucket holds more than MAX_BUCKET
    keys; the hashes of permutation never come near that."""
    keys = splitmix64(np.arange(n, dtype=np.uint64) ^ np.uint64(SALT))
    bits = int(np.ceil(np.log2(n)))
    assert np.bincount((keys >> np.uint64(64 - bits)).astype(np.int64)).max() <= MAX_BUCKET // 4
