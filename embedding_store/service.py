"""The embedding store service (``neorec store serve``): the SSD tiers of store tables,
served over gRPC to trainers that keep their caches in memory.

It runs the code of the embedded store: each table piece (a key such as ``t_C1@0``) is a
:class:`~neorec.embedding_store.segments.SegmentTier` under the service's directory. Requests
carry rows as raw bytes (:mod:`neorec.protos.store_pb2`). A bad request ends with a gRPC status
naming what is wrong and changes nothing: an unknown key (NOT_FOUND), ids out of range,
sizes that do not match, a malformed key or path (INVALID_ARGUMENT), a piece reopened with
another shape or opened by another owner than the one holding it, a call with a lease the
piece no longer has (FAILED_PRECONDITION), a corrupt segment (DATA_LOSS, naming the file).

A piece has one owner while it is open (``OpenRequest.owner``: a run's directory), so that
two runs given one service cannot write each other's rows; the owner reopens it at will (a
restarted or resumed run), and ``Close`` releases it. Each Open answers a new lease, which
every later call on the piece must give: once a piece is opened again, only its newest
opener reads and writes it, so a stale trainer of the same run (a second trainer where the
run directory cannot be locked, an old process that lived on) is refused at its next call
instead of interleaving its rows with the new one's.
Requests above :data:`MAX_REQUEST_BYTES` are refused by gRPC itself (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
import secrets
import threading
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np

from neorec.common.confine import confined, resolve_roots
from neorec.common.dir_lock import DirectoryLock
from neorec.embedding_store.segments import INDEX_FILE, SEGMENT_NAME, SegmentError, SegmentTier
from neorec.common.transport import (MAX_DETAILS_CHARS, RESERVED_THREADS, HostedServer, RequestError, ServerSecurity,
                                     ServiceHost, abort, parsed)
from neorec.protos import store_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "neorec.store.Store"
MAX_REQUEST_BYTES = 64 << 20
"""Largest request, and largest reply's rows; clients split larger reads and writes."""
MAX_REPLY_BYTES = MAX_REQUEST_BYTES + (1 << 20)
"""A reply of the most rows (their bytes and found flags), with its framing."""
MAX_PIECE_BYTES = 1 << 50
"""Bytes a piece's rows may take (rows × row_bytes): a pebibyte, beyond any one disk (a
larger request is a client's mistake, not a table)."""
DEFAULT_THREADS = 16
KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,199}")
"""A piece's key: a file name under the service's directory, no path."""


class StoreServicer:
    """The ``Store`` service over the tiers under ``directory``; ``Snapshot`` and ``Load``
    use directories under ``data_roots`` only (default: ``directory``)."""

    def __init__(self, directory: str | Path, direct_io: bool = False,
                 data_roots: Sequence[str | Path] | None = None) -> None:
        self.directory = Path(directory)
        self._owner = DirectoryLock(self.directory)  # the service owns its directory while it runs
        self.data_roots = resolve_roots(data_roots or [self.directory])
        self.direct_io = direct_io
        self._tiers: dict[str, SegmentTier] = {}
        self._owners: dict[str, str] = {}
        """The owner of each open piece (its Open's ``owner``)."""
        self._leases: dict[str, int] = {}
        """Each open piece's lease (issued by its newest Open)."""
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._counts = threading.Lock()
        self.requests = 0
        self.errors = 0

    # ---------------------------------------------------------------- the RPCs
    def Open(self, request: store_pb2.OpenRequest, context: grpc.ServicerContext) -> store_pb2.OpenReply:
        return self._serve(context, lambda: self._open(request))

    def Read(self, request: store_pb2.ReadRequest, context: grpc.ServicerContext) -> store_pb2.ReadReply:
        def read() -> store_pb2.ReadReply:
            with self._held(request.key, request.lease) as tier:
                rows = _ids(request.rows, tier)
                if rows.size * (tier.row_bytes + 1) > MAX_REQUEST_BYTES:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"{rows.size} rows of {tier.row_bytes} bytes exceed the "
                                       f"{MAX_REQUEST_BYTES}-byte reply limit: ask for fewer")
                found, data = tier.read(rows)
            return store_pb2.ReadReply(found=found.astype(np.uint8).tobytes(), data=data.tobytes())

        return self._serve(context, read)

    def Write(self, request: store_pb2.WriteRequest, context: grpc.ServicerContext) -> store_pb2.WriteReply:
        def write() -> store_pb2.WriteReply:
            with self._held(request.key, request.lease) as tier:
                rows = _ids(request.rows, tier)
                if len(request.data) != rows.size * tier.row_bytes:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"{len(request.data)} data bytes for {rows.size} rows of {tier.row_bytes} bytes")
                if np.unique(rows).size != rows.size:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "rows to write must be distinct")
                tier.write(rows, np.frombuffer(request.data, dtype=np.uint8).reshape(rows.size, tier.row_bytes))
            return store_pb2.WriteReply()

        return self._serve(context, write)

    def Flush(self, request: store_pb2.FlushRequest, context: grpc.ServicerContext) -> store_pb2.FlushReply:
        def flush() -> store_pb2.FlushReply:
            with self._held(request.key, request.lease) as tier:
                tier.flush(sync=request.sync)
            return store_pb2.FlushReply()

        return self._serve(context, flush)

    def Snapshot(self, request: store_pb2.SnapshotRequest,
                 context: grpc.ServicerContext) -> store_pb2.SnapshotReply:
        def snapshot() -> store_pb2.SnapshotReply:
            with self._held(request.key, request.lease) as tier:
                files = tier.snapshot(self._directory(request.directory))
            return store_pb2.SnapshotReply(files=[store_pb2.SegmentFile(name=n, bytes=b) for n, b in files])

        return self._serve(context, snapshot)

    def Load(self, request: store_pb2.LoadRequest, context: grpc.ServicerContext) -> store_pb2.LoadReply:
        def load() -> store_pb2.LoadReply:
            with self._held(request.key, request.lease) as tier:
                names = list(request.names)
                bad = [n for n in names if not SEGMENT_NAME.fullmatch(n)]
                if bad:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"not a segment file name: {bad[0]!r}")
                directory = self._directory(request.directory)
                missing = [n for n in names if not (directory / n).is_file()]
                if missing:
                    raise RequestError(grpc.StatusCode.NOT_FOUND, f"{directory / missing[0]} does not exist")
                tier.load(directory, names)
            return store_pb2.LoadReply()

        return self._serve(context, load)

    def Close(self, request: store_pb2.CloseRequest, context: grpc.ServicerContext) -> store_pb2.CloseReply:
        def close() -> store_pb2.CloseReply:
            key = _key(request.key)
            with self._lock:  # closed before another Open of the key can open its directory again
                tier = self._tiers.get(key)
                if tier is not None:
                    with tier.lock:  # after any call in flight on it (see _held)
                        self._check_lease(key, request.lease)
                        tier.close()
                        del self._tiers[key], self._owners[key], self._leases[key]
            return store_pb2.CloseReply()

        return self._serve(context, close)

    def Status(self, request: store_pb2.StatusRequest, context: grpc.ServicerContext) -> store_pb2.StatusReply:
        with self._lock:
            tiers, owners = dict(self._tiers), dict(self._owners)
        pieces = []
        for key, tier in sorted(tiers.items()):
            c = tier.counters()
            pieces.append(store_pb2.PieceStatus(
                key=key, rows=tier.rows, row_bytes=tier.row_bytes, live_rows=c.live_rows, stored_rows=c.stored_rows,
                segments=c.segments, rows_read=c.rows_read, rows_found=c.rows_found, bytes_read=c.bytes_read,
                bytes_written=c.bytes_written, dirty_bytes=c.dirty_bytes, compactions=c.compactions,
                buffered_rows=c.buffered_rows, owner=owners.get(key, "")))
        return store_pb2.StatusReply(pieces=pieces, directory=str(self.directory), requests=self.requests,
                                     errors=self.errors, uptime_seconds=time.monotonic() - self._started,
                                     data_roots=[str(root) for root in self.data_roots])

    def close(self) -> None:
        """Write every buffered row and close the tiers."""
        with self._lock:
            tiers, self._tiers, self._owners, self._leases = list(self._tiers.values()), {}, {}, {}
        for tier in tiers:
            tier.close()
        self._owner.release()

    # ------------------------------------------------------------------ helpers
    def _serve(self, context: grpc.ServicerContext, handle: Callable):
        with self._counts:
            self.requests += 1
        try:
            return handle()
        except RequestError as err:
            self._refuse(context, err.code, str(err))
        except IndexError as err:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except SegmentError as err:
            self._refuse(context, grpc.StatusCode.DATA_LOSS, str(err))
        except OSError as err:
            self._refuse(context, grpc.StatusCode.INTERNAL, f"{err.filename or self.directory}: {err.strerror or err}")

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        with self._counts:
            self.errors += 1
        log.info("request refused with %s: %s", code.name, message[:MAX_DETAILS_CHARS])
        abort(context, code, message)

    def _open(self, request: store_pb2.OpenRequest) -> store_pb2.OpenReply:
        key = _key(request.key)
        if request.rows <= 0 or request.row_bytes <= 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"piece {key!r}: rows and row_bytes must be positive")
        if request.rows * request.row_bytes >= MAX_PIECE_BYTES:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"piece {key!r}: {request.rows} rows of "
                               f"{request.row_bytes} bytes are more than a piece may hold ({MAX_PIECE_BYTES} bytes)")
        with self._lock:
            tier = self._tiers.get(key)
            if tier is not None:
                self._check_owner(key, request.owner)
            if tier is not None and (tier.rows, tier.row_bytes) != (request.rows, request.row_bytes):
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"piece {key!r} is open with {tier.rows} rows of {tier.row_bytes} bytes, asked for "
                                   f"{request.rows} of {request.row_bytes}")
            if tier is None or request.reset:
                if tier is not None:
                    with tier.lock:  # after any call in flight on it (see _held)
                        tier.close()
                        del self._tiers[key]
                tier = self._new_tier(key, request)
                self._tiers[key] = tier
            with tier.lock:  # a call in flight under the old lease ends first (see _held)
                self._owners[key] = request.owner
                self._leases[key] = lease = 1 + secrets.randbits(63)
        return store_pb2.OpenReply(stored_rows=tier.counters().live_rows, lease=lease)

    def _new_tier(self, key: str, request: store_pb2.OpenRequest) -> SegmentTier:
        """The tier of piece ``key`` as ``request`` opens it; RESOURCE_EXHAUSTED when the disk
        cannot hold its files (too large a file, no space), and a directory made for it
        removed again."""
        directory = self.directory / key
        made = not directory.exists()
        if not made and not (directory / INDEX_FILE).exists() and any(directory.glob("*.seg")):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"piece {key!r}: {directory} holds segments but is no piece's tier directory (a "
                               f"snapshot's?): a piece never takes over another directory; give another key")
        try:
            return SegmentTier(directory, request.rows, request.row_bytes, direct_io=self.direct_io,
                               reset=request.reset)
        except OSError as err:
            if made:
                shutil.rmtree(directory, ignore_errors=True)
            if err.errno in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"piece {key!r}: {request.rows} rows of "
                                   f"{request.row_bytes} bytes do not fit on this service's disk: "
                                   f"{err.strerror or err}") from None
            raise

    def _check_owner(self, key: str, owner: str) -> None:
        """FAILED_PRECONDITION unless ``owner`` holds the open piece ``key`` (with the lock held)."""
        holder = self._owners.get(key, "")
        if owner != holder:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"cannot open piece {key!r} for {owner or 'an unnamed client'}: it is held by "
                               f"{holder or 'an unnamed client'} (one run at a time per piece: stop that run, or give "
                               f"this one another store service; a run whose trainer is gone releases its pieces when "
                               f"the service restarts)")

    def _directory(self, path: str) -> Path:
        """``path``, an absolute directory, if it resolves under a data root and is neither a
        piece's tier directory nor inside one (a snapshot there would replace that piece's
        segments, another run's too): else INVALID_ARGUMENT (not absolute) or
        PERMISSION_DENIED naming it."""
        if not path or not Path(path).is_absolute():
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"directory {path[:200]!r} must be an absolute path")
        if confined(path, self.data_roots) is None:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"directory {path[:200]} is outside this service's data roots "
                               f"(neorec store serve --data-root)")
        resolved, pieces = Path(path).resolve(), self.directory.resolve()
        if resolved == pieces:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"directory {path[:200]} is this service's own "
                                                                  f"--dir, where the pieces' tier directories lie")
        inside = resolved.relative_to(pieces).parts if resolved.is_relative_to(pieces) else ()
        if inside and (pieces / inside[0] / INDEX_FILE).is_file():  # a piece's tier directory is --dir/KEY
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"directory {path[:200]} is {'inside ' if len(inside) > 1 else ''}the tier directory "
                               f"{pieces / inside[0]} of a store piece, whose segments it would replace: snapshots "
                               f"and loads use a directory of their own")
        return Path(path)

    def _check_lease(self, key: str, lease: int) -> None:
        """FAILED_PRECONDITION unless ``lease`` is the open piece ``key``'s (with its lock held)."""
        if lease != self._leases[key]:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"piece {key!r} is held under a newer Open than this client's (by "
                               f"{self._owners[key] or 'an unnamed client'}): only the piece's newest opener may use "
                               f"it (is a second trainer of this run running?)")

    @contextmanager
    def _held(self, key: str, lease: int) -> Iterator[SegmentTier]:
        """The open piece ``key``, its lock held for the block, if ``lease`` is its lease
        then: else NOT_FOUND or FAILED_PRECONDITION. An Open or Close of the piece waits
        for the block to end, so that no call under an old lease lands after a new Open."""
        key = _key(key)
        with self._lock:
            tier = self._tiers.get(key)
        if tier is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"no piece {key!r} is open on this store service (Open it)")
        with tier.lock:
            # a piece's entries change only under its lock (Open and Close take it inside
            # the service's lock; never the other way round): they hold still from here
            if self._tiers.get(key) is not tier:  # closed or replaced (a reset Open) meanwhile
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"piece {key!r} was closed or reopened while this call waited for it")
            self._check_lease(key, lease)
            yield tier


def _key(key: str) -> str:
    if not KEY.fullmatch(key):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"piece key {key[:200]!r} is not a name of letters, digits and _.@-")
    return key


def _ids(raw: bytes, tier: SegmentTier) -> np.ndarray:
    if len(raw) % 8:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"rows must be int64: {len(raw)} bytes")
    rows = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= tier.rows):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"row ids must lie in [0, {tier.rows})")
    return rows


def store_handler(servicer: StoreServicer) -> grpc.GenericRpcHandler:
    methods = {
        "Open": (store_pb2.OpenRequest, store_pb2.OpenReply),
        "Read": (store_pb2.ReadRequest, store_pb2.ReadReply),
        "Write": (store_pb2.WriteRequest, store_pb2.WriteReply),
        "Flush": (store_pb2.FlushRequest, store_pb2.FlushReply),
        "Snapshot": (store_pb2.SnapshotRequest, store_pb2.SnapshotReply),
        "Load": (store_pb2.LoadRequest, store_pb2.LoadReply),
        "Close": (store_pb2.CloseRequest, store_pb2.CloseReply),
        "Status": (store_pb2.StatusRequest, store_pb2.StatusReply),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: grpc.unary_unary_rpc_method_handler(parsed(getattr(servicer, name), request),
                                                  response_serializer=reply.SerializeToString)
        for name, (request, reply) in methods.items()})


class StoreServer(HostedServer):
    """A store service process's server: ``Store`` and ``Health`` on one port (0: a free one)."""

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", port: int = 0, direct_io: bool = False,
                 threads: int = DEFAULT_THREADS, security: ServerSecurity = ServerSecurity(),
                 data_roots: Sequence[str | Path] | None = None) -> None:
        self.servicer = StoreServicer(directory, direct_io, data_roots)
        self.host = ServiceHost(host, port, security, threads + RESERVED_THREADS, [store_handler(self.servicer)],
                                [SERVICE_NAME], MAX_REQUEST_BYTES, MAX_REPLY_BYTES)

    def stop(self, grace_s: float = 1.0) -> None:
        """Health turns NOT_SERVING, calls in flight get ``grace_s``, then every buffered row
        is written and the tiers closed."""
        self.host.draining()
        self.host.stop(grace_s)
        self.servicer.close()
