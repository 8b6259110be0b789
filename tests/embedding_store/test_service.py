"""The store service on a real loopback port: what a client reads back is what it wrote;
malformed, oversized and out-of-range requests are refused by status code and change
nothing; a corrupt segment is named; a trainer whose store service dies stops within
seconds with an error naming it, and a client notices a stopped service within seconds
while a slow call runs to its end."""

from __future__ import annotations

import errno
import re
import signal
import socket
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from neorec.embedding_store import client as client_module
from neorec.embedding_store.client import RemoteTier, StoreClient, StoreServiceError
from neorec.embedding_store.segments import SegmentTier
from neorec.embedding_store.service import MAX_REQUEST_BYTES, SERVICE_NAME, StoreServer, StoreServicer
from neorec.protos import store_pb2
from tests.cli import NEOREC

ROWS, WIDTH = 1000, 12


@pytest.fixture
def service(tmp_path):
    server = StoreServer(tmp_path / "tiers")
    server.start()
    client = StoreClient(server.address)
    yield server, client
    client.close()
    server.stop()


def _write_held_in_the_service(monkeypatch, tier: RemoteTier, value: int) -> tuple[threading.Thread, threading.Event]:
    """A thread writing ``value`` to rows 0 and 1 of ``tier``, its call held inside the
    service (the piece's lock taken) until the returned event is set; started, and in."""
    writing, release = threading.Event(), threading.Event()
    write = SegmentTier.write

    def slow_write(self, rows, data):
        writing.set()
        release.wait(10)
        write(self, rows, data)

    monkeypatch.setattr(SegmentTier, "write", slow_write)
    in_flight = threading.Thread(target=tier.write, args=(np.arange(2), np.full((2, WIDTH), value, dtype=np.uint8)))
    in_flight.start()
    assert writing.wait(10)
    return in_flight, release


def _raw(client: StoreClient, method: str, request, reply):
    call = client.channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda r: r,
                                      response_deserializer=reply.FromString)
    return call(request, timeout=10)


def test_rows_read_back_as_written_and_survive_a_restart(tmp_path, service):
    server, client = service
    tier = client.open_tier("t@0", ROWS, WIDTH, reset=True)
    rng = np.random.default_rng(0)
    rows = rng.choice(ROWS, 300, replace=False).astype(np.int64)
    data = rng.integers(0, 256, (300, WIDTH), dtype=np.uint8)
    tier.write(rows, data)
    found, back = tier.read(np.concatenate([rows, [rows.max() + 1 if rows.max() + 1 not in rows else 0]]))
    assert found[:300].all() and np.array_equal(back[:300], data)
    tier.flush(sync=True)
    status = client.status()
    assert [p.key for p in status.pieces] == ["t@0"] and status.pieces[0].live_rows == 300
    server.stop()
    again = StoreServer(tmp_path / "tiers")  # a new service over the same directory
    again.start()
    try:
        other = StoreClient(again.address)
        found, back = other.open_tier("t@0", ROWS, WIDTH).read(rows)
        assert found.all() and np.array_equal(back, data)
        other.close()
    finally:
        again.stop()


@pytest.mark.parametrize("method,request_,code,text", [
    ("Read", store_pb2.ReadRequest(key="nope@0", rows=b"\0" * 8), grpc.StatusCode.NOT_FOUND, "no piece"),
    ("Read", store_pb2.ReadRequest(key="../etc", rows=b""), grpc.StatusCode.INVALID_ARGUMENT, "piece key"),
    ("Read", store_pb2.ReadRequest(key="t@0", rows=b"\0" * 7), grpc.StatusCode.INVALID_ARGUMENT, "int64"),
    ("Read", store_pb2.ReadRequest(key="t@0", rows=np.array([ROWS], "<i8").tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "must lie in"),
    ("Read", store_pb2.ReadRequest(key="t@0", rows=np.array([-1], "<i8").tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "must lie in"),
    ("Write", store_pb2.WriteRequest(key="t@0", rows=np.array([1, 2], "<i8").tobytes(), data=b"\0" * WIDTH),
     grpc.StatusCode.INVALID_ARGUMENT, "data bytes"),
    ("Write", store_pb2.WriteRequest(key="t@0", rows=np.array([1, 1], "<i8").tobytes(), data=b"\0" * 2 * WIDTH),
     grpc.StatusCode.INVALID_ARGUMENT, "distinct"),
    ("Open", store_pb2.OpenRequest(key="t@0", rows=ROWS + 1, row_bytes=WIDTH), grpc.StatusCode.FAILED_PRECONDITION,
     "is open with"),
    ("Open", store_pb2.OpenRequest(key="u@0", rows=0, row_bytes=WIDTH), grpc.StatusCode.INVALID_ARGUMENT,
     "positive"),
    ("Open", store_pb2.OpenRequest(key="u@0", rows=2**62, row_bytes=WIDTH), grpc.StatusCode.INVALID_ARGUMENT,
     "more than a piece may hold"),
    ("Load", store_pb2.LoadRequest(key="t@0", directory="relative", names=[]), grpc.StatusCode.INVALID_ARGUMENT,
     "absolute"),
    ("Load", store_pb2.LoadRequest(key="t@0", directory="/tmp", names=["../../x.seg"]),
     grpc.StatusCode.INVALID_ARGUMENT, "segment file name"),
    ("Snapshot", store_pb2.SnapshotRequest(key="t@0", directory=""), grpc.StatusCode.INVALID_ARGUMENT, "absolute"),
])
def test_bad_requests_are_refused_by_status_and_change_nothing(service, tmp_path, method, request_, code, text):
    _, client = service
    tier = client.open_tier("t@0", ROWS, WIDTH, reset=True)
    tier.write(np.array([5], dtype=np.int64), np.full((1, WIDTH), 7, dtype=np.uint8))
    reply = {"Read": store_pb2.ReadReply, "Write": store_pb2.WriteReply, "Open": store_pb2.OpenReply,
             "Load": store_pb2.LoadReply, "Snapshot": store_pb2.SnapshotReply}[method]
    request = type(request_)()
    request.CopyFrom(request_)
    if method != "Open":
        request.lease = tier.lease
    with pytest.raises(grpc.RpcError) as caught:
        _raw(client, method, request.SerializeToString(), reply)
    assert caught.value.code() == code and text in caught.value.details()
    found, data = tier.read(np.array([5, 6], dtype=np.int64))  # it still serves, and nothing changed
    assert found.tolist() == [True, False] and (data[0] == 7).all()
    assert client.status().errors == 1
    assert sorted(p.name for p in (tmp_path / "tiers").iterdir() if p.is_dir()) == ["t@0"]  # no piece half made


def test_an_open_piece_is_held_by_its_owner_alone(service):
    _, client = service
    mine = client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/a")
    mine.write(np.arange(5, dtype=np.int64), np.full((5, WIDTH), 7, dtype=np.uint8))
    with pytest.raises(StoreServiceError, match="FAILED_PRECONDITION.*'t@0' for /runs/b: it is held by /runs/a"):
        client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/b")
    with pytest.raises(StoreServiceError, match="Close failed with FAILED_PRECONDITION.*newer Open.*by /runs/a"):
        RemoteTier(client, "t@0", ROWS, WIDTH, lease=mine.lease + 1).close()  # a client that never opened it
    again = client.open_tier("t@0", ROWS, WIDTH, owner="/runs/a")  # reopened by its owner
    found, back = again.read(np.arange(5))
    assert found.all() and (back == 7).all()  # the refused reset emptied nothing
    assert client.status().pieces[0].owner == "/runs/a"
    again.close()
    theirs = client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/b")  # released: another run's now
    assert not theirs.read(np.arange(5))[0].any()


def test_a_reopened_piece_refuses_its_former_holder(tmp_path, service):
    _, client = service
    stale = client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/a")
    stale.write(np.arange(5, dtype=np.int64), np.full((5, WIDTH), 7, dtype=np.uint8))
    newest = client.open_tier("t@0", ROWS, WIDTH, owner="/runs/a")  # the same run, started again
    assert newest.lease != stale.lease
    for action in (lambda: stale.write(np.arange(3, dtype=np.int64), np.zeros((3, WIDTH), dtype=np.uint8)),
                   lambda: stale.read(np.arange(3)), lambda: stale.flush(sync=True),
                   lambda: stale.snapshot(tmp_path / "tiers" / "snap"), lambda: stale.load(tmp_path / "tiers", []),
                   stale.close):
        with pytest.raises(StoreServiceError, match="FAILED_PRECONDITION: piece 't@0' is held under a newer Open"):
            action()
    found, back = newest.read(np.arange(6))
    assert found.tolist() == [True] * 5 + [False] and (back[:5] == 7).all()  # nothing the stale holder sent landed
    newest.close()
    assert client.status().pieces == []


def test_a_new_open_waits_for_the_call_in_flight_under_the_old_lease(service, monkeypatch):
    _, client = service
    stale = client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/a")
    in_flight, release = _write_held_in_the_service(monkeypatch, stale, 3)
    opened = []
    opener = threading.Thread(target=lambda: opened.append(client.open_tier("t@0", ROWS, WIDTH, owner="/runs/a")))
    opener.start()
    opener.join(0.5)
    assert not opened  # the new Open waits for the write that began under the old lease
    release.set()
    in_flight.join(10)
    opener.join(10)
    found, data = opened[0].read(np.arange(3))  # the write landed before the new holder's lease began
    assert found.tolist() == [True, True, False] and (data[:2] == 3).all()
    with pytest.raises(StoreServiceError, match="held under a newer Open"):
        stale.write(np.arange(1), np.zeros((1, WIDTH), dtype=np.uint8))


def test_shutdown_waits_for_the_call_in_flight_and_keeps_its_rows(tmp_path, monkeypatch):
    server = StoreServer(tmp_path / "tiers")
    server.start()
    client = StoreClient(server.address)
    tier = client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/a")
    in_flight, release = _write_held_in_the_service(monkeypatch, tier, 5)
    closing = threading.Thread(target=server.servicer.close)  # the shutdown, its grace period over
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # it waits for the write, which would otherwise land on a closed tier
    release.set()
    in_flight.join(10)
    closing.join(10)
    client.close()
    server.stop()
    again = StoreServer(tmp_path / "tiers")
    again.start()
    try:
        found, data = StoreClient(again.address).open_tier("t@0", ROWS, WIDTH, owner="/runs/a").read(np.arange(3))
        assert found.tolist() == [True, True, False] and (data[:2] == 5).all()  # written, then closed
    finally:
        again.stop()


def test_garbage_and_oversized_requests_are_refused(service):
    _, client = service
    client.open_tier("t@0", ROWS, WIDTH, reset=True)
    with pytest.raises(grpc.RpcError) as caught:
        _raw(client, "Read", b"\xff\xff\xff garbage", store_pb2.ReadReply)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not gRPC's own INTERNAL
    assert caught.value.details().startswith("the request is not a neorec.store.ReadRequest")
    huge = store_pb2.WriteRequest(key="t@0", rows=b"\0" * 8, data=b"\0" * (MAX_REQUEST_BYTES + 1))
    with pytest.raises(grpc.RpcError) as caught:
        _raw(client, "Write", huge.SerializeToString(), store_pb2.WriteReply)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.status().pieces[0].key == "t@0"  # still serving


def test_snapshots_and_loads_never_use_a_piece_s_directory_and_a_bad_load_changes_nothing(tmp_path, service):
    """Another run's piece (or the piece's own) directory is no snapshot or load directory:
    a snapshot there replaced its segments by links to the caller's (or, its own, deleted
    them). A load of a corrupt segment is refused before the piece drops its own."""
    _, client = service
    mine = client.open_tier("t@0", ROWS, WIDTH, reset=True, owner="/runs/a")
    mine.write(np.array([5], dtype=np.int64), np.full((1, WIDTH), 7, dtype=np.uint8))
    mine.flush(sync=True)
    other = client.open_tier("u@0", ROWS, WIDTH, reset=True, owner="/runs/b")
    other.write(np.array([5], dtype=np.int64), np.full((1, WIDTH), 0xEE, dtype=np.uint8))
    tiers = tmp_path / "tiers"
    for directory in (tiers / "t@0", tiers / "t@0" / "inside", tiers / "u@0"):
        with pytest.raises(StoreServiceError, match="PERMISSION_DENIED.*tier directory"):
            other.snapshot(directory)
        with pytest.raises(StoreServiceError, match="PERMISSION_DENIED.*tier directory"):
            other.load(directory, [])
    (tiers / "bad").mkdir()
    (tiers / "bad" / "00000001.seg").write_bytes(b"not a segment at all")
    with pytest.raises(StoreServiceError, match="DATA_LOSS.*not a segment"):
        other.load(tiers / "bad", ["00000001.seg"])
    assert not (tiers / "u@0" / "00000001.seg").exists()
    for tier, value in ((mine, 7), (other, 0xEE)):
        found, data = tier.read(np.array([5], dtype=np.int64))
        assert found.all() and (data == value).all()
    with pytest.raises(StoreServiceError, match="PERMISSION_DENIED.*own --dir"):
        other.snapshot(tiers)
    big = client.open_tier("big@0", 10 * ROWS, WIDTH, reset=True, owner="/runs/b")
    big.write(np.array([5 * ROWS], dtype=np.int64), np.full((1, WIDTH), 1, dtype=np.uint8))
    (name, _), = big.snapshot(tiers / "big-snap")
    with pytest.raises(StoreServiceError, match=f"DATA_LOSS.*rows outside \\[0, {ROWS}\\)"):  # whole, too wide
        other.load(tiers / "big-snap", [name])
    assert other.snapshot(tiers / "snap")  # a directory of its own: allowed
    with pytest.raises(StoreServiceError, match="FAILED_PRECONDITION.*no piece's tier directory"):
        client.open_tier("snap", ROWS, WIDTH, owner="/runs/c")  # a key naming a snapshot: never taken over
    assert len(list((tiers / "snap").glob("*.seg"))) == 1
    other.close()
    again = client.open_tier("u@0", ROWS, WIDTH, owner="/runs/b")
    found, data = again.read(np.array([5], dtype=np.int64))
    assert found.all() and (data == 0xEE).all()


def test_a_corrupt_segment_is_named(tmp_path, service):
    _, client = service
    tier = client.open_tier("t@0", ROWS, WIDTH, reset=True)
    tier.write(np.arange(10, dtype=np.int64), np.ones((10, WIDTH), dtype=np.uint8))
    tier.close()
    segment = next((tmp_path / "tiers" / "t@0").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0x40
    segment.write_bytes(bytes(data))
    with pytest.raises(StoreServiceError, match=f"DATA_LOSS.*{re.escape(str(segment))}"):
        client.open_tier("t@0", ROWS, WIDTH)


def test_a_trainer_whose_store_service_is_killed_stops_with_its_name(criteo_dataset, demo_kernels, tmp_path):
    service = subprocess.Popen([*NEOREC, "store", "serve", "--dir",
                                str(tmp_path / "tiers"), "--data-root", str(tmp_path)],  # the run's checkpoints
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = service.stdout.readline().split()[-1]
        trainer = subprocess.Popen(
            [*NEOREC, "train", "configs/demo.toml",
             "--set", f"data.path='{criteo_dataset.root}'", "--set", f"run.dir='{tmp_path / 'run'}'",
             "--set", "train.batch_size=64", "--set", "train.epochs=1000", "--set", "model.max_table_rows=5000",
             "--set", "train.log_every=5",
             "--set", 'embedding_store.tables={t_C3 = 0.01}', "--set", f"embedding_store.service='{address}'"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text()) and time.monotonic() < deadline:
            assert trainer.poll() is None, trainer.stderr.read()
            time.sleep(0.2)
        assert metrics.is_file(), "training did not start"  # steps went through the service
        service.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = trainer.communicate(timeout=60)
        assert time.monotonic() - killed < 15
        assert trainer.returncode == 2, stderr
        assert f"store service {address}" in stderr and "Traceback" not in stderr, stderr
    finally:
        service.kill()


def test_a_tier_closes_at_once_once_its_service_is_gone(tmp_path):
    server = StoreServer(tmp_path / "tiers")
    server.start()
    client = StoreClient(server.address)
    try:
        tier = client.open_tier("t@0", ROWS, WIDTH)
        server.stop()
        with pytest.raises(StoreServiceError, match="Read failed with UNAVAILABLE"):
            tier.read(np.arange(3))
        tier.close()  # a failed run releases its tiers: nothing to ask a service that is gone
    finally:
        client.close()
        server.stop()


def test_a_tier_closes_at_once_once_its_service_stopped_answering(tmp_path):
    with socket.socket() as silent:  # a hung service: connections are taken, never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        client = StoreClient(f"127.0.0.1:{silent.getsockname()[1]}")
        try:
            with pytest.raises(StoreServiceError, match="Status failed with DEADLINE_EXCEEDED"):
                client.status(timeout_s=0.5)
            started = time.monotonic()
            RemoteTier(client, "t@0", ROWS, WIDTH, lease=1).close()
            assert time.monotonic() - started < 1.0  # not another call's deadline
        finally:
            client.close()


def test_a_stopped_service_is_noticed_within_seconds_not_at_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "PING_EVERY_S", 1.5)
    monkeypatch.setattr(client_module, "PING_TIMEOUT_S", 1.5)
    service = subprocess.Popen([*NEOREC, "store", "serve", "--dir",
                                str(tmp_path / "tiers"), "--data-root", str(tmp_path)],  # the run's checkpoints
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    client = None
    try:
        client = StoreClient(service.stdout.readline().split()[-1])
        tier = client.open_tier("t@0", ROWS, WIDTH, reset=True)
        tier.write(np.arange(3), np.ones((3, WIDTH), dtype=np.uint8))
        service.send_signal(signal.SIGSTOP)  # the process is there, its port open: it just never answers
        started = time.monotonic()
        with pytest.raises(StoreServiceError, match="Read failed with UNAVAILABLE"):
            tier.read(np.arange(3))
        assert time.monotonic() - started < 10  # the call's deadline is 60 s
        started = time.monotonic()
        tier.close()
        assert time.monotonic() - started < 1.0
    finally:
        if client is not None:
            client.close()
        service.kill()
        service.wait()


def test_a_slow_call_outlives_the_pings_that_watch_it(tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "PING_EVERY_S", 1.5)
    monkeypatch.setattr(client_module, "PING_TIMEOUT_S", 1.5)
    flush = StoreServicer.Flush

    def slow_flush(self, request, context):
        time.sleep(7)  # no data either way meanwhile: only pings (a server that refused them would close the call)
        return flush(self, request, context)

    monkeypatch.setattr(StoreServicer, "Flush", slow_flush)
    server = StoreServer(tmp_path / "tiers")
    server.start()
    client = StoreClient(server.address)
    try:
        tier = client.open_tier("t@0", ROWS, WIDTH, reset=True)
        tier.write(np.arange(3), np.ones((3, WIDTH), dtype=np.uint8))
        tier.flush(sync=True)
        found, data = tier.read(np.arange(4))
        assert found.tolist() == [True, True, True, False] and (data[:3] == 1).all()
    finally:
        client.close()
        server.stop()


def test_a_piece_the_disk_cannot_hold_is_resource_exhausted_and_leaves_nothing(service, tmp_path, monkeypatch):
    _, client = service

    def too_large(directory, *args, **kwargs):
        directory.mkdir()
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr("neorec.embedding_store.service.SegmentTier", too_large)
    with pytest.raises(StoreServiceError, match=f"Open failed with RESOURCE_EXHAUSTED: piece 'big@0': {2**40} rows "
                                                f"of {WIDTH} bytes do not fit on this service's disk: File too large"):
        client.open_tier("big@0", 2**40, WIDTH)
    assert not (tmp_path / "tiers" / "big@0").exists()
