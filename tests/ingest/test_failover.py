"""The client against failing reader services: hung workers, streams that break mid-task,
malformed batches and unexpected errors, each with the batch sequence unchanged or a
named error, never a hang."""

import signal
import time

import grpc
import pytest

from neorec.ingest import client as client_module
from neorec.ingest import service as service_module
from neorec.ingest.client import ClientOptions, IngestError, RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.service import ReaderServer
from neorec.ingest.wire import serialize_batch
from neorec.protos import ingest_pb2
from tests.ingest.workers import DATA_ROOTS, assert_same_batches, start_worker, stop_all


def _expected(dataset, config, epoch=0):
    return list(InProcessReader(dataset, "train", DecodeOptions.for_schema(dataset.schema), config).epoch(epoch))


def test_a_stopped_worker_is_failed_over_within_seconds_bit_identically(criteo_dataset):
    workers = [start_worker("--worker-threads", "1") for _ in range(2)]
    try:
        config = ReaderConfig(batch_size=48, seed=3)
        expected = _expected(criteo_dataset, config)
        client = ClientOptions(task_rows=48 * 3, stall_timeout_s=120.0, progress_timeout_s=2.0)
        started = time.monotonic()
        with RemoteReader(criteo_dataset, "train", DecodeOptions.for_schema(criteo_dataset.schema), config,
                          [w.address for w in workers], client) as reader:
            got = []
            for batch in reader.epoch(0):
                got.append(batch)
                if len(got) == 5:
                    workers[1].process.send_signal(signal.SIGSTOP)  # hung, not dead: its socket stays open
            assert reader.requeued_batches > 0
        assert_same_batches(got, expected)
        assert time.monotonic() - started < 60  # seconds of detection, not the 120 s stall timeout
    finally:
        workers[1].process.send_signal(signal.SIGCONT)
        stop_all(workers)


class _BreakingServicer(service_module.ReaderServicer):
    """Ends its first stream with UNAVAILABLE after ``after`` batches; later streams are whole."""

    def __init__(self, after: int) -> None:
        super().__init__(1, data_roots=DATA_ROOTS)
        self.after = after
        self.broken = False

    def _stream(self, job, context):
        for index, message in enumerate(super()._stream(job, context)):
            if index == self.after and not self.broken:
                self.broken = True
                self._abort(context, grpc.StatusCode.UNAVAILABLE, "broken on purpose")
            yield message


@pytest.fixture
def breaking_server(monkeypatch):
    monkeypatch.setattr(service_module, "ReaderServicer", lambda *args, **kwargs: _BreakingServicer(after=3))
    server = ReaderServer(data_roots=DATA_ROOTS)
    server.start()
    yield server
    server.stop(grace_s=0.5)


def test_a_broken_stream_resumes_from_its_first_undelivered_batch(criteo_dataset, breaking_server):
    config = ReaderConfig(batch_size=50, seed=1)
    expected = _expected(criteo_dataset, config)
    client = ClientOptions(task_rows=50 * 10, streams_per_worker=1, backoff_s=0.01)
    with RemoteReader(criteo_dataset, "train", DecodeOptions.for_schema(criteo_dataset.schema), config,
                      [breaking_server.address], client) as reader:
        got = list(reader.epoch(0))
        assert reader.requeued_batches == 10 - 3  # not the whole task again
    assert_same_batches(got, expected)


def _serve_with(monkeypatch, change):
    """A one-thread reader service whose batches pass through ``change`` (given
    :func:`serialize_batch` and its arguments) as they are serialized."""
    monkeypatch.setattr(service_module, "serialize_pieces",
                        lambda pieces, *args: change(serialize_batch, pieces.assembled(), *args))
    server = ReaderServer(threads=1, data_roots=DATA_ROOTS)
    server.start()
    return server


def _bad_id(original, batch, id_bounds, windows, compression):
    batch.values = batch.values.copy()
    batch.values[-1] = id_bounds[-1] + 5  # past the last feature's table
    return original(batch, id_bounds, windows, compression)


def _first_epoch_fails(dataset, server: ReaderServer, client: ClientOptions, match: str) -> None:
    """Reading an epoch from ``server`` fails with an IngestError matching ``match``."""
    try:
        with RemoteReader(dataset, "train", DecodeOptions.for_schema(dataset.schema), ReaderConfig(batch_size=64),
                          [server.address], client) as reader:
            with pytest.raises(IngestError, match=match):
                list(reader.epoch(0))
    finally:
        server.stop(grace_s=0.2)


def test_an_id_outside_its_table_is_refused_by_name_after_every_attempt(criteo_dataset, monkeypatch):
    _first_epoch_fails(criteo_dataset, _serve_with(monkeypatch, _bad_id),
                       ClientOptions(backoff_s=0.01, max_task_attempts=2),
                       r"failed 2 times.*malformed batch.*feature 'C26': id \d+ is outside its table's rows")


def test_a_stream_whose_batch_is_refused_is_cancelled_at_once(criteo_dataset, monkeypatch):
    """The worker stops streaming the rest of a task whose batch the client refused (it
    would otherwise keep a stream open and decoding until the call's deadline)."""
    def slow_and_bad(original, *args):
        time.sleep(0.05)  # ~90 batches: a task that takes seconds to stream
        return _bad_id(original, *args)

    server = _serve_with(monkeypatch, slow_and_bad)
    try:
        with RemoteReader(criteo_dataset, "train", DecodeOptions.for_schema(criteo_dataset.schema),
                          ReaderConfig(batch_size=64), [server.address],
                          ClientOptions(backoff_s=0.01, max_task_attempts=1)) as reader:
            with pytest.raises(IngestError, match="malformed batch"):
                list(reader.epoch(0))
            deadline = time.monotonic() + 2.0
            while server.servicer.counters.active and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.servicer.counters.active == 0
    finally:
        server.stop(grace_s=0.2)


def _bad_lengths(original, batch, id_bounds, windows, compression):
    message = ingest_pb2.Batch.FromString(original(batch, id_bounds, windows, compression))
    message.num_values -= 1  # one id fewer than the bag lengths add up to
    return message.SerializeToString()


def test_lengths_that_do_not_add_up_are_refused(criteo_dataset, monkeypatch):
    _first_epoch_fails(criteo_dataset, _serve_with(monkeypatch, _bad_lengths),
                       ClientOptions(backoff_s=0.01, max_task_attempts=1), "bag lengths add up to")


def test_an_unexpected_exception_in_a_fetcher_ends_the_epoch_at_once_with_its_cause(criteo_dataset, monkeypatch):
    worker = start_worker()
    try:
        def broken(*args):
            raise KeyError("a bug")

        monkeypatch.setattr(client_module, "decode_batch", broken)
        started = time.monotonic()
        with RemoteReader(criteo_dataset, "train", DecodeOptions.for_schema(criteo_dataset.schema),
                          ReaderConfig(batch_size=64), [worker.address]) as reader:
            with pytest.raises(IngestError, match="KeyError: 'a bug'") as info:
                next(iter(reader.epoch(0)))
        assert isinstance(info.value.__cause__, KeyError)
        assert time.monotonic() - started < 10
    finally:
        stop_all([worker])


def test_a_corrupt_zstd_body_is_a_malformed_batch(criteo_dataset, monkeypatch):
    def corrupt(original, batch, id_bounds, windows, compression):
        message = bytearray(original(batch, id_bounds, windows, compression))
        message[-8:] = b"\xff" * 8
        return bytes(message)

    _first_epoch_fails(criteo_dataset, _serve_with(monkeypatch, corrupt),
                       ClientOptions(backoff_s=0.01, max_task_attempts=1, compression="zstd"), "malformed batch")


def test_the_batches_of_a_task_are_checked_for_count(criteo_dataset, monkeypatch):
    """A worker answering a task with one batch too many is refused."""
    original_stream = service_module.ReaderServicer._stream

    def one_more(self, job, context):
        messages = list(original_stream(self, job, context))
        yield from messages
        yield messages[-1]

    monkeypatch.setattr(service_module.ReaderServicer, "_stream", one_more)
    server = ReaderServer(threads=1, data_roots=DATA_ROOTS)
    server.start()
    _first_epoch_fails(criteo_dataset, server, ClientOptions(task_rows=64 * 5, backoff_s=0.01, max_task_attempts=1),
                       "a batch past the task's")
