"""The flat-column kernels (:mod:`neorec.ingest.flat_columns`) against values read one by
one from Arrow (``to_pylist``): every integer and float width, nulls, sliced arrays, rows
picked from several arrays in any order (repeats included); and decoding through them
against the same rows decoded from a plain Python reading of the table."""

import math

import numpy as np
import pyarrow as pa
import pytest

from neorec.ingest.decoder import DecodeOptions, decode_table
from neorec.ingest.errors import DataError
from neorec.ingest.flat_columns import (Outputs, Part, RoutedPart, decodable, numbers_into, numbers_routed,
                                        single_ids, single_ids_routed)
from neorec.ingest.schema import DatasetSchema, SparseFeature

NUMERIC = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
           pa.float32(), pa.float64()]


def _array(rng: np.random.Generator, kind: pa.DataType, n: int, null_fraction: float) -> pa.Array:
    if pa.types.is_floating(kind):
        raw = rng.normal(0, 1e3, n)
    else:
        info = np.iinfo(kind.to_pandas_dtype())
        raw = rng.integers(max(info.min, -(1 << 40)), min(info.max, 1 << 40), n, endpoint=True)
    return pa.array(raw, type=kind, mask=rng.random(n) < null_fraction if null_fraction else None)


def _float32(value) -> float:
    return float(np.float32(value))


def _parts(rng: np.random.Generator, kind: pa.DataType, null_fraction: float, n: int):
    """Three arrays (one sliced) and a pick of ``n`` rows of them (repeats allowed) as
    parts; with the Python values the pick reads, in order."""
    arrays = [_array(rng, kind, 40, null_fraction), _array(rng, kind, 90, null_fraction).slice(13, 50),
              _array(rng, kind, 7, null_fraction)]
    starts = np.cumsum([0] + [len(a) for a in arrays])
    positions = rng.integers(0, starts[-1], n)
    flat = [v for a in arrays for v in a.to_pylist()]
    parts = []
    for g, array in enumerate(arrays):
        places = np.flatnonzero((positions >= starts[g]) & (positions < starts[g + 1]))
        order = np.argsort(positions[places], kind="stable")
        parts.append(Part(array, (positions[places][order] - starts[g]).astype(np.int64), places[order].astype(np.int64)))
    return parts, [flat[p] for p in positions]


@pytest.mark.parametrize("kind", NUMERIC, ids=str)
@pytest.mark.parametrize("null_fraction", [0.0, 0.3])
def test_numbers_read_in_order_and_picked_equal_arrows_values(kind, null_fraction):
    rng = np.random.default_rng(len(str(kind)))
    array = _array(rng, kind, 300, null_fraction).slice(17, 233)  # an offset into its buffers
    out = np.full((250, 3), 7.0, dtype=np.float32)[:233, 1]  # strided
    assert numbers_into([Part(array)], -2.5, out)
    assert out.tolist() == [-2.5 if v is None else _float32(v) for v in array.to_pylist()]
    parts, expected = _parts(rng, kind, null_fraction, 120)
    picked = np.zeros(120, dtype=np.float32)
    assert numbers_into(parts, -2.5, picked)
    assert picked.tolist() == [-2.5 if v is None else _float32(v) for v in expected]
    # clipped and shifted as numpy does it in float32, for log(1 + x) of the clipped value
    assert numbers_into(parts, -2.5, picked, clip_add_one=True)
    plain = np.array([-2.5 if v is None else _float32(v) for v in expected], dtype=np.float32)
    assert picked.tobytes() == np.add(np.maximum(plain, 0.0), np.float32(1.0)).tobytes()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e39])
@pytest.mark.parametrize("clip_add_one", [False, True])
def test_numbers_report_a_value_that_is_not_finite_before_clipping(bad, clip_add_one):
    """-inf clips to 0 and NaN compares false, so finiteness is judged before the clip;
    a float64 beyond float32's range is infinite once narrowed."""
    values = pa.array([1.0, -3.0, bad, 2.0], type=pa.float64())
    rows, places = np.array([3, 2, 0], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64)
    assert not numbers_into([Part(values)], 0.0, np.zeros(4, dtype=np.float32), clip_add_one)
    assert not numbers_into([Part(values, rows, places)], 0.0, np.zeros(3, dtype=np.float32), clip_add_one)
    assert numbers_into([Part(values, rows[[0]], places[[0]])], 0.0, np.zeros(1, dtype=np.float32), clip_add_one)


@pytest.mark.parametrize("kind", [k for k in NUMERIC if pa.types.is_integer(k)], ids=str)
@pytest.mark.parametrize("null_fraction", [0.0, 0.4, 1.0])
def test_ids_read_in_order_and_picked_equal_arrows_values_nulls_left_out(kind, null_fraction):
    """The count comes before the write, and the write fills exactly that many ids: the
    array it writes to ends where the ids do (an id more would land in the next feature's)."""
    rng = np.random.default_rng(3)
    array = _array(rng, kind, 200, null_fraction).slice(37, 150)
    values = array.to_pylist()
    parts, expected = _parts(rng, kind, null_fraction, 80)
    for parts, rows in (([Part(array)], values), (parts, expected)):
        flags = np.full(len(rows), 9, dtype=np.int32)
        count, write = single_ids(parts, flags)
        assert count == sum(v is not None for v in rows)
        out = np.full(count + 1, -1, dtype=np.int64)
        write(out[:count])
        assert flags.tolist() == [int(v is not None) for v in rows]
        assert out[:count].tolist() == [v for v in rows if v is not None]
        assert out[count] == -1


def _routed(rng: np.random.Generator, kind: pa.DataType, null_fraction: float, sizes: tuple[int, ...]):
    """Three arrays (one sliced, one without nulls) whose rows are routed to outputs of
    ``sizes`` rows (the rest dropped): the routed parts, the shift, and each output's
    Python values in order."""
    arrays = [_array(rng, kind, 40, null_fraction), _array(rng, kind, 90, null_fraction).slice(13, 50),
              _array(rng, kind, 30, 0.0)]
    flat = [v for a in arrays for v in a.to_pylist()]
    order = rng.permutation(len(flat))
    shift = max(sizes).bit_length()
    routes = np.full(len(flat), len(sizes) << shift, dtype=np.int32)
    picks, at = [], 0
    for k, size in enumerate(sizes):
        picks.append(order[at : at + size])
        routes[order[at : at + size]] = (k << shift) + np.arange(size)
        at += size
    bounds = np.cumsum([0] + [len(a) for a in arrays])
    parts = [RoutedPart(a, routes[lo:hi]) for a, lo, hi in zip(arrays, bounds[:-1], bounds[1:])]
    return parts, shift, [[flat[p] for p in pick] for pick in picks]


@pytest.mark.parametrize("kind", NUMERIC, ids=str)
@pytest.mark.parametrize("null_fraction", [0.0, 0.3])
def test_routed_numbers_land_in_their_outputs_as_arrows_values(kind, null_fraction):
    rng = np.random.default_rng(len(str(kind)) + 7)
    parts, shift, expected = _routed(rng, kind, null_fraction, (50, 33, 9))  # 28 of 120 rows dropped
    outs = [np.full(len(e), 7.0, dtype=np.float32) for e in expected]
    assert numbers_routed(parts, -2.5, Outputs(outs, shift))
    for out, values in zip(outs, expected):
        assert out.tolist() == [-2.5 if v is None else _float32(v) for v in values]
    assert numbers_routed(parts, -2.5, Outputs(outs, shift), clip_add_one=True)
    for out, values in zip(outs, expected):
        plain = np.array([-2.5 if v is None else _float32(v) for v in values], dtype=np.float32)
        assert out.tobytes() == np.add(np.maximum(plain, 0.0), np.float32(1.0)).tobytes()


def test_routed_numbers_judge_finiteness_only_of_the_rows_that_land():
    values = pa.array([1.0, np.nan, 2.0, -np.inf], type=pa.float64())
    out = np.zeros(2, dtype=np.float32)
    landing = np.array([1, 2, 0, 2], dtype=np.int32)  # shift 1: output 0 or dropped (2)
    assert numbers_routed([RoutedPart(values, landing)], 0.0, Outputs([out], 1))
    assert out.tolist() == [2.0, 1.0]
    assert not numbers_routed([RoutedPart(values, np.array([0, 1, 2, 2], dtype=np.int32))], 0.0, Outputs([out], 1))


@pytest.mark.parametrize("kind", [k for k in NUMERIC if pa.types.is_integer(k)], ids=str)
@pytest.mark.parametrize("null_fraction", [0.0, 0.4, 1.0])
def test_routed_ids_land_in_their_outputs_as_arrows_values_nulls_left_out(kind, null_fraction):
    rng = np.random.default_rng(5)
    parts, shift, expected = _routed(rng, kind, null_fraction, (40, 61))
    flags = [np.full(len(e), 9, dtype=np.int32) for e in expected]
    counts, write = single_ids_routed(parts, flags, shift)
    assert counts == [sum(v is not None for v in e) for e in expected]
    outs = [np.full(c + 1, -1, dtype=np.int64) for c in counts]
    write([out[:c] for out, c in zip(outs, counts)])
    for f, out, c, values in zip(flags, outs, counts, expected):
        assert f.tolist() == [int(v is not None) for v in values]
        assert out[:c].tolist() == [v for v in values if v is not None] and out[c] == -1


def test_outputs_are_contiguous_arrays_of_one_dtype():
    with pytest.raises(ValueError, match="1-D C-contiguous arrays of one dtype"):
        Outputs([np.zeros(4, dtype=np.float32), np.zeros(8, dtype=np.float32)[::2]], 2)
    with pytest.raises(ValueError, match="1-D C-contiguous arrays of one dtype"):
        Outputs([np.zeros(4, dtype=np.float32), np.zeros(4, dtype=np.int32)], 2)


def test_only_integer_and_32_and_64_bit_float_columns_are_read_by_the_kernels():
    assert all(decodable(k) for k in NUMERIC)
    assert not any(decodable(k) for k in (pa.float16(), pa.bool_(), pa.string(), pa.list_(pa.int64())))


SCHEMA = DatasetSchema(label="y", dense=("a", "b", "c"), sparse=(SparseFeature("s", 1000), SparseFeature("t", 10)))


def _table(rng: np.random.Generator, n: int) -> pa.Table:
    return pa.table({
        "y": pa.array(rng.integers(0, 2, n), type=pa.int8()),
        "a": pa.array(rng.integers(-5, 10**6, n), type=pa.int64(), mask=rng.random(n) < 0.3),
        "b": pa.array(rng.random(n) * 100, type=pa.float64()),
        "c": pa.array(rng.random(n).astype(np.float16), type=pa.float16(), mask=rng.random(n) < 0.2),
        "s": pa.array(rng.integers(0, 5000, n), type=pa.int32(), mask=rng.random(n) < 0.25),
        "t": pa.array(rng.integers(0, 10, n), type=pa.uint16()),
    })


def test_a_table_decodes_as_its_python_values_say():
    """Every column type the decoder reads, a float16 column (decoded by Arrow) among them,
    through a table in two chunks and sliced."""
    rng = np.random.default_rng(11)
    table = pa.concat_tables([_table(rng, 70), _table(rng, 50)]).slice(9, 100)
    batch = decode_table(table, SCHEMA, DecodeOptions(table_rows=(1000, 10)))
    rows = table.to_pylist()
    assert batch.labels.tolist() == [float(r["y"]) for r in rows]
    for j, name in enumerate(SCHEMA.dense):
        expected = [np.float32(math.log(1 + max(_float32(0.0 if r[name] is None else r[name]), 0.0))) for r in rows]
        np.testing.assert_allclose(batch.dense[:, j], expected, rtol=2e-7, atol=0)
    assert batch.lengths.tolist() == [int(r["s"] is not None) for r in rows] + [1] * len(rows)
    assert batch.values.tolist() == [r["s"] % 1000 for r in rows if r["s"] is not None] + [r["t"] for r in rows]


@pytest.mark.parametrize("column,value,message", [
    ("y", None, r"column 'y', row 4: missing value"),
    ("b", math.inf, r"column 'b', row 4: non-finite value inf"),
    ("b", math.nan, r"column 'b', row 4: non-finite value nan"),
])
def test_a_bad_value_found_by_the_kernels_is_named_by_its_row(column, value, message):
    rng = np.random.default_rng(5)
    table = _table(rng, 12)
    values = table.column(column).to_pylist()
    values[4] = value
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values, type=table.schema.field(column).type))
    with pytest.raises(DataError, match=message):
        decode_table(table, SCHEMA, DecodeOptions(table_rows=(1000, 10)))


LISTS = DatasetSchema(label="y", dense=(), sparse=(SparseFeature("s", 10), SparseFeature("m", 10, multi_hot=True),
                                                   SparseFeature("n", 10, multi_hot=True)))


@pytest.mark.parametrize("s,m,n,message", [
    ([-1, 2], [[1], [None]], [[1], [2]], r"column 's', row 0: negative id -1"),
    ([1, 2], [[11], [1, 12]], [[1], [None]], r"column 'm', row 0: id 11 is out of range"),
    ([1, 2], [[1], [None]], [[-4], [2]], r"column 'm', row 1: null id inside a list"),
])
def test_the_first_bad_feature_in_schema_order_is_named_when_several_are_bad(s, m, n, message):
    """List columns are sized before any feature is decoded; their errors still wait for
    their feature's turn."""
    table = pa.table({"y": pa.array([0, 1]), "s": pa.array(s), "m": pa.array(m, pa.list_(pa.int64())),
                      "n": pa.array(n, pa.list_(pa.int64()))})
    with pytest.raises(DataError, match=message):
        decode_table(table, LISTS, DecodeOptions(table_rows=(10, 10, 10), id_mapping="strict"))


UNSIGNED = [3, 2**63, 2**64 - 1]


def _unsigned_table() -> pa.Table:
    return pa.table({"y": pa.array([0, 1, 0]), "s": pa.array(UNSIGNED, pa.uint64()), "m": pa.array(
        [[v] for v in UNSIGNED], pa.list_(pa.uint64())), "n": pa.array([[1]] * 3, pa.list_(pa.int64()))})


def test_uint64_ids_of_2_63_and_above_are_mapped_as_unsigned_numbers():
    batch = decode_table(_unsigned_table(), LISTS, DecodeOptions(table_rows=(10, 1000, 10)))
    assert batch.values.tolist() == [v % 10 for v in UNSIGNED] + [v % 1000 for v in UNSIGNED] + [1] * 3


def test_a_uint64_id_out_of_range_is_named_as_its_unsigned_value():
    with pytest.raises(DataError, match=r"column 's', row 1: id 9223372036854775808 is out of range"):
        decode_table(_unsigned_table(), LISTS, DecodeOptions(table_rows=(10, 10, 10), id_mapping="strict"))


def test_an_array_whose_buffer_holds_more_bytes_than_its_values_decodes():
    array = pa.Array.from_buffers(pa.int32(), 2, [None, pa.py_buffer(np.array([5, 6], np.int32).tobytes() + b"\0")])
    out = np.zeros(2, dtype=np.float32)
    numbers_into([Part(array)], 0.0, out)
    assert out.tolist() == [5.0, 6.0]


def test_a_table_with_two_columns_of_one_name_is_refused_by_name():
    rng = np.random.default_rng(4)
    table = _table(rng, 5)
    table = pa.Table.from_arrays([*table.columns, table.column("b")], names=[*table.column_names, "b"])
    with pytest.raises(DataError, match=r"column 'b': 2 columns have this name"):
        decode_table(table, SCHEMA, DecodeOptions(table_rows=(1000, 10)))
