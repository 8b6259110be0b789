"""Probing a service's ``grpc.health.v1`` over time: one probe in flight at a time, an
answer within the interval or a miss, the misses counted in a row.

The reader client uses it to stop giving tasks to a worker that stopped answering; the
launcher's supervisor, to restart a service that did. Answering is what counts: a stopped
process accepts the TCP connection but never answers, which a connection check alone
would not notice.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class HealthProbe:
    """Probes ``service`` over ``channel`` every ``interval_s`` (driven by :meth:`tick`).

    Each probe gets ``interval_s`` to answer: SERVING sets ``misses`` back to 0, anything
    else (another status, an RPC error, no answer) counts one more miss in a row and says
    why in ``last_error``. The probe never blocks: it starts an asynchronous check and reads
    the previous one's answer. The channel is the caller's (closed by the caller).
    """

    def __init__(self, channel: grpc.Channel, service: str, interval_s: float) -> None:
        self.channel = channel
        self.service = service
        self.interval_s = interval_s
        self.stub = health_pb2_grpc.HealthStub(channel)
        self.misses = 0
        self.answered = False
        """Whether it ever answered SERVING (a process still starting has not)."""
        self.last_error = ""
        """Why the last probe missed ("" when it answered SERVING)."""
        self._future: grpc.Future | None = None
        self._next = 0.0

    def tick(self, now: float) -> None:
        """Probe if ``interval_s`` passed since the last probe (``now``: ``time.monotonic()``)."""
        if now < self._next:
            return
        self._next = now + self.interval_s
        previous, self._future = self._future, None
        if previous is not None:
            self._count(previous)
        self._future = self.stub.Check.future(health_pb2.HealthCheckRequest(service=self.service),
                                              timeout=self.interval_s)

    def _count(self, answer: grpc.Future) -> None:
        serving = False
        if answer.done():
            try:
                status = answer.result().status
                serving = status == health_pb2.HealthCheckResponse.SERVING
                self.last_error = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as err:
                self.last_error = f"{err.code().name}: {err.details()}"
        else:
            answer.cancel()
            self.last_error = f"no answer within {self.interval_s:g} s"
        self.misses = 0 if serving else self.misses + 1
        self.answered = self.answered or serving

    def reset(self) -> None:
        """The service was restarted: start counting afresh."""
        self.cancel()
        self.misses, self.answered, self.last_error, self._next = 0, False, "", 0.0

    def cancel(self) -> None:
        """Cancel the probe in flight (if any)."""
        if self._future is not None:
            self._future.cancel()
            self._future = None
