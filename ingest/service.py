"""The reader service: a stateless gRPC worker that decodes requested rows into batches.

A ``Read`` request names a dataset directory, the rows to read (file, row group, row
range) and how to cut them into batches; the reply streams one ``Batch`` message per
batch, cut exactly as :func:`ingest.reader.batches_from_chunks` cuts them in process.
The worker keeps nothing between requests, so any worker can serve any request and a
client can re-request unfinished work from another worker.

Bad requests end with INVALID_ARGUMENT or NOT_FOUND, unreadable or invalid data with
DATA_LOSS (the message names file, row group and column), and the server keeps serving.
The process also serves ``grpc.health.v1.Health`` and a ``Status`` RPC with live counters.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ingest.batch import HostBatch, RowRange
from ingest.decoder import DENSE_TRANSFORMS, ID_MAPPINGS, DecodeOptions, decode_row_range, open_files, read_row_group
from ingest.errors import DataError
from ingest.plan import ReadTask
from ingest.reader import batches_from_chunks
from ingest.row_group_cache import DEFAULT_CAPACITY_BYTES, RowGroupCache
from ingest.schema import Dataset
from ingest.wire import MAX_MESSAGE_BYTES, SERVICE_NAME, serialize_batch
from protos import ingest_pb2, ingest_pb2_grpc

log = logging.getLogger(__name__)

MAX_BATCH_SIZE = 1 << 20
MAX_BATCHES_PER_REQUEST = 1 << 20
RATE_WINDOW_S = 5.0
SIGNAL_POLL_S = 0.2
"""How often the main thread of ``serve_until_signal`` wakes to run pending signal handlers."""


class RequestError(Exception):
    """A request the service refuses; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ReadJob:
    """A validated request: what to read and how."""

    dataset: Dataset
    paths: tuple[str, ...]
    metadata: dict[int, pq.FileMetaData]
    task: ReadTask
    options: DecodeOptions
    compression: int


def validate_request(request: ingest_pb2.ReadRequest) -> ReadJob:
    """Check a ``ReadRequest`` against the dataset on this worker's disk.

    Raises :class:`RequestError` (NOT_FOUND for an unknown dataset, split or file;
    INVALID_ARGUMENT for anything malformed).
    """
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if not 0 < request.batch_size <= MAX_BATCH_SIZE:
        raise RequestError(invalid, f"batch_size must lie in [1, {MAX_BATCH_SIZE}], got {request.batch_size}")
    if not 0 < request.num_batches <= MAX_BATCHES_PER_REQUEST:
        raise RequestError(invalid, f"num_batches must lie in [1, {MAX_BATCHES_PER_REQUEST}], got {request.num_batches}")
    if request.compression not in ingest_pb2.Compression.values():
        raise RequestError(invalid, f"unknown compression {request.compression}")
    try:
        dataset = Dataset.load(request.dataset)
    except FileNotFoundError as err:
        raise RequestError(grpc.StatusCode.NOT_FOUND, str(err)) from err
    except (OSError, ValueError, KeyError) as err:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"dataset {request.dataset}: {err}") from err
    if request.split not in dataset.splits:
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"dataset {request.dataset} has no split {request.split!r}")
    known = set(dataset.splits[request.split])
    for name in request.files:
        if name not in known:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"file {name!r} is not in split {request.split!r} of {request.dataset}")
    paths = tuple(str(dataset.root / name) for name in request.files)
    options = _decode_options(request.decode, dataset)
    ranges = tuple(RowRange(r.file, r.row_group, r.start, r.stop) for r in request.ranges)
    task = ReadTask(request.epoch, request.first_step, request.num_batches, request.batch_size, ranges)
    if task.num_rows > task.num_batches * task.batch_size:
        raise RequestError(invalid, f"{task.num_rows} rows do not fit in {task.num_batches} batches of {task.batch_size}")
    metadata = _check_ranges(ranges, paths, dataset)
    return ReadJob(dataset, paths, metadata, task, options, request.compression)


def _decode_options(spec: ingest_pb2.DecodeSpec, dataset: Dataset) -> DecodeOptions:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    features = len(dataset.schema.sparse)
    if len(spec.table_rows) != features:
        raise RequestError(invalid, f"decode.table_rows has {len(spec.table_rows)} entries, the dataset {features} sparse features")
    if spec.dense_transform not in DENSE_TRANSFORMS or spec.id_mapping not in ID_MAPPINGS:
        raise RequestError(invalid, f"decode: dense_transform must be one of {DENSE_TRANSFORMS} and "
                                    f"id_mapping one of {ID_MAPPINGS}")
    if any(rows <= 0 for rows in spec.table_rows):
        raise RequestError(invalid, "decode.table_rows must all be positive")
    return DecodeOptions(tuple(spec.table_rows), spec.dense_transform, spec.id_mapping)


def _check_ranges(
    ranges: tuple[RowRange, ...], paths: tuple[str, ...], dataset: Dataset
) -> dict[int, pq.FileMetaData]:
    """Every range must name a file of the request and lie inside one of its row groups.

    Returns the Parquet footers of the files the ranges read, by file index.
    """
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    used = sorted({r.file_index for r in ranges})
    if used and used[-1] >= len(paths):
        raise RequestError(invalid, f"a range names file {used[-1]}, the request lists {len(paths)} files")
    for index in used:
        if not Path(paths[index]).exists():
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"file {paths[index]} does not exist on this worker")
    metadata = {i: f.metadata for i, f in zip(used, open_files([paths[i] for i in used], dataset.schema))}
    for r in ranges:
        meta = metadata[r.file_index]
        if r.row_group >= meta.num_row_groups:
            raise RequestError(invalid, f"file {paths[r.file_index]} has {meta.num_row_groups} row groups, "
                                        f"the request reads row group {r.row_group}")
        rows = meta.row_group(r.row_group).num_rows
        if not r.start < r.stop <= rows:
            raise RequestError(invalid, f"rows [{r.start}, {r.stop}) are outside row group {r.row_group} "
                                        f"({rows} rows) of file {paths[r.file_index]}")
    return metadata


class ServiceCounters:
    """Thread-safe live counters of one worker process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests = 0
        self.batches = 0
        self.rows = 0
        self.bytes = 0
        self.errors = 0
        self.active = 0
        self._recent: deque[float] = deque()

    def stream_opened(self) -> None:
        with self._lock:
            self.requests += 1
            self.active += 1

    def stream_closed(self) -> None:
        with self._lock:
            self.active -= 1

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def served(self, rows: int, body_bytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.batches += 1
            self.rows += rows
            self.bytes += body_bytes
            self._recent.append(now)
            self._forget_before(now - RATE_WINDOW_S)

    def snapshot(self, shutting_down: bool) -> ingest_pb2.StatusReply:
        now = time.monotonic()
        with self._lock:
            self._forget_before(now - RATE_WINDOW_S)
            uptime = now - self.started
            return ingest_pb2.StatusReply(
                requests=self.requests,
                batches_served=self.batches,
                rows_served=self.rows,
                bytes_served=self.bytes,
                batches_per_second=len(self._recent) / min(RATE_WINDOW_S, max(uptime, 1e-9)),
                active_streams=self.active,
                errors=self.errors,
                uptime_seconds=uptime,
                shutting_down=shutting_down,
            )

    def _forget_before(self, horizon: float) -> None:
        while self._recent and self._recent[0] < horizon:
            self._recent.popleft()


class ReaderServicer(ingest_pb2_grpc.ReaderServicer):
    """Serves ``Read`` and ``Status``; decodes on a shared pool of ``decode_threads``,
    reading row groups through a :class:`RowGroupCache` of ``cache_bytes``."""

    def __init__(self, decode_threads: int, cache_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.counters = ServiceCounters()
        self.row_groups = RowGroupCache(cache_bytes)
        self.draining = threading.Event()
        """Set: new calls are refused with UNAVAILABLE."""
        self.aborting = threading.Event()
        """Set: open streams end with UNAVAILABLE before their next batch."""
        self._decode_threads = decode_threads
        self._pool = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode")

    def Read(self, request: ingest_pb2.ReadRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Streams serialized ``Batch`` messages (see :func:`ingest.wire.serialize_batch`)."""
        if self.draining.is_set():
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "the reader service is shutting down")
        try:
            job = validate_request(request)
        except RequestError as err:
            self._abort(context, err.code, str(err))
        except DataError as err:
            self._abort(context, grpc.StatusCode.DATA_LOSS, str(err))
        self.counters.stream_opened()
        try:
            yield from self._stream(job, context)
        finally:
            self.counters.stream_closed()

    def Status(self, request: ingest_pb2.StatusRequest, context: grpc.ServicerContext) -> ingest_pb2.StatusReply:
        reply = self.counters.snapshot(self.draining.is_set())
        reply.row_groups_read = self.row_groups.misses
        reply.row_group_cache_hits = self.row_groups.hits
        return reply

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _stream(self, job: ReadJob, context: grpc.ServicerContext) -> Iterator[bytes]:
        id_bound = max(job.options.table_rows, default=1)  # decoded ids lie below it
        try:
            for batch in batches_from_chunks(job.task, self._decoded(job), job.dataset.schema):
                if self.aborting.is_set():
                    self._abort(context, grpc.StatusCode.UNAVAILABLE, "the reader service is shutting down")
                message = serialize_batch(batch, id_bound, job.compression)
                if len(message) > MAX_MESSAGE_BYTES:
                    self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"batch step {batch.provenance.step} is {len(message)} bytes, "
                                f"above the {MAX_MESSAGE_BYTES}-byte message limit: use smaller batches")
                self.counters.served(batch.num_valid, len(message))
                yield message
        except DataError as err:
            self._abort(context, grpc.StatusCode.DATA_LOSS, str(err))

    def _decoded(self, job: ReadJob) -> Iterator[tuple[RowRange, HostBatch]]:
        """The job's rows decoded in order, in pieces, up to ``decode_threads`` of them ahead.

        A task of fewer ranges than decode threads is cut into that many pieces at batch
        boundaries (so no batch's provenance changes), which its threads decode at once.
        """
        schema = job.dataset.schema
        task = job.task
        pieces = task.ranges
        if 0 < len(pieces) < self._decode_threads:
            per_piece = -(-task.num_batches // self._decode_threads)
            pieces = tuple(r for part in task.split(per_piece) for r in part.ranges)

        def decode(r: RowRange) -> HostBatch:
            path = job.paths[r.file_index]

            def read() -> pa.Table:
                # A file object per read: reads run concurrently, footers are parsed once.
                parquet_file = pq.ParquetFile(path, metadata=job.metadata[r.file_index])
                return read_row_group(parquet_file, path, r.row_group, schema)

            try:
                table = self.row_groups.read(path, r.row_group, tuple(schema.columns), task.epoch, read)
            except OSError as err:  # the file went away or became unreadable since the request
                raise DataError(f"cannot read row group: {err}", file=path, row_group=r.row_group) from err
            return decode_row_range(table, path, r, schema, job.options)

        ahead: deque[tuple[RowRange, Future]] = deque()
        ranges = iter(pieces)
        try:
            while True:
                while len(ahead) < self._decode_threads:
                    r = next(ranges, None)
                    if r is None:
                        break
                    ahead.append((r, self._pool.submit(decode, r)))
                if not ahead:
                    return
                r, future = ahead.popleft()
                yield r, future.result()
        finally:
            for _, future in ahead:
                future.cancel()

    def _abort(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.counters.error()
        log.info("Read ends with %s: %s", code.name, message)
        context.abort(code, message)


class ReaderServer:
    """A reader service process's server: the ``Reader`` and ``Health`` services on one port.

    ``stop`` shuts down gracefully: health turns NOT_SERVING at once, open streams get
    ``grace_s`` seconds to finish, then end with UNAVAILABLE.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, threads: int = 4, cache_bytes: int = DEFAULT_CAPACITY_BYTES
    ) -> None:
        self.servicer = ReaderServicer(threads, cache_bytes)
        self.health = health.HealthServicer(
            experimental_non_blocking=True,
            experimental_thread_pool=ThreadPoolExecutor(2, thread_name_prefix="health"),
        )
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self._server = grpc.server(ThreadPoolExecutor(max(16, 4 * threads), thread_name_prefix="rpc"),
                                   options=options)
        self._server.add_generic_rpc_handlers([reader_handler(self.servicer)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{_bracketed(host)}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")

    @property
    def address(self) -> str:
        return f"{_bracketed(self.host)}:{self.port}"

    def start(self) -> None:
        self._server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self.servicer.draining.set()
        deadline = time.monotonic() + grace_s
        while self.servicer.counters.active and time.monotonic() < deadline:
            time.sleep(0.05)
        self.servicer.aborting.set()
        self._server.stop(grace=1.0).wait()
        self.servicer.close()


def reader_handler(servicer: ReaderServicer) -> grpc.GenericRpcHandler:
    """The ``Reader`` service's handler. Registered by hand rather than with the generated
    ``add_ReaderServicer_to_server`` because ``Read`` yields already serialized messages."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Read": grpc.unary_stream_rpc_method_handler(
            servicer.Read, request_deserializer=ingest_pb2.ReadRequest.FromString),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status, request_deserializer=ingest_pb2.StatusRequest.FromString,
            response_serializer=ingest_pb2.StatusReply.SerializeToString),
    })


def serve_until_signal(server: ReaderServer, grace_s: float, on_ready: Callable[[str], None]) -> None:
    """Run ``server`` until SIGTERM or SIGINT, then stop it gracefully (main thread only)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        on_ready(server.address)
        # Python runs signal handlers on the main thread only; a signal the kernel hands to
        # another thread would not wake an untimed wait, so the wait wakes up to look.
        while not stop.wait(SIGNAL_POLL_S):
            pass
        log.info("shutting down (grace %.1f s)", grace_s)
        server.stop(grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
