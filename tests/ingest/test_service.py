"""The reader service on its own: requests, status codes, counters, health, shutdown."""

import ctypes
import os
import shutil
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from neorec.ingest.client import RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import ReaderConfig
from neorec.ingest.schema import Dataset
from neorec.ingest import service
from neorec.ingest.service import SERVICE_NAME, ReaderServer
from neorec.protos import ingest_pb2, ingest_pb2_grpc
from tests.ingest.workers import DATA_ROOTS, scramble_data_pages, stop_all, start_worker

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def server():
    server = ReaderServer(threads=2, data_roots=DATA_ROOTS)
    server.start()
    yield server
    server.stop(grace_s=0.5)


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


def _request(dataset: Dataset, batch_size: int = 100, num_batches: int | None = 3) -> ingest_pb2.ReadRequest:
    """A valid request built the way the client builds them (of the first ``num_batches``
    batches of epoch 0; None: all of them)."""
    options = DecodeOptions.for_schema(dataset.schema)
    reader = RemoteReader(dataset, "train", options, ReaderConfig(batch_size=batch_size), ["127.0.0.1:1"])
    plan = reader.plan(0)
    task = plan.tasks(num_batches or plan.num_batches)[0]
    reader.close()
    return reader.request_for(task)[0]


def _request_longer_than_the_buffers(dataset: Dataset) -> ingest_pb2.ReadRequest:
    """A request whose stream cannot finish unread: 48 batches (4,800 rows, then padding) of
    3.3 MB, 158 MB. The transport's buffers (flow-control windows grown by gRPC's bandwidth
    probing, and the sockets') have held 5-17 MB of a stream on loopback, so a shorter stream
    a test means to keep open can end with OK on its own."""
    request = _request(dataset, batch_size=100, num_batches=None)
    request.batch_size = 40_000
    return request


def _read_all(channel: grpc.Channel, request: ingest_pb2.ReadRequest) -> list[ingest_pb2.Batch]:
    return list(ingest_pb2_grpc.ReaderStub(channel).Read(request, timeout=30))


def _status(channel: grpc.Channel) -> ingest_pb2.StatusReply:
    return ingest_pb2_grpc.ReaderStub(channel).Status(ingest_pb2.StatusRequest(), timeout=10)


def test_serves_the_requested_batches_and_counts_them(channel, criteo_dataset):
    before = _status(channel)
    request = _request(criteo_dataset, batch_size=100, num_batches=3)
    batches = _read_all(channel, request)
    assert [b.step for b in batches] == [0, 1, 2]
    assert all(b.batch_size == b.num_valid == 100 for b in batches)
    after = _status(channel)
    assert after.batches_served - before.batches_served == 3
    assert after.rows_served - before.rows_served == 300
    assert after.bytes_served - before.bytes_served == sum(b.ByteSize() for b in batches)
    assert after.requests - before.requests == 1
    assert after.active_streams == 0 and after.batches_per_second > 0 and not after.shutting_down


@pytest.mark.parametrize("whole_epoch", [False, True])
def test_a_row_group_is_read_once_per_epoch_while_rows_of_it_are_to_come(channel, criteo_dataset, whole_epoch):
    """Three batches leave most of their windows' rows to come: a second read (a retry) is
    served from the first one's tables. A read of every row of the epoch leaves none, so
    its windows are not kept."""
    request = _request(criteo_dataset, batch_size=100, num_batches=None if whole_epoch else 3)
    request.epoch = 2000 if whole_epoch else 1000  # epochs the module's other tests do not read
    groups = sum(len(w.groups) for w in request.windows)
    before = _status(channel)
    first = _read_all(channel, request)
    after_first = _status(channel)
    assert after_first.row_groups_read - before.row_groups_read == groups
    assert _read_all(channel, request) == first
    again = _status(channel)
    assert again.row_groups_read - after_first.row_groups_read == (groups if whole_epoch else 0)
    if not whole_epoch:
        assert again.row_group_cache_hits - after_first.row_group_cache_hits >= groups
    request.epoch += 1  # another epoch reads from Parquet again
    _read_all(channel, request)
    assert _status(channel).row_groups_read - again.row_groups_read == groups


def _mutations(dataset: Dataset):
    """(name, change to a valid request, expected status code)."""
    def set_field(name, value):
        return lambda r: setattr(r, name, value)

    def first_span(**fields):
        def change(r):
            for k, v in fields.items():
                setattr(r.spans[0], k, v)
        return change

    def first_group(**fields):
        def change(r):
            for k, v in fields.items():
                setattr(r.windows[0].groups[0], k, v)
        return change

    def first_file(**fields):
        def change(r):
            for k, v in fields.items():
                setattr(r.files[r.windows[0].groups[0].file], k, v)
        return change

    invalid, missing = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    return [
        ("batch size 0", set_field("batch_size", 0), invalid),
        ("absurd batch size", set_field("batch_size", 1 << 30), invalid),
        ("no batches", set_field("num_batches", 0), invalid),
        ("too many rows for the batches", set_field("num_batches", 1), invalid),
        ("unknown compression", set_field("compression", 7), invalid),
        ("unknown dataset", set_field("dataset", f"{DATA_ROOTS[0]}/nonexistent/dataset"), missing),
        ("dataset outside the data roots", set_field("dataset", "/etc"), grpc.StatusCode.PERMISSION_DENIED),
        ("a way out of the data roots", set_field("dataset", f"{DATA_ROOTS[0]}/../etc"),
         grpc.StatusCode.PERMISSION_DENIED),
        ("no dataset", set_field("dataset", ""), invalid),
        ("2**20 padding batches of 2**20 rows", lambda r: (setattr(r, "num_batches", 1 << 20),
                                                          setattr(r, "batch_size", 1 << 20)), invalid),
        ("unknown split", set_field("split", "test"), missing),
        ("unknown file", lambda r: setattr(r.files[0], "name", "elsewhere.parquet"), missing),
        ("file index past the list", first_group(file=5), invalid),
        ("row group past the file", first_group(row_group=99), invalid),
        ("row group of another size", first_group(num_rows=699), invalid),
        ("window without row groups", lambda r: r.windows[0].ClearField("groups"), invalid),
        ("a row group twice in a window", lambda r: r.windows[0].groups.append(r.windows[0].groups[0]), invalid),
        ("a window beyond its bound", first_group(num_rows=1 << 27), invalid),
        ("steps past uint64", set_field("first_step", 2**64 - 2), invalid),
        ("span of an unknown window", first_span(window=9), invalid),
        ("rows past the window", first_span(stop=10_000), invalid),
        ("empty span", first_span(stop=0), invalid),
        ("file of another size", first_file(size=12345), grpc.StatusCode.FAILED_PRECONDITION),
        ("file with another footer", first_file(footer_crc32=1), grpc.StatusCode.FAILED_PRECONDITION),
        ("wrong table count", lambda r: r.decode.table_rows.pop(), invalid),
        ("unknown dense transform", lambda r: setattr(r.decode, "dense_transform", "sqrt"), invalid),
        ("raw ids of an unknown feature", lambda r: r.decode.raw_features.append("C99"), invalid),
        ("raw ids named twice", lambda r: r.decode.raw_features.extend(["C1", "C1"]), invalid),
    ]


def test_bad_requests_get_status_codes_and_the_server_keeps_serving(channel, criteo_dataset):
    before = _status(channel)
    mutations = _mutations(criteo_dataset)
    for name, change, code in mutations:
        request = _request(criteo_dataset)
        change(request)
        with pytest.raises(grpc.RpcError) as info:
            _read_all(channel, request)
        assert info.value.code() == code, name
        assert info.value.details(), name
    assert _status(channel).errors - before.errors == len(mutations)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == SERVING
    assert len(_read_all(channel, _request(criteo_dataset))) == 3


@pytest.mark.parametrize("method", ["Read", "Status"])
def test_bytes_that_are_no_request_are_invalid_argument_naming_the_message(channel, method):
    call = (channel.unary_stream if method == "Read" else channel.unary_unary)(
        f"/{SERVICE_NAME}/{method}", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as caught:
        list(call(b"\xff\xff\xff garbage", timeout=10)) if method == "Read" else call(b"\xff\xff garbage", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not gRPC's own INTERNAL
    assert caught.value.details().startswith(f"the request is not a neorec.ingest.{method}Request")
    _status(channel)  # still serving


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_file_is_data_loss_naming_the_file(channel, criteo_dataset, tmp_path, damage):
    copy = tmp_path / "dataset"
    shutil.copytree(criteo_dataset.root, copy)
    request = _request(criteo_dataset)
    request.dataset = str(copy)
    victim = copy / request.files[request.windows[0].groups[0].file].name
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:1000])
    else:
        scramble_data_pages(victim)  # size and footer kept: it passes for the client's file
    with pytest.raises(grpc.RpcError) as info:
        _read_all(channel, request)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert victim.name in info.value.details()
    assert len(_read_all(channel, _request(criteo_dataset))) == 3


def test_a_file_removed_after_the_request_was_checked_is_data_loss(criteo_dataset, tmp_path, monkeypatch):
    copy = tmp_path / "dataset"
    shutil.copytree(criteo_dataset.root, copy)
    request = _request(criteo_dataset)
    request.dataset = str(copy)
    victim = copy / request.files[request.windows[0].groups[0].file].name
    validate = service.validate_request

    def checked_then_removed(req, roots):
        job = validate(req, roots)
        victim.unlink()
        return job

    server = ReaderServer(threads=2, data_roots=DATA_ROOTS)
    monkeypatch.setattr(service, "validate_request", checked_then_removed)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                _read_all(channel, request)
            assert info.value.code() == grpc.StatusCode.DATA_LOSS
            assert victim.name in info.value.details()
    finally:
        server.stop(grace_s=0.5)


def test_health_check_and_unknown_service(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_sigterm_drains_then_exits_cleanly(criteo_dataset):
    worker = start_worker("--grace", "3")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
            assert next(watch).status == SERVING
            # An open stream the client reads slowly: the service must wait for it, then end it.
            request = _request_longer_than_the_buffers(criteo_dataset)
            stream = ingest_pb2_grpc.ReaderStub(channel).Read(request, timeout=30)
            first = next(stream)
            assert first.step == 0
            waiting_until = time.monotonic() + 10
            while _status(channel).active_streams != 1:
                assert time.monotonic() < waiting_until, "the service never counted the open stream"
                time.sleep(0.01)
            started = time.monotonic()
            worker.process.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                _read_all(channel, _request(criteo_dataset))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert _status(channel).shutting_down
            with pytest.raises(grpc.RpcError) as ended:  # 48 batches at 5 a second outlast the grace period
                for _ in stream:
                    time.sleep(0.2)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert worker.process.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
    finally:
        stop_all([worker])


def test_sigterm_handed_to_any_thread_stops_the_service():
    """The kernel may deliver a process's SIGTERM to any of its threads, not only the main one."""
    worker = start_worker()
    try:
        pid = worker.process.pid
        other_threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert other_threads, "the service runs gRPC threads besides its main thread"
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill
        assert tgkill(pid, other_threads[-1], signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
        assert worker.process.wait(timeout=10) == 0
    finally:
        stop_all([worker])


def test_streams_still_open_after_the_grace_period_end_unavailable(criteo_dataset):
    server = ReaderServer(threads=1, data_roots=DATA_ROOTS)
    server.start()
    with grpc.insecure_channel(server.address) as channel:
        request = _request_longer_than_the_buffers(criteo_dataset)
        stream = ingest_pb2_grpc.ReaderStub(channel).Read(request, timeout=30)
        assert next(stream).step == 0
        stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 0.0})
        stopper.start()
        with pytest.raises(grpc.RpcError) as ended:
            received = 1 + sum(1 for _ in stream)
            pytest.fail(f"the stream finished ({received} batches) instead of ending")
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in ended.value.details()
        stopper.join()


def test_streams_beyond_the_limit_are_refused_and_health_keeps_answering(criteo_dataset):
    server = ReaderServer(threads=1, max_streams=16, data_roots=DATA_ROOTS)
    server.start()
    request = _request_longer_than_the_buffers(criteo_dataset)  # none finishes and frees its place
    try:
        with grpc.insecure_channel(server.address) as channel:
            reader = ingest_pb2_grpc.ReaderStub(channel)
            streams = [reader.Read(request, timeout=60) for _ in range(16)]
            for stream in streams:
                assert next(stream).step == 0
            with pytest.raises(grpc.RpcError) as refused:
                next(reader.Read(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(5):
                started = time.monotonic()
                assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1).status == SERVING
                assert time.monotonic() - started < 1.0
            assert _status(channel).active_streams == 16
            for stream in streams:
                stream.cancel()
    finally:
        server.stop(grace_s=0.2)


def test_oversized_requests_and_echoed_names_stay_bounded(channel, criteo_dataset):
    request = _request(criteo_dataset)
    request.dataset = "/" + "x" * (64 << 20)  # a 64 MiB request
    with pytest.raises(grpc.RpcError) as info:
        _read_all(channel, request)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    request.dataset = "/nonexistent/" + "y" * 100_000  # its error names it: cut, so the answer arrives
    with pytest.raises(grpc.RpcError) as info:
        _read_all(channel, request)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert len(info.value.details()) <= 1024 and "message cut" in info.value.details()
    assert len(_read_all(channel, _request(criteo_dataset))) == 3
