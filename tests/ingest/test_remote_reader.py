"""The client against real reader service processes: same batches as in process,
exactly once, whatever the workers do."""

import shutil
import threading

import grpc
import pytest

from neorec.ingest import client as client_module
from neorec.ingest.client import ClientOptions, IngestError, RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.protos import ingest_pb2, ingest_pb2_grpc
from tests.ingest.workers import assert_same_batches, scramble_data_pages, stop_all, start_worker

SMALL_TASKS = ClientOptions(task_rows=200)  # a few batches per task: many tasks per epoch


@pytest.fixture(scope="module")
def workers():
    started = [start_worker("--worker-threads", "1") for _ in range(3)]
    yield started
    stop_all(started)


def _both(dataset: Dataset, config: ReaderConfig, addresses, client=SMALL_TASKS, epoch=0):
    options = DecodeOptions.for_schema(dataset.schema)
    expected = list(InProcessReader(dataset, "train", options, config).epoch(epoch))
    with RemoteReader(dataset, "train", options, config, addresses, client) as reader:
        return list(reader.epoch(epoch)), expected


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("world_size,shuffle", [(1, "rows"), (2, "rows"), (4, "rows"), (2, "row_groups"),
                                                (1, "none")])
def test_batches_equal_the_in_process_reader(criteo_dataset, workers, num_workers, world_size, shuffle):
    addresses = [w.address for w in workers[:num_workers]]
    for rank in range(world_size):
        config = ReaderConfig(batch_size=64, seed=5, rank=rank, world_size=world_size, shuffle=shuffle, window=3)
        got, expected = _both(criteo_dataset, config, addresses)
        assert len(expected) > 10
        assert_same_batches(got, expected)


@pytest.mark.parametrize("dataset_name,shuffle", [("criteo_dataset", "rows"), ("multihot_dataset", "rows"),
                                                  ("criteo_dataset", "row_groups")])
def test_a_worker_of_two_decode_threads_with_the_default_tasks(request, dataset_name, shuffle):
    """Each task whole (one per epoch at the default task sizes), a permuted window's
    columns spread over both decode threads, the same batches over three epochs."""
    dataset = request.getfixturevalue(dataset_name)
    worker = start_worker("--worker-threads", "2")
    try:
        for epoch in range(3):
            config = ReaderConfig(batch_size=64, seed=epoch, shuffle=shuffle, window=3)
            got, expected = _both(dataset, config, [worker.address], ClientOptions(), epoch)
            assert_same_batches(got, expected)
    finally:
        stop_all([worker])


@pytest.mark.parametrize("shuffle,task_rows,rows", [("rows", None, 640), ("row_groups", None, 320),
                                                   ("none", None, 320), ("rows", 192, 192),
                                                   ("row_groups", 192, 192)])
def test_an_epoch_is_cut_into_tasks_by_its_shuffle_unless_told(criteo_dataset, monkeypatch, shuffle, task_rows,
                                                               rows):
    """The worker's count of Read calls: one per task of ``rows`` rows (64-row batches)."""
    monkeypatch.setattr(client_module, "ROW_SHUFFLE_TASK_ROWS", 640)
    monkeypatch.setattr(client_module, "TASK_ROWS", 320)
    worker = start_worker("--worker-threads", "1")
    try:
        config = ReaderConfig(batch_size=64, seed=1, shuffle=shuffle, window=3)
        got, expected = _both(criteo_dataset, config, [worker.address], ClientOptions(task_rows=task_rows))
        assert_same_batches(got, expected)
        with grpc.insecure_channel(worker.address) as channel:
            status = ingest_pb2_grpc.ReaderStub(channel).Status(ingest_pb2.StatusRequest(), timeout=10)
        assert status.requests == -(-len(expected) // (rows // 64)) > 1
    finally:
        stop_all([worker])


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_multihot_padding_and_compression(multihot_dataset, workers, compression):
    config = ReaderConfig(batch_size=96, seed=2, rank=2, world_size=3, remainder="pad")
    client = ClientOptions(task_rows=300, compression=compression)
    got, expected = _both(multihot_dataset, config, [w.address for w in workers], client, epoch=1)
    assert expected[-1].num_valid < 96
    assert_same_batches(got, expected)


def test_raw_ids_of_dynamic_tables_travel_unchanged(workers, tmp_path):
    dataset = generate(SynthSpec(profile="multihot", rows=1500, eval_fraction=0.1, raw_ids=True), tmp_path)
    names = tuple(f.name for f in dataset.schema.sparse)
    options = DecodeOptions(table_rows=(1000,) * len(names), raw_features=names)  # a dynamic table's 1000 slots
    config = ReaderConfig(batch_size=64, seed=3)
    expected = list(InProcessReader(dataset, "train", options, config).epoch(0))
    with RemoteReader(dataset, "train", options, config, [w.address for w in workers[:2]], SMALL_TASKS) as reader:
        got = list(reader.epoch(0))
    assert_same_batches(got, expected)
    assert any((b.values < 0).any() for b in got) and any((b.values >= 1000).any() for b in got)


@pytest.mark.parametrize("seed,kill_after", [(0, 1), (1, 7), (2, 25)])
def test_sigkill_of_a_worker_mid_epoch_changes_nothing(criteo_dataset, seed, kill_after):
    victims = [start_worker("--worker-threads", "1") for _ in range(3)]
    try:
        config = ReaderConfig(batch_size=48, seed=seed, rank=seed % 2, world_size=2)
        options = DecodeOptions.for_schema(criteo_dataset.schema)
        expected = list(InProcessReader(criteo_dataset, "train", options, config).epoch(0))
        client = ClientOptions(task_rows=48 * 2, backoff_s=0.01)  # a 12-batch window: work is left to fail
        with RemoteReader(criteo_dataset, "train", options, config, [w.address for w in victims], client) as reader:
            got = []
            for batch in reader.epoch(0):
                got.append(batch)
                if len(got) == kill_after:
                    victims[seed % 3].kill()
            assert reader.requeued_batches > 0
        assert_same_batches(got, expected)
    finally:
        stop_all(victims)


def test_no_live_worker_is_a_clear_error_not_a_hang(criteo_dataset):
    worker = start_worker()
    worker.kill()
    config = ReaderConfig(batch_size=64)
    client = ClientOptions(stall_timeout_s=1.5, backoff_s=0.05, max_backoff_s=0.2)
    with RemoteReader(criteo_dataset, "train", DecodeOptions.for_schema(criteo_dataset.schema), config,
                      [worker.address], client) as reader:
        with pytest.raises(IngestError, match=f"no reader service delivered.*{worker.address}: UNAVAILABLE"):
            next(iter(reader.epoch(0)))


def test_corrupt_data_reaches_the_trainer_as_an_error_naming_the_file(criteo_dataset, workers, tmp_path):
    copy = tmp_path / "dataset"
    shutil.copytree(criteo_dataset.root, copy)
    dataset = Dataset.load(copy)
    config = ReaderConfig(batch_size=64)
    options = DecodeOptions.for_schema(dataset.schema)
    with RemoteReader(dataset, "train", options, config, [w.address for w in workers]) as reader:
        victim = dataset.files("train")[1]
        scramble_data_pages(victim)  # after planning: the footers stay readable
        with pytest.raises(IngestError, match=f"DATA_LOSS: file {victim}"):
            list(reader.epoch(0))


def test_closing_the_reader_mid_epoch_stops_its_fetchers_quietly(criteo_dataset, workers, monkeypatch):
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    options = DecodeOptions.for_schema(criteo_dataset.schema)
    reader = RemoteReader(criteo_dataset, "train", options, ReaderConfig(batch_size=64), [workers[0].address],
                          SMALL_TASKS)
    unfinished = reader.epoch(0)
    next(unfinished)
    reader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("fetch-")]
    assert thread_errors == []
    with pytest.raises(IngestError, match="closed"):
        next(unfinished)
