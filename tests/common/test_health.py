"""The health probe against a real gRPC health service on a loopback port: SERVING resets
the misses, anything else (another status, an RPC error, no answer in time) counts one
more in a row and says why."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from neorec.common.health import HealthProbe

SERVICE = "neorec.test.Service"


class _SlowHealth(health.HealthServicer):
    """Answers every check after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def Check(self, request, context):
        time.sleep(self.delay_s)
        return super().Check(request, context)


@pytest.fixture
def served():
    def start(servicer: health.HealthServicer) -> tuple[grpc.Server, str]:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return server, f"127.0.0.1:{port}"

    servers: list[grpc.Server] = []
    yield start
    for server in servers:
        server.stop(None)


def _answered(probe: HealthProbe) -> None:
    """Wait until the probe in flight has its answer."""
    deadline = time.monotonic() + 30
    while not probe._future.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_serving_not_serving_and_a_stopped_server_are_counted(served):
    servicer = health.HealthServicer()
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    server, address = served(servicer)
    with grpc.insecure_channel(address) as channel:
        probe = HealthProbe(channel, SERVICE, interval_s=30.0)
        probe.tick(0.0)
        _answered(probe)
        servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        probe.tick(10.0)  # within the interval: nothing happens
        assert probe.misses == 0 and not probe.answered
        probe.tick(30.0)
        assert probe.misses == 0 and probe.answered and probe.last_error == ""
        _answered(probe)
        probe.tick(60.0)
        assert probe.misses == 1 and probe.last_error == "NOT_SERVING"
        _answered(probe)
        server.stop(None)
        probe.tick(90.0)
        assert probe.misses == 2 and probe.last_error == "NOT_SERVING"
        _answered(probe)
        probe.tick(120.0)
        assert probe.misses == 3 and probe.last_error.startswith("UNAVAILABLE")
        assert probe.answered
        probe.reset()
        assert (probe.misses, probe.answered, probe.last_error) == (0, False, "")
        probe.cancel()


def test_a_service_that_does_not_answer_within_the_interval_misses(served):
    servicer = _SlowHealth(delay_s=2.0)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    _, address = served(servicer)
    with grpc.insecure_channel(address) as channel:
        probe = HealthProbe(channel, SERVICE, interval_s=0.5)
        probe.tick(0.0)
        probe.tick(0.5)  # the first check is still waiting for its answer
        assert probe.misses == 1 and probe.last_error == "no answer within 0.5 s"
        assert not probe.answered
        probe.cancel()
