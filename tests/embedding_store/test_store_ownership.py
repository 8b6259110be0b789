"""A store directory has one owner, and a store service stays in its roots.

- ``Snapshot`` and ``Load`` use directories under the service's data roots only (default:
  its ``--dir``): any other directory, however spelled (``..``, a symlink), is refused with
  PERMISSION_DENIED naming it; a configured token is required on loopback too
  (UNAUTHENTICATED), on a real server.
- A second store service, or a trainer, on a directory a store service owns fails at once
  with exit 2 and one line naming the directory and the owner's PID (real processes).
"""

from __future__ import annotations

import os
import subprocess
import time

import grpc
import numpy as np
import pytest

from neorec.common.transport import ServerSecurity
from neorec.embedding_store.client import StoreClient, StoreServiceError
from neorec.embedding_store.segments import SegmentTier
from neorec.embedding_store.service import StoreServer
from neorec.common.dir_lock import DirectoryInUseError
from neorec.protos import store_pb2
from tests.cli import NEOREC

ROWS, WIDTH = 100, 8


@pytest.fixture
def server(tmp_path):
    server = StoreServer(tmp_path / "service")
    server.start()
    yield server
    server.stop()


def _code(err: StoreServiceError) -> str:
    return str(err).split(" failed with ")[1].split(":")[0]


def test_snapshot_and_load_stay_under_the_data_roots(server, tmp_path):
    client = StoreClient(server.address)
    try:
        tier = client.open_tier("t@0", ROWS, WIDTH)
        tier.write(np.arange(4, dtype=np.int64), np.ones((4, WIDTH), dtype=np.uint8))
        assert tier.snapshot(tmp_path / "service" / "snap")  # inside its own --dir: allowed
        (tmp_path / "service" / "escape").symlink_to(tmp_path)
        for outside in (tmp_path / "elsewhere", tmp_path / "service" / ".." / "elsewhere",
                        tmp_path / "service" / "escape" / "elsewhere"):
            with pytest.raises(StoreServiceError) as info:
                tier.snapshot(outside)
            assert _code(info.value) == "PERMISSION_DENIED" and str(outside) in str(info.value)
        assert not (tmp_path / "elsewhere").exists()
        with pytest.raises(StoreServiceError) as info:
            tier.load(tmp_path, ["00000001.seg"])
        assert _code(info.value) == "PERMISSION_DENIED" and str(tmp_path) in str(info.value)
    finally:
        client.close()


def test_more_data_roots_can_be_given(tmp_path):
    server = StoreServer(tmp_path / "service", data_roots=[tmp_path / "service", tmp_path / "checkpoints"])
    server.start()
    client = StoreClient(server.address)
    try:
        tier = client.open_tier("t@0", ROWS, WIDTH)
        tier.write(np.arange(4, dtype=np.int64), np.ones((4, WIDTH), dtype=np.uint8))
        names = [name for name, _ in tier.snapshot(tmp_path / "checkpoints" / "step-1")]
        tier.load(tmp_path / "checkpoints" / "step-1", names)
        with pytest.raises(StoreServiceError, match="PERMISSION_DENIED"):
            tier.snapshot(tmp_path / "other")
    finally:
        client.close()
        server.stop()


def test_the_token_is_required_on_loopback(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    server = StoreServer(tmp_path / "service", security=ServerSecurity(token="s3cret"))
    server.start()
    anonymous, holder = StoreClient(server.address), StoreClient(server.address, token_file=str(tmp_path / "token"))
    try:
        for method, request in (("Snapshot", store_pb2.SnapshotRequest(key="t@0", directory=str(tmp_path / "s"))),
                                ("Load", store_pb2.LoadRequest(key="t@0", directory=str(tmp_path), names=[])),
                                ("Open", store_pb2.OpenRequest(key="t@0", rows=ROWS, row_bytes=WIDTH))):
            with pytest.raises(grpc.RpcError) as info:
                getattr(anonymous.stub, method)(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        holder.open_tier("t@0", ROWS, WIDTH).snapshot(tmp_path / "service" / "snap")
        assert not (tmp_path / "s").exists()
    finally:
        anonymous.close()
        holder.close()
        server.stop()


def test_one_owner_per_directory_in_one_process(tmp_path):
    tier = SegmentTier(tmp_path / "t", ROWS, WIDTH)
    with pytest.raises(DirectoryInUseError, match=f"{tmp_path / 't'} is in use by process {os.getpid()}"):
        SegmentTier(tmp_path / "t", ROWS, WIDTH)
    tier.close()
    SegmentTier(tmp_path / "t", ROWS, WIDTH).close()  # released on close


def test_a_second_owner_of_a_service_directory_fails_at_once(criteo_dataset, tmp_path):
    directory = tmp_path / "tiers"
    first = subprocess.Popen([*NEOREC, "store", "serve", "--dir", str(directory)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert "serving" in first.stdout.readline()
        started = time.monotonic()
        second = subprocess.run([*NEOREC, "store", "serve", "--dir", str(directory)], capture_output=True, text=True,
                                timeout=60)
        trainer = subprocess.run(
            [*NEOREC, "train", "configs/demo.toml", "--set", f"data.path='{criteo_dataset.root}'",
             "--set", f"run.dir='{tmp_path / 'run'}'", "--set", "model.max_table_rows=5000",
             "--set", 'embedding_store.tables={t_C3 = 0.01}', "--set", f"embedding_store.dir='{directory}'"],
            capture_output=True, text=True, timeout=120)
        assert time.monotonic() - started < 90
        for result in (second, trainer):
            assert result.returncode == 2, result.stderr
            assert "Traceback" not in result.stderr, result.stderr
            errors = [line for line in result.stderr.splitlines() if line.startswith("neorec: error:")]
            assert len(errors) == 1, result.stderr
            assert f"store directory {directory}" in errors[0] and f"in use by process {first.pid}" in errors[0]
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert first.poll() is None  # the owner serves on
    finally:
        first.terminate()
        first.wait(timeout=30)
