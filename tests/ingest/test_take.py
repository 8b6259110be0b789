"""Row-level shuffling's gather (:mod:`neorec.ingest.take`) against Arrow's own take: the
same rows decode to the same bytes, nulls, empty bags and bad ids included."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.ingest.batch import HostBatch
from neorec.ingest import chunks
from neorec.ingest.chunks import ChunkDecoder
from neorec.ingest.decoder import DecodeOptions, Where, decode_sources, decode_table
from neorec.ingest.errors import DataError
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.rows import RowGroupInfo, RowSpan, Window
from neorec.ingest.schema import Dataset, DatasetSchema, SparseFeature
from neorec.ingest.take import PickedTogether, WindowTables

SCHEMA = DatasetSchema(
    label="label",
    dense=("d0", "d1"),
    sparse=(SparseFeature("s0", 50), SparseFeature("m0", 1000, multi_hot=True),
            SparseFeature("m1", 70, multi_hot=True)),
)
OPTIONS = DecodeOptions.for_schema(SCHEMA)


def _bags(rng: np.random.Generator, n: int, cardinality: int, large: bool) -> pa.Array:
    """``n`` bags of 0-30 ids (``large``: int32 ids in int64 offsets); about one in five
    null, one in ten empty."""
    bags = [None if rng.random() < 0.2 else rng.integers(0, cardinality, rng.integers(0, 31) * (rng.random() > 0.1))
            .tolist() for _ in range(n)]
    return pa.array(bags, type=pa.large_list(pa.int32()) if large else pa.list_(pa.int64()))


def _table(rng: np.random.Generator, n: int) -> pa.Table:
    dense = rng.random((2, n)) * 10
    return pa.table({
        "label": pa.array(rng.integers(0, 2, n).astype(np.float32)),
        "d0": pa.array(dense[0], mask=rng.random(n) < 0.3),
        "d1": pa.array(dense[1]),
        "s0": pa.array(rng.integers(0, 50, n), mask=rng.random(n) < 0.4),
        "m0": _bags(rng, n, 1000, large=False),
        "m1": _bags(rng, n, 70, large=True),
    })


def _same(a: HostBatch, b: HostBatch) -> None:
    for name in ("dense", "labels", "lengths", "values"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_of_several_groups_decode_as_arrows_take_of_them(seed):
    rng = np.random.default_rng(seed)
    # Groups as a reader holds them, one sliced and one in two chunks, as Arrow may hand them.
    tables = [_table(rng, 300), _table(rng, 500).slice(37, 211), pa.concat_tables([_table(rng, 90), _table(rng, 40)]),
              _table(rng, 1)]
    starts = np.concatenate([[0], np.cumsum([t.num_rows for t in tables])]).astype(np.int64)
    window = pa.concat_tables(tables)
    source = WindowTables(tables, starts)  # prepared once, taken from many times
    for positions in (rng.permutation(window.num_rows)[:400], rng.integers(0, window.num_rows, 50),
                      np.arange(window.num_rows), np.array([starts[1]])):
        positions = positions.astype(np.int64)
        got = decode_table(source.picked(positions), SCHEMA, OPTIONS)
        _same(got, decode_table(window.take(pa.array(positions)), SCHEMA, OPTIONS))
        assert got.values.size > 0 or positions.size < 5


@pytest.mark.parametrize("chunk_rows", [65_536, 96])
def test_row_shuffled_batches_equal_a_plain_take_and_decode_of_their_rows(tmp_path, monkeypatch, chunk_rows):
    """A whole epoch through the reader (chunks gathered on its pool): each batch holds the
    rows its provenance names, decoded as Arrow's take of them from their row group. With
    chunks of 96 rows, a window of 1,000 rows is 11 chunks: groups of them decoded
    together, column by column, the next group while one is delivered."""
    monkeypatch.setattr(chunks, "CHUNK_ROWS", chunk_rows)
    rng = np.random.default_rng(7)
    files = []
    for k in range(2):
        pq.write_table(_table(rng, 1_300), tmp_path / f"part-{k}.parquet", row_group_size=200)
        files.append(f"part-{k}.parquet")
    dataset = Dataset(root=tmp_path, schema=SCHEMA, splits={"train": files})
    reader = InProcessReader(dataset, "train", OPTIONS, ReaderConfig(batch_size=128, seed=5, window=5,
                                                                     remainder="pad"))
    opened = [pq.ParquetFile(tmp_path / name) for name in files]
    seen = 0
    for batch in reader.epoch(3):
        located = np.array([row for s in batch.provenance.rows for row in s.locations().tolist()])
        parts = [opened[f].read_row_group(g).take(pa.array([r])) for f, g, r in located.tolist()]
        expected = decode_table(pa.concat_tables(parts), SCHEMA, OPTIONS).padded_to(batch.batch_size)
        _same(batch, expected)
        seen += len(located)
    reader.close()
    assert seen == 2_600


def test_chunks_decoded_together_on_threads_equal_each_decoded_alone():
    rng = np.random.default_rng(9)
    tables = [_table(rng, 300), _table(rng, 200)]
    window = WindowTables(tables, np.array([0, 300, 500], dtype=np.int64))
    order = rng.permutation(500).astype(np.int64)
    picks = [order[:200], order[200:450], order[450:]]
    with ThreadPoolExecutor(3) as pool:
        together = decode_sources([window.picked(p) for p in picks], [Where()] * 3, SCHEMA, OPTIONS,
                                  lambda jobs: [f.result() for f in [pool.submit(job) for job in jobs]])
    for got, positions in zip(together, picks):
        _same(got, decode_table(window.picked(positions), SCHEMA, OPTIONS))


@pytest.mark.parametrize("share", [1.0, 0.45])
def test_picks_routed_together_equal_each_decoded_alone(share):
    """The flat columns of all picks in one pass over each row group (nulls, a sliced
    group, rows no pick takes) give each pick's batch, byte for byte."""
    rng = np.random.default_rng(11)
    tables = [_table(rng, 300), _table(rng, 260).slice(13, 200), _table(rng, 7)]
    starts = np.concatenate([[0], np.cumsum([t.num_rows for t in tables])]).astype(np.int64)
    window = WindowTables(tables, starts)
    order = rng.permutation(int(starts[-1]))[: int(share * starts[-1])].astype(np.int64)
    picks = [order[:100], order[100:200], order[200:]]
    together = PickedTogether(window, picks)
    assert together.shift == {1.0: 9, 0.45: 7}[share]  # the largest pick: 307 or 100 rows
    with ThreadPoolExecutor(3) as pool:
        got = decode_sources([window.picked(p) for p in picks], [Where()] * 3, SCHEMA, OPTIONS,
                             lambda jobs: [f.result() for f in [pool.submit(job) for job in jobs]], together)
    for batch, positions in zip(got, picks):
        _same(batch, decode_table(window.picked(positions), SCHEMA, OPTIONS))


def test_picks_are_routed_together_from_two_fifths_of_the_window_on():
    assert PickedTogether.worth_it(400, 1000) and PickedTogether.worth_it(1000, 1000)
    assert not PickedTogether.worth_it(399, 1000)


def test_picks_routed_together_name_a_bad_value_by_its_row_and_pass_over_rows_not_picked():
    """A non-finite value in a row no pick takes is no error; in a picked row, the decode
    names that row, as each pick decoded alone would."""
    rng = np.random.default_rng(5)
    table = _table(rng, 100)
    d1 = table.column("d1").to_numpy().copy()
    d1[[20, 90]] = [np.inf, np.nan]
    table = table.set_column(2, "d1", pa.array(d1))
    window = WindowTables([table], np.array([0, 100], dtype=np.int64))
    picks = [np.arange(0, 40, dtype=np.int64)[::-1].copy(), np.arange(40, 80, dtype=np.int64)]
    wheres = [Where("a.parquet", 0, 0, locate=lambda i: ("a.parquet", 0, 39 - i)), Where("a.parquet", 0, 40)]
    with pytest.raises(DataError, match=r"a.parquet, row group 0, column 'd1', row 20: non-finite value inf"):
        decode_sources([window.picked(p) for p in picks], wheres, SCHEMA, OPTIONS,
                       together=PickedTogether(window, picks))
    got = decode_sources([window.picked(picks[1])], wheres[1:], SCHEMA, OPTIONS,
                         together=PickedTogether(window, picks[1:]))  # rows 20 and 90 not picked
    _same(got[0], decode_table(window.picked(picks[1]), SCHEMA, OPTIONS))


def test_a_decoder_read_by_every_thread_of_its_own_executor_does_not_wait_on_itself(monkeypatch):
    """Both threads of the decoder's executor read windows of many chunks through it: the
    decodes and helpers they queue can find no free thread, and each read still ends."""
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 32)
    rng = np.random.default_rng(4)
    tables = {g: _table(rng, 150) for g in range(4)}
    with ThreadPoolExecutor(2) as pool:
        decoder = ChunkDecoder(lambda g: tables[g.row_group], ["part-0.parquet"], SCHEMA, OPTIONS, pool, 2)
        windows = [Window((RowGroupInfo(0, 2 * w, 150), RowGroupInfo(0, 2 * w + 1, 150)), seed=w) for w in range(2)]
        reads = [pool.submit(lambda w: list(decoder.chunks(RowSpan(w, 0, w.num_rows))), w) for w in windows]
        for window, read in zip(windows, reads):
            got = read.result(timeout=60)
            assert [piece for piece, _ in got] == RowSpan(window, 0, window.num_rows).pieces(32)
            positions = window.order()
            tables_of = [tables[g.row_group] for g in window.groups]
            alone = WindowTables(tables_of, window.group_starts())
            for piece, chunk in got:
                _same(chunk, decode_table(alone.picked(positions[piece.start : piece.stop]), SCHEMA, OPTIONS))


@pytest.mark.parametrize("routed", [False, True])
def test_of_chunks_decoded_together_the_first_bad_column_in_schema_order_is_named(routed):
    """A bad id in the first chunk, a bad label in the second: the label comes first in
    the schema, as it would in one chunk, and the error locates its row (the flat columns
    read per chunk or routed to every chunk in one pass)."""
    rng = np.random.default_rng(2)
    table = _table(rng, 100)
    labels = table.column("label").to_numpy().copy()
    labels[70] = 2.0
    ids = table.column("s0").to_pylist()
    ids[10] = 999  # beyond the table's 50 rows
    table = table.set_column(0, "label", pa.array(labels)).set_column(3, "s0", pa.array(ids))
    strict = DecodeOptions.for_schema(SCHEMA, id_mapping="strict")
    window = WindowTables([table], np.array([0, 100], dtype=np.int64))
    first, second = np.arange(0, 50, dtype=np.int64), np.arange(50, 100, dtype=np.int64)
    wheres = [Where("a.parquet", 0, 0), Where("a.parquet", 0, 50)]
    with pytest.raises(DataError, match=r"a.parquet, row group 0, column 'label', row 70: labels must lie in"):
        decode_sources([window.picked(first), window.picked(second)], wheres, SCHEMA, strict,
                       together=PickedTogether(window, [first, second]) if routed else None)
    with pytest.raises(DataError, match=r"a.parquet, row group 0, column 's0', row 10: id 999 is out of range"):
        decode_sources([window.picked(first)], wheres[:1], SCHEMA, strict,
                       together=PickedTogether(window, [first]) if routed else None)


def test_a_null_id_inside_a_list_is_named_by_its_row(tmp_path):
    rng = np.random.default_rng(3)
    table = _table(rng, 60)
    bags = table.column("m0").to_pylist()
    bags[47] = [3, None, 5]  # row group 2 (rows 40-59), row 7
    table = table.set_column(table.schema.get_field_index("m0"), "m0", pa.array(bags, type=pa.list_(pa.int64())))
    pq.write_table(table, tmp_path / "bad.parquet", row_group_size=20)
    dataset = Dataset(root=tmp_path, schema=SCHEMA, splits={"train": ["bad.parquet"]})
    reader = InProcessReader(dataset, "train", OPTIONS, ReaderConfig(batch_size=8, window=3, remainder="pad"))
    with pytest.raises(DataError, match=r"row group 2, column 'm0', row 7: null id inside a list"):
        list(reader.epoch(0))
    reader.close()


@pytest.mark.parametrize("seed", [None, 4])
def test_a_row_group_shorter_than_its_planned_rows_is_named_not_read_past(seed):
    """A file that changed after the read was planned: the window's takes, which skip
    Arrow's bounds check, never see it."""
    rng = np.random.default_rng(1)
    groups = (RowGroupInfo(0, 0, 40), RowGroupInfo(0, 1, 40)) if seed is not None else (RowGroupInfo(0, 1, 40),)
    tables = {0: _table(rng, 40), 1: _table(rng, 25)}  # group 1 lost rows
    decoder = ChunkDecoder(lambda g: tables[g.row_group], ["part-0.parquet"], SCHEMA, OPTIONS)
    window = Window(groups, seed)
    with pytest.raises(DataError, match=r"part-0.parquet, row group 1: the row group holds 25 rows, 40 when"):
        list(decoder.chunks(RowSpan(window, 0, window.num_rows)))


def test_window_tables_refuse_starts_that_do_not_match_their_rows():
    rng = np.random.default_rng(2)
    tables = [_table(rng, 10), _table(rng, 5)]
    with pytest.raises(ValueError, match=r"row group starts \[0, 10, 16\] do not match the tables' rows \[10, 5\]"):
        WindowTables(tables, np.array([0, 10, 16]))


def test_a_window_of_files_that_store_a_column_in_other_widths_decodes_as_their_values_say():
    """Files may store a column as int32 in one and int64 in another (or float16 and
    float32): picked rows decode as the same rows of the groups cast to one type."""
    rng = np.random.default_rng(9)
    first, second = _table(rng, 120), _table(rng, 80)
    second = second.cast(pa.schema([
        pa.field("label", pa.float64()), pa.field("d0", pa.float16()), pa.field("d1", pa.float32()),
        pa.field("s0", pa.int32()), second.schema.field("m0"), second.schema.field("m1")]))
    tables = [first, second]
    starts = np.array([0, 120, 200], dtype=np.int64)
    unified = pa.concat_tables([first, second.cast(first.schema)])
    positions = rng.permutation(200)[:150].astype(np.int64)
    window = WindowTables(tables, starts)
    expected = decode_table(unified.take(pa.array(positions)), SCHEMA, OPTIONS)
    _same(decode_table(window.picked(positions), SCHEMA, OPTIONS), expected)
    routed = decode_sources([window.picked(positions)], [Where()], SCHEMA, OPTIONS,
                            together=PickedTogether(window, [positions]))
    _same(routed[0], expected)
