"""The Numba kernels' building blocks against torch: half-precision conversions (every
fp16/bf16 bit pattern, nearest and stochastic rounding, the vectorized row encoder) and the
radix sort that groups a batch's ids by row."""

import numba
import numpy as np
import pytest
import torch

from neorec.trainer.embedding.kernels import precision as precision_module
from neorec.trainer.embedding.kernels.backward import RADIX_MIN_IDS, group_by_row
from neorec.trainer.embedding.kernels.precision import BF16, FP16, decode, decode_row, encode, encode_row, noise_of
from neorec.trainer.embedding.kernels.torch_ops import Rounding, _round

DTYPES = {FP16: torch.float16, BF16: torch.bfloat16}


@numba.njit
def _decode_all(bits, precision, out):
    for i in range(bits.shape[0]):
        out[i] = decode(bits[i], precision)


@numba.njit
def _decode_rows(bits, precision, out):
    for r in range(bits.shape[0]):
        decode_row(bits[r], out[r], bits.shape[1], precision)


@numba.njit
def _encode_all(values, precision, seed, out):
    for i in range(values.shape[0]):
        noise = -1.0 if seed < 0 else noise_of(seed, 3, i)
        out[i] = encode(values[i], precision, noise)


@numba.njit
def _encode_rows(rows, precision, seed, out):
    for r in range(rows.shape[0]):
        encode_row(rows[r], out[r], rows.shape[1], precision, seed, 3, r * rows.shape[1])


def _awkward_floats() -> np.ndarray:
    """float32 values of every magnitude, random bit patterns (NaNs, infinities and
    subnormals among them) and the edges of both half formats."""
    rng = np.random.default_rng(0)
    scales = np.float32([1e-30, 1e-9, 3e-7, 1e-5, 1e-2, 1, 1e3, 6e4, 1e30, 3e38])
    with np.errstate(over="ignore"):  # 3e38 times a normal deviate: infinities, wanted
        spread = (rng.standard_normal((20_000, len(scales))).astype(np.float32) * scales).ravel()
    edges = np.float32([0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 65536, 6.1035156e-05,
                        5.9604645e-08, 2.9802322e-08, 1e-45, 3.3895314e38, 3.3961776e38])
    patterns = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([spread, edges, patterns])


@pytest.mark.parametrize("precision", [FP16, BF16])
def test_decode_matches_torch_on_every_bit_pattern(precision):
    bits = np.arange(1 << 16, dtype=np.uint16)
    ours = np.empty(bits.shape[0], dtype=np.float32)
    _decode_all(bits, precision, ours)
    theirs = torch.from_numpy(bits.view(np.int16)).view(DTYPES[precision]).float().numpy()
    nan = np.isnan(theirs)
    assert (np.isnan(ours) == nan).all()
    assert (ours.view(np.uint32)[~nan] == theirs.view(np.uint32)[~nan]).all()


@pytest.mark.parametrize("precision", [FP16, BF16])
@pytest.mark.parametrize("width", [32, 37])
@pytest.mark.parametrize("hardware", [True, False], ids=["cpu-conversion", "integer-lanes"])
def test_row_decoder_equals_decoding_each_element(monkeypatch, precision, width, hardware):
    """Every bit pattern, NaNs' payloads included, in rows of whole vector blocks and with a
    tail past the last block; through the CPU's conversion where it has one, and through the
    integer operations that stand in for it elsewhere."""
    if hardware and not precision_module.converts_half_in_hardware():
        pytest.skip("this CPU has no vector fp16 conversion")
    monkeypatch.setattr(precision_module, "converts_half_in_hardware", lambda: hardware)
    bits = np.arange(1 << 16, dtype=np.uint16)
    bits = bits[: bits.shape[0] // width * width].reshape(-1, width)
    ours = np.empty(bits.shape, dtype=np.float32)
    numba.njit(_decode_rows.py_func)(bits, precision, ours)  # compiled afresh, with the path chosen
    each = np.empty(bits.size, dtype=np.float32)
    _decode_all(bits.ravel(), precision, each)
    assert (ours.ravel().view(np.uint32) == each.view(np.uint32)).all()


@pytest.mark.parametrize("precision", [FP16, BF16])
def test_encode_rounds_to_nearest_even_like_torch(precision):
    values = _awkward_floats()
    ours = np.empty(values.shape[0], dtype=np.uint16)
    _encode_all(values, precision, -1, ours)
    theirs = torch.from_numpy(values).to(DTYPES[precision]).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert (ours[~nan] == theirs[~nan]).all()
    assert np.isnan(torch.from_numpy(ours.view(np.int16)[nan]).view(DTYPES[precision]).float().numpy()).all()


@pytest.mark.parametrize("precision", [FP16, BF16])
def test_stochastic_encode_is_bit_identical_to_the_torch_ops_rounding(precision):
    values = _awkward_floats()
    values = values[np.isfinite(values)]
    ours = np.empty(values.shape[0], dtype=np.uint16)
    _encode_all(values, precision, 7, ours)
    theirs = _round(torch.from_numpy(values)[:, None], Rounding(DTYPES[precision], 7), 3,
                    torch.arange(values.shape[0]), (0, 0, 0, 1))
    assert (ours == theirs.view(torch.int16).numpy().view(np.uint16)[:, 0]).all()
    # never rounded up to infinity
    assert not np.isinf(torch.from_numpy(ours.view(np.int16)).view(DTYPES[precision]).float().numpy()
                        [np.abs(values) < torch.finfo(DTYPES[precision]).max]).any()


@pytest.mark.parametrize("precision", [FP16, BF16])
@pytest.mark.parametrize("seed", [-1, 5])
@pytest.mark.parametrize("width", [32, 37])
def test_row_encoder_equals_encoding_each_element(precision, seed, width):
    """Rows inside the fast range, and rows with one element outside it, alike; widths of
    whole vector blocks and with a tail past the last block."""
    values = _awkward_floats()
    rows = values[: values.shape[0] // width * width].reshape(-1, width).copy()
    rng = np.random.default_rng(1)
    tame = (rng.standard_normal((5_000, width)) * rng.choice([1e-3, 1, 100], (5_000, 1))).astype(np.float32)
    # fp16 subnormals and zeros among normal values, as in freshly initialised tables
    small = (rng.uniform(-1, 1, (5_000, width)) * rng.choice([3e-3, 1e-5, 1e-9], (5_000, 1))).astype(np.float32)
    small[rng.random(small.shape) < 0.05] = 0.0
    # fp16 subnormals of every size the vector lanes encode: 2**-32 up to 2**-14
    deep = np.ldexp(rng.uniform(1, 2, (5_000, width)), rng.integers(-32, -13, (5_000, width))).astype(np.float32)
    deep *= rng.choice(np.float32([-1, 1]), deep.shape)
    deep[0, :] = np.float32(2.0**-32)
    rows = np.concatenate([rows, tame, small, deep, _one_outside(tame[:2_000], precision, rng)])
    ours = np.empty(rows.shape, dtype=np.uint16)
    _encode_rows(rows, precision, seed, ours)
    each = np.empty(rows.size, dtype=np.uint16)
    _encode_all(rows.ravel(), precision, seed, each)
    assert (ours.ravel() == each).all()


def _one_outside(rows, precision, rng) -> np.ndarray:
    """``rows`` (inside the fast range) with one element each, at a random place, just or
    far outside it: above the largest value no rounding takes to infinity, below fp16's
    2**-32, or not finite."""
    largest = {FP16: [65504.004, 65519.99, 65520.0, 1e5, 3e38], BF16: [3.3895316e38, 3.3961776e38]}[precision]
    outside = np.float32(largest + [2.3e-10, 1e-20, 1e-45, np.inf, np.nan])
    rows = rows.copy()
    picks = rng.integers(0, outside.shape[0], rows.shape[0])
    rows[np.arange(rows.shape[0]), rng.integers(0, rows.shape[1], rows.shape[0])] = outside[picks]
    return rows * rng.choice(np.float32([-1, 1]), (rows.shape[0], 1))


@numba.njit
def _block_flags(rows, precision, out, flags):
    for r in range(rows.shape[0]):
        flags[r] = precision_module._encode_lanes(rows[r], 0, out[r], 0, precision == BF16, True, np.uint64(r))


@pytest.mark.parametrize("precision", [FP16, BF16])
def test_vector_block_reports_whether_its_elements_are_in_its_range(precision):
    """The block encoder says which blocks it encoded right: those whose elements are all zero
    or inside the range it rounds (the row encoder encodes the others again), no more and
    no fewer, so that rows of ordinary values take the vector path."""
    rng = np.random.default_rng(2)
    block = precision_module.BLOCK
    tame = (rng.standard_normal((3_000, block)) * rng.choice([1e-6, 1e-3, 1, 100], (3_000, 1))).astype(np.float32)
    tame[rng.random(tame.shape) < 0.05] = 0.0
    rows = np.concatenate([tame, _one_outside(tame, precision, rng),
                           _awkward_floats()[: 1_000 * block].reshape(-1, block)])
    flags = np.empty(rows.shape[0], dtype=np.bool_)
    _block_flags(rows, precision, np.empty(rows.shape, dtype=np.uint16), flags)
    magnitude = rows.view(np.uint32) & np.uint32(0x7FFFFFFF)
    lowest, highest = precision_module._FAST_LOWEST[precision], precision_module._FAST_HIGHEST[precision]
    inside = (magnitude == 0) | ((magnitude >= lowest) & (magnitude <= highest))
    assert (flags == inside.all(axis=1)).all()
    assert 0.2 < flags.mean() < 0.8


def _flat_runs(id_upstream, id_scale, run_ends, run_rows, table_starts, table_runs):
    """group_by_row's runs, each table's at its ids' place, as one list of all tables':
    (id_upstream, id_scale, runs [R + 1] (run r is ids [runs[r], runs[r + 1])), run_table
    [R], run_rows [R])."""
    runs, run_table, rows = [0], [], []
    for t in range(table_starts.shape[0] - 1):
        count = table_runs[t + 1] - table_runs[t]
        assert count <= table_starts[t + 1] - table_starts[t]
        runs += run_ends[table_starts[t] : table_starts[t] + count].tolist()
        run_table += [t] * count
        rows += run_rows[table_starts[t] : table_starts[t] + count].tolist()
    assert table_runs[0] == 0 and table_runs[-1] == len(rows)
    return id_upstream, id_scale, np.array(runs), np.array(run_table), np.array(rows)


@pytest.mark.parametrize("grad_row_stride", [1_000, 1_003], ids=["gradient-as-output", "wider-gradient-rows"])
def test_group_by_row_sorts_stably_by_row_with_either_sort(grad_row_stride):
    """Tables below and above the radix sort's threshold, rows needing one to three digits,
    a table of two features, a batch key no table looks up, features in another order than
    the batch's keys: each table's ids (its features' in feature order) in stable row
    order, and one run per distinct row. Each id's upstream offset is moved to its sample's
    row of the gradient where the gradient's rows are further apart than the output's."""
    rng = np.random.default_rng(2)
    batch_size = 50
    sizes = [0, 1, 7, RADIX_MIN_IDS - 1, RADIX_MIN_IDS, 3_000, 5_000, 2_000, 40]  # ids of each batch key
    row_limits = [10, 10, 1_000, 50, 2_000, 3_000_000, 2**31 - 1, 2**31 - 1, 10]
    # key k's ids split into batch_size bags at random (some of them empty)
    lengths = np.concatenate([np.bincount(rng.integers(0, batch_size, n), minlength=batch_size) for n in sizes])
    bag_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate([rng.integers(0, limit, size) for size, limit in zip(sizes, row_limits)])
    key_6 = values[bag_offsets[6 * batch_size] : bag_offsets[7 * batch_size]]
    key_6[-10:] = key_6[:10]  # repeats in the three-digit table
    values[bag_offsets[7 * batch_size] :][:10] = key_6[:10]  # and across its two features
    output_width = 1_000
    upstream_of_id = rng.integers(0, batch_size * output_width, values.shape[0])
    scale_of_id = rng.standard_normal(values.shape[0]).astype(np.float32)
    # tables 0..6; table 6 has the features of keys 7 and 6, in that order; key 8 is not looked up
    feature_source = np.array([1, 0, 2, 4, 3, 5, 7, 6], dtype=np.int64)
    table_features = np.array([0, 1, 2, 3, 4, 5, 6, 8], dtype=np.int64)
    id_upstream, id_scale, runs, run_table, run_rows = _flat_runs(*group_by_row(
        values, upstream_of_id, scale_of_id, bag_offsets, batch_size, feature_source, table_features,
        output_width, grad_row_stride))
    sample, column = np.divmod(upstream_of_id, output_width)
    upstream_in_gradient = sample * grad_row_stride + column
    expected_runs, expected_tables, expected_rows = [], [], []
    lo = 0
    for t in range(len(table_features) - 1):
        table = np.concatenate([np.arange(bag_offsets[k * batch_size], bag_offsets[(k + 1) * batch_size])
                                for k in feature_source[table_features[t] : table_features[t + 1]]])
        hi = lo + table.shape[0]
        expected = table[np.argsort(values[table], kind="stable")]
        assert (id_upstream[lo:hi] == upstream_in_gradient[expected]).all()
        assert (id_scale[lo:hi] == scale_of_id[expected]).all()
        rows = values[expected]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if hi > lo else np.zeros(0, dtype=np.int64)
        expected_runs += (lo + starts).tolist()
        expected_tables += [t] * len(starts)
        expected_rows += rows[starts].tolist()
        lo = hi
    assert lo == values.shape[0] - sizes[8]
    assert runs.tolist() == expected_runs + [lo]
    assert run_table.tolist() == expected_tables
    assert run_rows.tolist() == expected_rows


def test_group_by_row_without_scales_gives_none():
    values = np.array([3, 1, 3], dtype=np.int64)
    id_upstream, id_scale, runs, _, run_rows = _flat_runs(*group_by_row(
        values, np.array([0, 64, 128], dtype=np.int64), np.zeros(0, dtype=np.float32),
        np.array([0, 2, 3], dtype=np.int64), 1, np.array([0, 1], dtype=np.int64), np.array([0, 2], dtype=np.int64),
        192, 192))
    assert id_scale.shape == (0,)
    assert id_upstream.tolist() == [64, 0, 128] and runs.tolist() == [0, 1, 3] and run_rows.tolist() == [1, 3]


def _square_sum_in_eight_lanes(g: np.ndarray) -> np.float32:
    """The sum of squares as FBGEMM's 8-lane CPU kernel orders it: element ``d`` in lane
    ``d % 8`` (a width's tail too), then the lanes added pairwise."""
    lanes = [np.float32(0.0)] * 8
    for d, value in enumerate(g.astype(np.float32)):
        lanes[d % 8] = np.float32(lanes[d % 8] + np.float32(value * value))
    return np.float32(np.float32(np.float32(lanes[0] + lanes[1]) + np.float32(lanes[2] + lanes[3]))
                      + np.float32(np.float32(lanes[4] + lanes[5]) + np.float32(lanes[6] + lanes[7])))


@pytest.mark.parametrize("dim", [1, 4, 8, 12, 20, 100, 132])
def test_rowwise_adagrad_sums_squares_in_fbgemm_order_at_every_width(dim):
    """A row's mean of squared gradients is summed in FBGEMM's order, so that its weights
    equal FBGEMM's bit for bit whatever the width (not only at multiples of 8)."""
    from neorec import FusedEmbeddingBagCollection, KeyedJaggedTensor, SparseOptimizer, TableConfig

    rows, batch = 64, 16
    module = FusedEmbeddingBagCollection([TableConfig("t", rows, dim, ("f",))],
                                         SparseOptimizer("rowwise_adagrad", learning_rate=0.05), kernels="numba")
    ids = torch.randperm(rows, generator=torch.Generator().manual_seed(dim))[:batch]  # one id a bag: a row's gradient
    upstream = torch.randn(batch, dim, generator=torch.Generator().manual_seed(dim + 1))
    (module(KeyedJaggedTensor(("f",), torch.ones(batch, dtype=torch.int32), ids)) * upstream).sum().backward()
    momentum = module.table_state("t")[0].reshape(-1)
    for row, gradient in zip(ids.tolist(), upstream.numpy()):
        expected = np.float32(_square_sum_in_eight_lanes(gradient) / np.float32(dim))
        assert momentum[row].item() == expected, (row, momentum[row].item(), expected)
