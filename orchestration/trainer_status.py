"""Trainer rank 0's status service: ``grpc.health.v1`` and ``neorec.trainer.Trainer/Status``
(step, epoch, QPS, loss, input wait, last checkpoint; following partitions: the partition
and its lag), fed by the training loop's progress
reports, so that the launcher sees a hung trainer and ``neorec status`` shows progress."""

from __future__ import annotations

import threading
import time

import grpc

from neorec.common.transport import RESERVED_THREADS, HostedServer, ServerSecurity, ServiceHost, parsed
from neorec.protos import trainer_pb2, trainer_pb2_grpc
from neorec.trainer.run.step import StepReport

SERVICE_NAME = "neorec.trainer.Trainer"
MAX_REQUEST_BYTES = 1 << 16


class TrainerStatusServer(HostedServer, trainer_pb2_grpc.TrainerServicer):
    """Serves the latest :class:`~neorec.trainer.run.step.StepReport` on ``host:port`` (0: a free one)."""

    def __init__(self, host: str, port: int, world_size: int, security: ServerSecurity = ServerSecurity()) -> None:
        self._lock = threading.Lock()
        self._report: StepReport | None = None
        self._reported_at = time.monotonic()
        self._started = time.monotonic()
        self._phase = "starting"
        self.world_size = world_size
        handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Status": grpc.unary_unary_rpc_method_handler(
                parsed(self.Status, trainer_pb2.StatusRequest),
                response_serializer=trainer_pb2.StatusReply.SerializeToString)})
        self.host = ServiceHost(host, port, security, RESERVED_THREADS, [handler], [SERVICE_NAME], MAX_REQUEST_BYTES,
                                MAX_REQUEST_BYTES)

    def stop(self, grace_s: float = 1.0) -> None:
        self.host.draining()
        self.host.stop(grace_s)

    def update(self, report: StepReport) -> None:
        """The loop took a step (or, following partitions, waits for the next one)."""
        with self._lock:
            if report.phase == "training" or self._report is None:
                self._reported_at = time.monotonic()  # waiting for a partition is no stall
            self._report = report
            self._phase = report.phase

    def done(self) -> None:
        with self._lock:
            self._phase = "done"

    def Status(self, request: trainer_pb2.StatusRequest, context: grpc.ServicerContext) -> trainer_pb2.StatusReply:
        with self._lock:
            report, phase = self._report, self._phase
            now = time.monotonic()
            reply = trainer_pb2.StatusReply(world_size=self.world_size, uptime_seconds=now - self._started,
                                            seconds_since_step=now - self._reported_at, phase=phase)
        if report is not None:
            reply.step = report.global_step
            reply.total_steps = report.total_steps
            reply.epoch = report.epoch
            reply.qps = report.qps
            reply.loss = report.loss
            reply.input_wait_frac = report.input_wait_frac
            reply.last_checkpoint = report.last_checkpoint
            reply.partition = report.partition
            if report.marker_time:
                reply.partition_lag_seconds = max(0.0, time.time() - report.marker_time)
            for table, counts in report.dynamic.items():
                reply.dynamic[table].CopyFrom(trainer_pb2.DynamicTableCounters(**counts))
        return reply
