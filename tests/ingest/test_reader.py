import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.ingest.batch import HostBatch
from neorec.ingest.decoder import DecodeOptions, decode_table
from neorec.ingest.errors import DataError
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.schema import Dataset
from tests.ingest.workers import with_a_bit_flipped_in_each_column


def _samples(batch: HostBatch) -> list[tuple]:
    """Each valid sample as a hashable tuple (label, dense values, ids per feature)."""
    num_f, size = batch.num_features, batch.batch_size
    lengths = batch.lengths.reshape(num_f, size)
    offsets = np.concatenate([[0], np.cumsum(batch.lengths)]).reshape(-1)
    out = []
    for b in range(batch.num_valid):
        bag = lambda f: slice(offsets[f * size + b], offsets[f * size + b + 1])
        ids = tuple(tuple(batch.values[bag(f)].tolist()) for f in range(num_f))
        assert all(len(i) == lengths[f, b] for f, i in enumerate(ids))
        out.append((float(batch.labels[b]), batch.dense[b].tobytes(), ids))
    return out


def _reference_rows(dataset: Dataset, split: str, options: DecodeOptions) -> dict[tuple[int, int, int], tuple]:
    rows = {}
    for file_index, path in enumerate(dataset.files(split)):
        parquet_file = pq.ParquetFile(path)
        for rg in range(parquet_file.num_row_groups):
            table = parquet_file.read_row_group(rg)
            for i, sample in enumerate(_samples(decode_table(table, dataset.schema, options))):
                rows[(file_index, rg, i)] = sample
    return rows


def named_rows(batch: HostBatch) -> list[tuple[int, int, int]]:
    """(file index, row group, row) of each valid sample, from the batch's provenance."""
    return [tuple(row) for s in batch.provenance.rows for row in s.locations().tolist()]


@pytest.mark.parametrize("shuffle", ["rows", "row_groups", "none"])
@pytest.mark.parametrize("world_size,remainder", [(1, "drop"), (2, "drop"), (3, "pad"), (4, "pad")])
def test_every_row_exactly_once_with_provenance(criteo_dataset, world_size, remainder, shuffle):
    options = DecodeOptions.for_schema(criteo_dataset.schema)
    reference = _reference_rows(criteo_dataset, "train", options)
    seen = []
    for rank in range(world_size):
        reader = InProcessReader(criteo_dataset, "train", options,
                                 ReaderConfig(batch_size=256, seed=11, rank=rank, world_size=world_size,
                                              remainder=remainder, shuffle=shuffle, window=3))
        plan = reader.plan(0)
        batches = list(reader.epoch(0))
        assert len(batches) == plan.num_batches
        for step, batch in enumerate(batches):
            assert batch.batch_size == 256
            assert batch.provenance.step == step and batch.provenance.epoch == 0
            named = named_rows(batch)
            assert len(named) == batch.num_valid
            assert _samples(batch) == [reference[k] for k in named]
            seen.extend(named)
    assert len(seen) == len(set(seen))
    dropped = reader.plan(0).dropped_rows
    assert len(seen) + dropped == len(reference) == criteo_dataset.rows["train"]
    if remainder == "pad":
        assert dropped == 0


def test_epoch_order_changes_with_seed(criteo_dataset):
    options = DecodeOptions.for_schema(criteo_dataset.schema)

    def first_labels(seed, epoch):
        reader = InProcessReader(criteo_dataset, "train", options, ReaderConfig(batch_size=512, seed=seed))
        return [b.provenance.rows[0] for b in reader.epoch(epoch)]

    assert first_labels(1, 0) == first_labels(1, 0)
    assert first_labels(1, 0) != first_labels(2, 0)
    assert first_labels(1, 0) != first_labels(1, 1)


def test_multihot_batches_match_direct_decode(multihot_dataset):
    options = DecodeOptions.for_schema(multihot_dataset.schema)
    reference = _reference_rows(multihot_dataset, "train", options)
    reader = InProcessReader(multihot_dataset, "train", options, ReaderConfig(batch_size=300, remainder="pad"))
    count = 0
    for batch in reader.epoch(0):
        named = named_rows(batch)
        assert _samples(batch) == [reference[k] for k in named]
        count += len(named)
    assert count == multihot_dataset.rows["train"]


def _write(path, columns: dict, schema_of: Dataset) -> None:
    pq.write_table(pa.table(columns), path)


def _good_columns(dataset: Dataset, n: int = 4) -> dict:
    columns = {"label": pa.array(np.zeros(n, np.float32))}
    for name in dataset.schema.dense:
        columns[name] = pa.array(np.ones(n, np.float32))
    for f in dataset.schema.sparse:
        columns[f.name] = pa.array(np.arange(n, dtype=np.int64) % f.cardinality)
    return columns


def _dataset_with(tmp_path, base: Dataset, columns: dict | None, raw_bytes: bytes | None = None) -> Dataset:
    path = tmp_path / "bad.parquet"
    if raw_bytes is not None:
        path.write_bytes(raw_bytes)
    else:
        pq.write_table(pa.table(columns), path)
    dataset = Dataset(root=tmp_path, schema=base.schema, splits={"train": ["bad.parquet"]})
    return dataset


def _read_all(dataset: Dataset, **option_kwargs):
    options = DecodeOptions(table_rows=tuple(f.cardinality for f in dataset.schema.sparse), **option_kwargs)
    reader = InProcessReader(dataset, "train", options, ReaderConfig(batch_size=2, remainder="pad"))
    return list(reader.epoch(0))


def test_unreadable_file_is_named(tmp_path, criteo_dataset):
    dataset = _dataset_with(tmp_path, criteo_dataset, None, raw_bytes=b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="bad.parquet"):
        _read_all(dataset)


@pytest.mark.parametrize("rows", [3, 5])
def test_a_split_holding_other_rows_than_the_dataset_gives_is_refused_by_name(tmp_path, criteo_dataset, rows):
    """A file cut short, or rewritten longer, since dataset.json counted its split."""
    dataset = _dataset_with(tmp_path, criteo_dataset, _good_columns(criteo_dataset, n=rows))
    counted = Dataset(root=tmp_path, schema=dataset.schema, splits=dataset.splits, rows={"train": 4})
    with pytest.raises(DataError, match=rf"{tmp_path / 'dataset.json'}: 'train' holds {rows} rows in its files, not "
                                        "the 4 this file gives"):
        _read_all(counted)
    assert len(_read_all(dataset)) == (rows + 1) // 2  # with no count given, nothing is compared


def test_missing_column_is_named(tmp_path, criteo_dataset):
    columns = _good_columns(criteo_dataset)
    del columns["C7"]
    with pytest.raises(DataError, match=r"bad.parquet.*column 'C7'.*missing"):
        _read_all(_dataset_with(tmp_path, criteo_dataset, columns))


def test_a_column_the_file_holds_twice_is_named(tmp_path, criteo_dataset):
    columns = _good_columns(criteo_dataset)
    table = pa.table(columns)
    table = pa.Table.from_arrays([*table.columns, table.column("C4")], names=[*table.column_names, "C4"])
    pq.write_table(table, tmp_path / "bad.parquet")
    dataset = Dataset(root=tmp_path, schema=criteo_dataset.schema, splits={"train": ["bad.parquet"]})
    with pytest.raises(DataError, match=r"bad.parquet.*column 'C4'.*the file has 2 columns of this name"):
        _read_all(dataset)


def test_wrong_type_is_named(tmp_path, criteo_dataset):
    columns = _good_columns(criteo_dataset)
    columns["C2"] = pa.array(["a", "b", "c", "d"])
    with pytest.raises(DataError, match=r"column 'C2'.*expected int64"):
        _read_all(_dataset_with(tmp_path, criteo_dataset, columns))


def test_a_bit_flipped_in_any_column_chunk_is_named_by_file_and_row_group(tmp_path, criteo_dataset):
    """A dataset's pages carry checksums: a flip that zstd would decompress into other
    values is caught as well as one it would notice."""
    for data in with_a_bit_flipped_in_each_column(criteo_dataset.files("train")[0], row_group=1):
        with pytest.raises(DataError, match=r"bad.parquet, row group 1: .*CRC checksum verification failed"):
            _read_all(_dataset_with(tmp_path, criteo_dataset, None, raw_bytes=data))


def test_negative_id_names_row_group_column_and_row(tmp_path, criteo_dataset):
    columns = _good_columns(criteo_dataset)
    columns["C5"] = pa.array([0, 1, -3, 2], type=pa.int64())
    with pytest.raises(DataError, match=r"row group 0, column 'C5', row 2: negative id -3"):
        _read_all(_dataset_with(tmp_path, criteo_dataset, columns))


def test_nan_and_inf_dense_values_are_named(tmp_path, criteo_dataset):
    for bad in (np.nan, np.inf):
        columns = _good_columns(criteo_dataset)
        columns["I4"] = pa.array(np.array([1, 2, 3, bad], np.float32))
        with pytest.raises(DataError, match=r"column 'I4', row 3: non-finite"):
            _read_all(_dataset_with(tmp_path, criteo_dataset, columns))


def test_out_of_range_id_with_strict_mapping(tmp_path, criteo_dataset):
    columns = _good_columns(criteo_dataset)
    columns["C9"] = pa.array([0, 1, 2, 3], type=pa.int64())  # C9 has 3 ids
    with pytest.raises(DataError, match=r"column 'C9', row 3: id 3 is out of range"):
        _read_all(_dataset_with(tmp_path, criteo_dataset, columns), id_mapping="strict")
    batches = _read_all(_dataset_with(tmp_path, criteo_dataset, columns), id_mapping="modulo")
    assert sum(b.num_valid for b in batches) == 4


def test_missing_single_id_is_an_empty_bag(tmp_path, criteo_dataset):
    columns = _good_columns(criteo_dataset)
    columns["C1"] = pa.array([5, None, 7, None], type=pa.int64())
    batch = HostBatch.concat(_read_all(_dataset_with(tmp_path, criteo_dataset, columns)))
    order = [i for b in _read_all(_dataset_with(tmp_path, criteo_dataset, columns))
             for r in b.provenance.rows for i in range(r.start, r.stop)]
    lengths = batch.lengths.reshape(batch.num_features, -1)[0]
    assert [int(lengths[order.index(i)]) for i in range(4)] == [1, 0, 1, 0]


def test_pieces_copied_then_concatenated_give_back_the_batch(multihot_dataset):
    reader = InProcessReader(multihot_dataset, "train", DecodeOptions.for_schema(multihot_dataset.schema),
                             ReaderConfig(batch_size=400))
    batch = next(reader.epoch(0))
    rng = np.random.default_rng(0)
    bounds = [0, *sorted(rng.choice(np.arange(1, 400), size=7, replace=False).tolist()), 400]
    pieces = [piece.copied() for piece in batch.pieces(bounds)]
    assert [p.batch_size for p in pieces] == np.diff(bounds).tolist()
    assert _samples(HostBatch.concat(pieces)) == _samples(batch)
    assert [s for p in pieces for s in _samples(p)] == _samples(batch)


@pytest.mark.parametrize("shuffle", ["rows", "row_groups"])
def test_decoding_in_small_chunks_changes_no_batch_and_no_provenance(criteo_dataset, shuffle, monkeypatch):
    from neorec.ingest import chunks
    from tests.ingest.workers import assert_same_batches

    options = DecodeOptions.for_schema(criteo_dataset.schema)
    config = ReaderConfig(batch_size=256, seed=4, shuffle=shuffle, window=2)
    expected = list(InProcessReader(criteo_dataset, "train", options, config).epoch(1))
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 97)
    assert_same_batches(list(InProcessReader(criteo_dataset, "train", options, config).epoch(1)), expected)


def test_gathering_chunks_on_a_pool_changes_no_batch(criteo_dataset, monkeypatch):
    """A permuted window's chunks decoded on the reader's pool, several at once, give the
    batches decoding them one after the other in the calling thread gives."""
    from neorec.ingest import chunks
    from tests.ingest.workers import assert_same_batches

    options = DecodeOptions.for_schema(criteo_dataset.schema)
    config = ReaderConfig(batch_size=256, seed=3, shuffle="rows", window=2)
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 97)
    threads = pa.cpu_count()
    try:
        pa.set_cpu_count(1)
        serial = InProcessReader(criteo_dataset, "train", options, config)
        pa.set_cpu_count(3)
        pooled = InProcessReader(criteo_dataset, "train", options, config)
    finally:
        pa.set_cpu_count(threads)
    assert serial.decoder.executor is None and pooled.decoder.workers == 3
    assert_same_batches(list(pooled.epoch(2)), list(serial.epoch(2)))
    serial.close()
    pooled.close()


def test_a_bad_row_of_a_permuted_window_is_named_from_whichever_chunk_holds_it(tmp_path, criteo_dataset,
                                                                               monkeypatch):
    from neorec.ingest import chunks

    columns = _good_columns(criteo_dataset, n=24)
    columns["C5"] = pa.array([0] * 13 + [-3] + [0] * 10, type=pa.int64())  # row group 1 (rows 8-15), row 5
    pq.write_table(pa.table(columns), tmp_path / "bad.parquet", row_group_size=8)
    dataset = Dataset(root=tmp_path, schema=criteo_dataset.schema, splits={"train": ["bad.parquet"]})
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 3)
    reader = InProcessReader(dataset, "train", DecodeOptions.for_schema(dataset.schema),
                             ReaderConfig(batch_size=2, shuffle="rows", window=3))
    windows = {s.window for s in reader.plan(0).spans}
    assert [len(w.groups) for w in windows] == [3] and all(w.permuted for w in windows)
    with pytest.raises(DataError, match=r"row group 1, column 'C5', row 5: negative id -3"):
        list(reader.epoch(0))
    reader.close()


def test_chunks_of_rows_that_hold_many_ids_are_cut_to_the_id_budget(multihot_dataset, criteo_dataset):
    from neorec.ingest.chunks import CHUNK_ID_BYTES, CHUNK_ROWS, chunk_rows

    def first_row_group(dataset):
        return pq.ParquetFile(dataset.root / dataset.splits["train"][0]).read_row_group(0)

    assert chunk_rows([first_row_group(criteo_dataset)], criteo_dataset.schema) == CHUNK_ROWS  # 26 ids a row
    table = first_row_group(multihot_dataset)
    ids_per_row = sum(len(table.column(f.name).combine_chunks().flatten()) for f in multihot_dataset.schema.sparse
                      if f.multi_hot) / table.num_rows
    ids_per_row += sum(1 for f in multihot_dataset.schema.sparse if not f.multi_hot)
    heavy = pa.concat_tables([table] * (CHUNK_ROWS // table.num_rows + 1))  # as many rows as a chunk
    rows = chunk_rows([heavy, table], multihot_dataset.schema)
    assert rows & (rows - 1) == 0 and rows * ids_per_row * 8 <= CHUNK_ID_BYTES < 2 * rows * ids_per_row * 8
    assert rows < CHUNK_ROWS


@pytest.mark.parametrize("shuffle", ["rows", "row_groups"])
def test_chunks_cut_to_an_id_budget_change_no_batch(multihot_dataset, shuffle, monkeypatch):
    from neorec.ingest import chunks
    from tests.ingest.workers import assert_same_batches

    options = DecodeOptions.for_schema(multihot_dataset.schema)
    config = ReaderConfig(batch_size=96, seed=2, shuffle=shuffle, window=2)
    expected = list(InProcessReader(multihot_dataset, "train", options, config).epoch(1))
    monkeypatch.setattr(chunks, "CHUNK_ID_BYTES", 4096)  # a row or two a chunk
    reader = InProcessReader(multihot_dataset, "train", options, config)
    span = reader.plan(1).spans[0]
    sizes = [chunk.batch_size for _, chunk in reader.decoder.chunks(span)]
    assert sum(sizes) == span.num_rows and max(sizes) <= 4  # the rows hold over 128 ids
    assert_same_batches(list(reader.epoch(1)), expected)
