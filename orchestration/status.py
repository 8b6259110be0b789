"""``neorec status``: probe services as ``grpc_health_probe`` does (same exit codes), and read
their live counters.

Exit codes: 0 every service SERVING, 1 bad arguments, 2 a service could not be connected to
(not listening, or not answering: a stopped process accepts the TCP connection but never
the handshake), 3 the health check failed as an RPC, 4 a service answered NOT_SERVING (or
another status). With several services the worst code wins.

A service is one of neorec's: a reader service, an embedding store service or a trainer
(rank 0); the probe finds which from the health service names it knows, and ``Status``
then returns that service's counters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from neorec.common.errors import UserError
from neorec.common.transport import ClientSecurity
from neorec.protos import ingest_pb2, ingest_pb2_grpc, store_pb2, store_pb2_grpc, trainer_pb2, trainer_pb2_grpc

SERVING, BAD_ARGUMENTS, CONNECT_FAILURE, RPC_FAILURE, NOT_SERVING = 0, 1, 2, 3, 4
SERVICES_FILE = "services.json"
"""Written by ``neorec launch`` into the run directory: the job's service addresses by role."""


def _ingest_status(channel: grpc.Channel, timeout: float) -> Any:
    return ingest_pb2_grpc.ReaderStub(channel).Status(ingest_pb2.StatusRequest(), timeout=timeout)


def _trainer_status(channel: grpc.Channel, timeout: float) -> Any:
    return trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.StatusRequest(), timeout=timeout)


def _store_status(channel: grpc.Channel, timeout: float) -> Any:
    return store_pb2_grpc.StoreStub(channel).Status(store_pb2.StatusRequest(), timeout=timeout)


KINDS = {"neorec.ingest.Reader": ("ingest", _ingest_status), "neorec.trainer.Trainer": ("trainer", _trainer_status),
         "neorec.store.Store": ("store", _store_status)}
"""Health service name → (role, how to read its Status)."""


@dataclass
class Probe:
    address: str
    code: int
    role: str = ""
    detail: str = ""
    status: dict[str, Any] = field(default_factory=dict)


def probe(address: str, security: ClientSecurity, timeout: float, with_status: bool) -> Probe:
    """Health-check ``address`` (and read its Status when ``with_status``)."""
    with security.channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return Probe(address, CONNECT_FAILURE, detail=f"no connection within {timeout:g} s")
        health = health_pb2_grpc.HealthStub(channel)
        try:
            overall = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as err:
            return Probe(address, RPC_FAILURE, detail=f"health check: {err.code().name}: {err.details()}")
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(overall.status)
        result = Probe(address, SERVING if overall.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING,
                       detail=name)
        for service, (role, read_status) in KINDS.items():
            try:
                health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            except grpc.RpcError:
                continue
            result.role = role
            if with_status:
                try:
                    result.status = MessageToDict(read_status(channel, timeout),
                                                  always_print_fields_with_no_presence=True)
                except grpc.RpcError as err:
                    result.code = max(result.code, RPC_FAILURE)
                    result.detail = f"Status: {err.code().name}: {err.details()}"
            break
        return result


class TargetError(UserError, ValueError):
    """A ``neorec status`` target is neither ``host:port`` nor a job's run directory."""


def job_services(run_dir: str | Path) -> list[str]:
    """The addresses ``neorec launch`` recorded for a job's run directory."""
    path = Path(run_dir) / SERVICES_FILE
    try:
        services = json.loads(path.read_text())
    except FileNotFoundError:
        raise TargetError(f"{run_dir} is a directory without {SERVICES_FILE}: not the run directory of a "
                         f"`neorec launch` job") from None
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8 text
        raise TargetError(f"{path}: not a job's services file: {err}") from None
    if not (isinstance(services, dict) and all(isinstance(a, list) and all(isinstance(x, str) for x in a)
                                               for a in services.values())):
        raise TargetError(f"{path}: not a job's services file (an object of roles, each a list of addresses)")
    addresses = [address for addresses in services.values() for address in addresses]
    if not addresses:
        raise TargetError(f"{path}: lists no service")
    return addresses

