"""The trainer's status service as ``neorec status`` and the launcher read it: following
partitions, it names the partition and its lag, and waiting for one is not a stall."""

import time

import grpc
import pytest

from neorec.common.transport import ClientSecurity
from neorec.orchestration.status import probe
from neorec.orchestration.trainer_status import SERVICE_NAME, TrainerStatusServer
from neorec.trainer.run.step import StepReport


def test_status_names_the_partition_and_its_lag_and_waiting_is_no_stall():
    server = TrainerStatusServer("127.0.0.1", 0, world_size=1)
    server.start()
    try:
        marker = time.time() - 30.0
        server.update(StepReport(7, 1, 0.5, 100.0, 20, partition="2026-01-01T01", marker_time=marker))
        status = probe(server.address, ClientSecurity(), 5.0, with_status=True).status
        assert status["phase"] == "training" and status["partition"] == "2026-01-01T01"
        assert 30.0 <= status["partitionLagSeconds"] < 60.0
        assert status["secondsSinceStep"] < 5.0
        time.sleep(0.3)
        server.update(StepReport(9, 2, 0.0, 0.0, 9, partition="2026-01-01T01", marker_time=marker, phase="waiting"))
        status = probe(server.address, ClientSecurity(), 5.0, with_status=True).status
        assert status["phase"] == "waiting" and status["step"] == "9"
        assert status["secondsSinceStep"] >= 0.3  # the clock of the last step, not of the waiting report
    finally:
        server.stop(0.0)


def test_status_of_a_run_not_following_has_no_partition():
    server = TrainerStatusServer("127.0.0.1", 0, world_size=2)
    server.start()
    try:
        server.update(StepReport(3, 0, 0.6, 50.0, 10))
        status = probe(server.address, ClientSecurity(), 5.0, with_status=True).status
        assert status["partition"] == "" and status["partitionLagSeconds"] == 0.0 and status["worldSize"] == 2
    finally:
        server.stop(0.0)


def test_bytes_that_are_no_status_request_are_invalid_argument():
    server = TrainerStatusServer("127.0.0.1", 0, world_size=1)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = channel.unary_unary(f"/{SERVICE_NAME}/Status", request_serializer=lambda raw: raw,
                                       response_deserializer=lambda raw: raw)
            with pytest.raises(grpc.RpcError) as caught:
                call(b"\xff\xff garbage", timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not gRPC's own INTERNAL
        assert caught.value.details().startswith("the request is not a neorec.trainer.StatusRequest")
    finally:
        server.stop(0.0)
