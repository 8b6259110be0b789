"""The trainer's side of a store service: each table piece's tier as a
:class:`RemoteTier` (the interface of :class:`~neorec.embedding_store.segments.SegmentTier`), its
calls sent to the service.

Reads and writes larger than a message are split. Every call has a deadline, and a
service that is gone or failing raises :class:`StoreServiceError` naming it (and the
status it answered) within seconds: training stops with that error rather than waiting.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np

from neorec.common.errors import UserError
from neorec.embedding_store.segments import TierStats
from neorec.embedding_store.service import MAX_REPLY_BYTES, MAX_REQUEST_BYTES
from neorec.common.transport import ClientSecurity, keepalive, read_token
from neorec.protos import store_pb2, store_pb2_grpc

CALL_TIMEOUT_S = 60.0
"""Longest a call may take (a sync flush or a snapshot of a large piece included)."""
PING_EVERY_S = 5.0
"""While a call is open the client pings the service this often (seconds)."""
PING_TIMEOUT_S = 5.0
"""A ping not answered within this many seconds fails the call (``UNAVAILABLE``): a service
that hangs (stopped, or its host gone) is noticed within ~10 s, not at a call's deadline."""
CHUNK_BYTES = 16 << 20
"""Row bytes per read or write call."""


UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""A call's status when the service is gone (killed, its port closed) or hung (stopped)."""


class StoreServiceError(UserError, RuntimeError):
    """The store service cannot be reached, or refused or failed a call; names it."""


class StoreClient:
    """A channel to the store service at ``address`` (``host:port``)."""

    def __init__(self, address: str, tls_ca: str = "", token_file: str = "") -> None:
        self.address = address
        security = ClientSecurity(tls_ca=tls_ca or None, token=read_token(token_file or None))
        self.channel = security.channel(address, [*keepalive(PING_EVERY_S, PING_TIMEOUT_S),
                                                  ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
                                                  ("grpc.max_send_message_length", MAX_REQUEST_BYTES)])
        self.stub = store_pb2_grpc.StoreStub(self.channel)
        self.unreachable = False
        """Whether a call found the service gone or not answering (then a failed run's
        tiers close without asking it)."""

    def call(self, name: str, request, timeout_s: float = CALL_TIMEOUT_S):
        """The reply of RPC ``name``; :class:`StoreServiceError` naming the service if it fails."""
        try:
            return getattr(self.stub, name)(request, timeout=timeout_s)
        except grpc.RpcError as err:
            self.unreachable = self.unreachable or err.code() in UNREACHABLE
            raise StoreServiceError(f"store service {self.address}: {name} failed with {err.code().name}: "
                                    f"{err.details()}") from None

    def open_tier(self, key: str, rows: int, row_bytes: int, reset: bool = False, owner: str = "") -> "RemoteTier":
        """The piece ``key`` on the service (``reset``: emptied first), held by ``owner``
        (a run's directory) until closed: the service refuses it to any other owner, and
        this tier's calls once the piece is opened again (see ``OpenReply.lease``)."""
        reply = self.call("Open", store_pb2.OpenRequest(key=key, rows=rows, row_bytes=row_bytes, reset=reset,
                                                        owner=owner))
        return RemoteTier(self, key, rows, row_bytes, reply.lease)

    def status(self, timeout_s: float = 5.0) -> store_pb2.StatusReply:
        return self.call("Status", store_pb2.StatusRequest(), timeout_s)

    def close(self) -> None:
        self.channel.close()


class RemoteTier:
    """Piece ``key`` of a store service, as a tier, held by ``lease`` (its Open's)."""

    def __init__(self, client: StoreClient, key: str, rows: int, row_bytes: int, lease: int) -> None:
        self.client = client
        self.key = key
        self.lease = lease
        self.rows = rows
        self.row_bytes = row_bytes
        self._chunk_rows = max(1, CHUNK_BYTES // (row_bytes + 1))

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, data)`` as :meth:`SegmentTier.read`."""
        rows = np.ascontiguousarray(rows, dtype="<i8")
        found = np.zeros(rows.size, dtype=bool)
        data = np.zeros((rows.size, self.row_bytes), dtype=np.uint8)
        for start in range(0, rows.size, self._chunk_rows):
            part = slice(start, min(start + self._chunk_rows, rows.size))
            reply = self.client.call("Read", store_pb2.ReadRequest(key=self.key, rows=rows[part].tobytes(),
                                                                           lease=self.lease))
            count = part.stop - part.start
            if len(reply.found) != count or len(reply.data) != count * self.row_bytes:
                raise StoreServiceError(f"store service {self.client.address}: Read of {count} rows of piece "
                                        f"{self.key!r} answered {len(reply.found)} rows, {len(reply.data)} bytes")
            found[part] = np.frombuffer(reply.found, dtype=np.uint8).astype(bool)
            data[part] = np.frombuffer(reply.data, dtype=np.uint8).reshape(count, self.row_bytes)
        return found, data

    def write(self, rows: np.ndarray, data: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype="<i8")
        data = np.ascontiguousarray(data, dtype=np.uint8)
        for start in range(0, rows.size, self._chunk_rows):
            part = slice(start, min(start + self._chunk_rows, rows.size))
            self.client.call("Write", store_pb2.WriteRequest(key=self.key, rows=rows[part].tobytes(),
                                                             data=data[part].tobytes(), lease=self.lease))

    def flush(self, sync: bool = False) -> None:
        self.client.call("Flush", store_pb2.FlushRequest(key=self.key, sync=sync, lease=self.lease))

    def snapshot(self, directory: Path) -> list[tuple[str, int]]:
        reply = self.client.call("Snapshot", store_pb2.SnapshotRequest(
            key=self.key, directory=str(Path(directory).absolute()), lease=self.lease))
        return [(f.name, f.bytes) for f in reply.files]

    def load(self, directory: Path, names: list[str], checked: bool = False) -> None:
        """(The service checks the segments whatever ``checked`` says: a request is not trusted.)"""
        self.client.call("Load", store_pb2.LoadRequest(key=self.key, directory=str(Path(directory).absolute()),
                                                       names=names, lease=self.lease))

    def counters(self) -> TierStats:
        """The piece's counters, as the service reports them."""
        for piece in self.client.status().pieces:
            if piece.key == self.key:
                return TierStats(rows_read=piece.rows_read, rows_found=piece.rows_found, bytes_read=piece.bytes_read,
                                 bytes_written=piece.bytes_written, dirty_bytes=piece.dirty_bytes,
                                 compactions=piece.compactions, segments=piece.segments, live_rows=piece.live_rows,
                                 stored_rows=piece.stored_rows, buffered_rows=piece.buffered_rows)
        raise StoreServiceError(f"store service {self.client.address} no longer holds piece {self.key!r}")

    def close(self) -> None:
        """Close the piece on the service; once the service was found gone or hung, return
        at once (a service that answers again reopens the piece at the next ``Open``), so
        that a failed run's error is the failure, not a cleanup waiting for a deadline."""
        if not self.client.unreachable:
            self.client.call("Close", store_pb2.CloseRequest(key=self.key, lease=self.lease))
