"""HostBatch.check: the first problem of a batch, named as a plain reading of the rules names it."""

from __future__ import annotations

import numpy as np
import pytest

from neorec.ingest.batch import HostBatch


def _reference_problem(keys, lengths, values, table_rows) -> str | None:
    """The rules read one at a time, in the order check promises."""
    num_f, size = len(keys), lengths.size // max(len(keys), 1)
    grid = lengths.reshape(num_f, size)
    for f in range(num_f):
        for b in range(size):
            if grid[f, b] < 0:
                return f"feature {keys[f]!r}, sample {b}: negative bag length {grid[f, b]}"
    if int(grid.sum()) != values.size:
        return f"bag lengths add up to {int(grid.sum())} ids, the batch holds {values.size}"
    position = 0
    for f in range(num_f):
        for _ in range(int(grid[f].sum())):
            if not 0 <= values[position] < table_rows[f]:
                return f"feature {keys[f]!r}: id {int(values[position])} is outside its table's rows [0, {table_rows[f]})"
            position += 1
    return None


def _batch(keys, lengths, values, size) -> HostBatch:
    return HostBatch(dense=np.zeros((size, 1), np.float32), labels=np.zeros(size, np.float32), keys=keys,
                     lengths=lengths, values=values)


@pytest.mark.parametrize("seed", range(60))
def test_check_names_the_first_problem_as_the_rules_read_in_order(seed):
    rng = np.random.default_rng(seed)
    num_f, size = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    keys = tuple(f"f{i}" for i in range(num_f))
    table_rows = [int(r) for r in rng.integers(1, 50, num_f)]
    lengths = rng.integers(0, 4, num_f * size).astype(np.int32)
    values = np.concatenate([rng.integers(0, table_rows[f], int(n)) for f, n in
                             enumerate(lengths.reshape(num_f, size).sum(axis=1))]).astype(np.int64)
    for _ in range(int(rng.integers(0, 3))):  # plant problems of any kind, anywhere
        kind = rng.integers(4)
        if kind == 0:
            lengths[rng.integers(lengths.size)] = -int(rng.integers(1, 3))
        elif kind == 1 and values.size:
            values = values[:-1]
        elif kind == 2:
            values = np.append(values, 0)
        elif values.size:
            values[rng.integers(values.size)] = rng.choice([-1, 10**9, max(table_rows)])
    expected = _reference_problem(keys, lengths, values, table_rows)
    batch = _batch(keys, lengths, values, size)
    if expected is None:
        batch.check(table_rows)
    else:
        with pytest.raises(ValueError) as raised:
            batch.check(table_rows)
        assert str(raised.value) == expected


def test_check_takes_wire_widths_and_read_only_arrays():
    lengths = np.array([1, 2, 0, 1], dtype=np.int32)
    values = np.array([3, 4, 5, 9], dtype=np.int64)
    lengths.flags.writeable = values.flags.writeable = False
    _batch(("a", "b"), lengths, values, 2).check([10, 10])
    with pytest.raises(ValueError, match=r"feature 'b': id 9 is outside its table's rows \[0, 9\)"):
        _batch(("a", "b"), lengths, values, 2).check([10, 9])
    _batch(("a", "b"), lengths.astype(np.int64), values.astype(np.uint32), 2).check([10, 10])


def test_a_bound_of_zero_takes_any_raw_id():
    lengths = np.array([1, 1, 1, 1], dtype=np.int32)
    values = np.array([-5, 1 << 62, 3, 7], dtype=np.int64)
    _batch(("a", "b"), lengths, values, 2).check([0, 8])
    with pytest.raises(ValueError, match=r"feature 'b': id 7 is outside its table's rows \[0, 5\)"):
        _batch(("a", "b"), lengths, values, 2).check([0, 5])


def test_check_of_no_features_and_no_samples():
    _batch((), np.zeros(0, np.int32), np.zeros(0, np.int64), 3).check([])
    _batch(("a",), np.zeros(0, np.int32), np.zeros(0, np.int64), 0).check([5])
    with pytest.raises(ValueError, match="bag lengths add up to 0 ids, the batch holds 1"):
        _batch((), np.zeros(0, np.int32), np.zeros(1, np.int64), 3).check([])
