"""The reader service: a stateless gRPC worker that decodes requested rows into batches.

A ``Read`` request names a dataset directory, the rows to read (windows of row groups,
each read in file order or permuted by a seed, and spans of them) and how to cut them
into batches; the reply streams one ``Batch`` message per
batch, cut exactly as the in-process reader cuts them (:func:`neorec.ingest.reader.batch_pieces`)
and packed into the message straight from the decoded chunks.
The worker keeps nothing between requests, so any worker can serve any request and a
client can re-request unfinished work from another worker.

Bad requests end with INVALID_ARGUMENT or NOT_FOUND, a dataset outside the service's
data roots with PERMISSION_DENIED, a stream beyond ``max_streams`` with
RESOURCE_EXHAUSTED, unreadable or invalid data with DATA_LOSS (the message names file, row
group and column), and the server keeps serving. The process also serves
``grpc.health.v1.Health`` and a ``Status`` RPC with live counters, which keep answering
however many streams are open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import grpc
import pyarrow as pa
import pyarrow.parquet as pq

from neorec.ingest.batch import HostBatch
from neorec.ingest.chunks import ChunkDecoder
from neorec.ingest.decoder import (DENSE_TRANSFORMS, ID_MAPPINGS, DecodeOptions, open_files, open_parquet,
                                   read_row_group)
from neorec.ingest.errors import DataError
from neorec.ingest.fingerprint import fingerprint
from neorec.ingest.plan import ReadTask
from neorec.ingest.reader import batch_pieces
from neorec.ingest.row_group_cache import DEFAULT_CAPACITY_BYTES, RowGroupCache
from neorec.ingest.rows import RowGroupInfo, RowSpan, Window
from neorec.ingest.partitions import MARKER, with_partition_split
from neorec.ingest.schema import Dataset
from neorec.ingest.service_limits import DEFAULT_MAX_STREAMS, MAX_BATCH_SIZE
from neorec.common.confine import confined, resolve_roots
from neorec.common.transport import (MAX_DETAILS_CHARS, RESERVED_THREADS, HostedServer, RequestError, ServerSecurity,
                                     ServiceHost, abort, parsed)
from neorec.ingest.wire import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, MAX_REQUEST_ROWS, MAX_STEP, MAX_WINDOW_ROWS, \
    SERVICE_NAME, serialize_pieces
from neorec.protos import ingest_pb2, ingest_pb2_grpc

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class ReadJob:
    """A validated request: what to read and how."""

    dataset: Dataset
    paths: tuple[str, ...]
    metadata: dict[int, pq.FileMetaData]
    task: ReadTask
    windows: dict[Window, int]
    """The request's windows and their numbers (a batch's provenance names them)."""
    options: DecodeOptions
    compression: int


def validate_request(request: ingest_pb2.ReadRequest, data_roots: Sequence[Path]) -> ReadJob:
    """Check a ``ReadRequest`` against the dataset on this worker's disk, which must lie
    under one of ``data_roots`` (resolved directories).

    Raises :class:`RequestError` (NOT_FOUND for an unknown dataset, split or file;
    PERMISSION_DENIED for a dataset outside the roots; FAILED_PRECONDITION when a file here
    differs from the client's; INVALID_ARGUMENT for anything malformed or too large).
    """
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if not 0 < request.batch_size <= MAX_BATCH_SIZE:
        raise RequestError(invalid, f"batch_size must lie in [1, {MAX_BATCH_SIZE}], got {request.batch_size}")
    if not 0 < request.num_batches * request.batch_size <= MAX_REQUEST_ROWS:
        raise RequestError(invalid, f"a request may ask for 1 to {MAX_REQUEST_ROWS} rows (num_batches x batch_size), "
                                    f"got {request.num_batches} x {request.batch_size}")
    if request.first_step + request.num_batches - 1 > MAX_STEP:
        raise RequestError(invalid, f"first_step {request.first_step} + num_batches {request.num_batches} runs past "
                                    f"the largest step number, {MAX_STEP}")
    if request.compression not in ingest_pb2.Compression.values():
        raise RequestError(invalid, f"unknown compression {request.compression}")
    root = _dataset_root(request.dataset, data_roots)
    try:
        dataset = Dataset.load(root)
    except FileNotFoundError as err:
        raise RequestError(grpc.StatusCode.NOT_FOUND, str(err)) from err
    except (OSError, ValueError, KeyError) as err:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"dataset {request.dataset}: {err}") from err
    dataset = with_partition_split(dataset, request.split)  # a ready partition reads as a split
    if request.split not in dataset.splits:
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"dataset {request.dataset} has no split {request.split!r} "
                                                      f"(a partition is read once its {MARKER} marker exists)")
    _check_files_confined(request.dataset, dataset, data_roots)
    known = set(dataset.splits[request.split])
    for data_file in request.files:
        if data_file.name not in known:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"file {data_file.name!r} is not in split {request.split!r} of {request.dataset}")
    paths = tuple(str(dataset.root / f.name) for f in request.files)
    options = _decode_options(request.decode, dataset)
    windows = _windows(request, paths)
    used = sorted({g.file_index for w in windows for g in w.groups})
    _check_fingerprints(request, paths, used)
    metadata = {i: f.metadata for i, f in zip(used, open_files([paths[i] for i in used], dataset.schema))}
    _check_row_groups(windows, paths, metadata)
    spans = []
    for s in request.spans:
        if s.window >= len(windows) or not s.start < s.stop <= windows[s.window].num_rows:
            raise RequestError(invalid, f"row span [{s.start}, {s.stop}) of window {s.window} is not a run of rows "
                                        f"of the request's {len(windows)} windows")
        spans.append(RowSpan(windows[s.window], s.start, s.stop))
    task = ReadTask(request.epoch, request.first_step, request.num_batches, request.batch_size, tuple(spans))
    if task.num_rows > task.num_batches * task.batch_size:
        raise RequestError(invalid, f"{task.num_rows} rows do not fit in {task.num_batches} batches of {task.batch_size}")
    return ReadJob(dataset, paths, metadata, task, {w: i for i, w in enumerate(windows)}, options,
                   request.compression)


def _dataset_root(name: str, data_roots: Sequence[Path]) -> Path:
    """The dataset directory a request names, resolved, if it lies under a data root."""
    if not name:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "the request names no dataset")
    root = confined(name, data_roots)
    if root is None:
        raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                           f"dataset {name} is outside this service's data roots (neorec ingest serve --data-root)")
    return root


def _check_files_confined(name: str, dataset: Dataset, data_roots: Sequence[Path]) -> None:
    """PERMISSION_DENIED naming the first file of the dataset (any split) that resolves
    (absolute, ``..``, symlinks) outside the data roots."""
    for files in dataset.splits.values():
        for file_name in files:
            if confined(dataset.root / file_name, data_roots) is None:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"file {file_name!r} of dataset {name} resolves to "
                                   f"{(dataset.root / file_name).resolve()}, outside this service's data roots "
                                   f"(neorec ingest serve --data-root)")


def _windows(request: ingest_pb2.ReadRequest, paths: tuple[str, ...]) -> list[Window]:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    windows = []
    for w in request.windows:
        if not w.groups:
            raise RequestError(invalid, "a window of the request holds no row group")
        bad = [g.file for g in w.groups if g.file >= len(paths)]
        if bad:
            raise RequestError(invalid, f"a window names file {bad[0]}, the request lists {len(paths)} files")
        groups = tuple(RowGroupInfo(g.file, g.row_group, g.num_rows) for g in w.groups)
        if len({(g.file_index, g.row_group) for g in groups}) < len(groups):
            raise RequestError(invalid, "a window of the request names a row group twice")
        window = Window(groups, seed=w.seed if w.permuted else None)
        if window.num_rows > MAX_WINDOW_ROWS:
            raise RequestError(invalid, f"a window of the request holds {window.num_rows} rows, more than "
                                        f"{MAX_WINDOW_ROWS} (fewer row groups a window: data.shuffle_window)")
        windows.append(window)
    return windows


def _check_fingerprints(request: ingest_pb2.ReadRequest, paths: tuple[str, ...], used: list[int]) -> None:
    """Every file the request reads must be, here, the file the client planned with."""
    for index in used:
        path, expected = paths[index], request.files[index]
        try:
            here = fingerprint(path)
        except FileNotFoundError:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"file {path} does not exist on this worker") from None
        except (OSError, ValueError) as err:
            raise RequestError(grpc.StatusCode.DATA_LOSS, f"file {path}: {err}") from None
        if (here.size, here.footer_crc32) != (expected.size, expected.footer_crc32):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"file {path} on this worker is not the client's: {here.size} bytes, footer CRC-32 "
                               f"{here.footer_crc32:08x}; the client planned with {expected.size} bytes, "
                               f"{expected.footer_crc32:08x}")


def _check_row_groups(windows: list[Window], paths: tuple[str, ...], metadata: dict[int, pq.FileMetaData]) -> None:
    """Every row group a window names must exist and hold the rows the client counted."""
    for window in windows:
        for g in window.groups:
            meta = metadata[g.file_index]
            if g.row_group >= meta.num_row_groups:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"file {paths[g.file_index]} has {meta.num_row_groups} row groups, the request "
                                   f"reads row group {g.row_group}")
            rows = meta.row_group(g.row_group).num_rows
            if rows != g.num_rows:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"row group {g.row_group} of file {paths[g.file_index]} holds {rows} rows, "
                                   f"the request counts {g.num_rows}")


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
    names = [f.name for f in dataset.schema.sparse]
    unknown = sorted(set(spec.raw_features) - set(names))
    if unknown or len(set(spec.raw_features)) != len(spec.raw_features):
        raise RequestError(invalid, f"decode.raw_features {list(spec.raw_features)} must name sparse features of the "
                                    f"dataset once each{f' (not {unknown})' if unknown else ''}")
    return DecodeOptions(tuple(spec.table_rows), spec.dense_transform, spec.id_mapping, tuple(spec.raw_features))


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

    def stream_opened(self, limit: int) -> bool:
        """Count a new stream unless ``limit`` streams are open; whether it was counted."""
        with self._lock:
            if self.active >= limit:
                return False
            self.requests += 1
            self.active += 1
            return True

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
    reading row groups through a :class:`RowGroupCache` of ``cache_bytes``, at most
    ``max_streams`` streams at once, datasets under ``data_roots`` only."""

    def __init__(self, decode_threads: int, cache_bytes: int = DEFAULT_CAPACITY_BYTES,
                 max_streams: int = DEFAULT_MAX_STREAMS, data_roots: Sequence[str | Path] = (".",)) -> None:
        if decode_threads <= 0 or max_streams <= 0:
            raise ValueError("decode_threads and max_streams must be positive")
        if not data_roots:
            raise ValueError("a reader service needs at least one data root")
        self.max_streams = max_streams
        self.data_roots = resolve_roots(data_roots)
        self.counters = ServiceCounters()
        self.row_groups = RowGroupCache(cache_bytes)
        self.draining = threading.Event()
        """Set: new calls are refused with UNAVAILABLE."""
        self.aborting = threading.Event()
        """Set: open streams end with UNAVAILABLE before their next batch."""
        self._decode_threads = decode_threads
        self._pool = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode")

    def Read(self, request: ingest_pb2.ReadRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Streams serialized ``Batch`` messages (see :func:`neorec.ingest.wire.serialize_batch`)."""
        if self.draining.is_set():
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "the reader service is shutting down")
        try:
            job = validate_request(request, self.data_roots)
        except RequestError as err:
            self._abort(context, err.code, str(err))
        except DataError as err:
            self._abort(context, grpc.StatusCode.DATA_LOSS, str(err))
        if not self.counters.stream_opened(self.max_streams):
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self.max_streams} streams are open, the most this reader service serves at once")
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
        id_bounds = job.options.id_bounds(job.dataset.schema)
        try:
            for batch in batch_pieces(job.task, self._decoded(job), job.dataset.schema):
                if self.aborting.is_set():
                    self._abort(context, grpc.StatusCode.UNAVAILABLE, "the reader service is shutting down")
                message = serialize_pieces(batch, id_bounds, job.windows, job.compression)
                if len(message) > MAX_MESSAGE_BYTES:
                    self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"batch step {batch.step} is {len(message)} bytes, "
                                f"above the {MAX_MESSAGE_BYTES}-byte message limit: use smaller batches")
                self.counters.served(batch.num_valid, len(message))
                yield message
        except DataError as err:
            self._abort(context, grpc.StatusCode.DATA_LOSS, str(err))

    def _decoded(self, job: ReadJob) -> Iterator[tuple[RowSpan, HostBatch]]:
        """The job's rows decoded in order, a span per decode thread, up to
        ``decode_threads`` spans ahead.

        A task of fewer spans than decode threads is cut into that many pieces at batch
        boundaries (so no batch's provenance changes), which its threads decode at once;
        unless a span is of a permuted window: whole, its chunks take a share of the window
        large enough to be decoded in one routed pass (:class:`~neorec.ingest.take.PickedTogether`),
        which costs less than each piece's own pass, and its columns are spread over the
        decode threads (those the client's other streams leave free), its next chunks
        decoding while these are sent.
        """
        schema = job.dataset.schema
        task = job.task
        pieces = task.spans
        if 0 < len(pieces) < self._decode_threads and not any(s.window.permuted for s in pieces):
            per_piece = -(-task.num_batches // self._decode_threads)
            pieces = tuple(s for part in task.split(per_piece) for s in part.spans)

        def load(group: RowGroupInfo) -> pa.Table:
            path = job.paths[group.file_index]

            def read() -> pa.Table:
                # A file object per read: reads run concurrently, footers are parsed once.
                parquet_file = open_parquet(path, job.metadata[group.file_index])
                return read_row_group(parquet_file, path, group.row_group, schema)

            try:
                return self.row_groups.read(path, group.row_group, tuple(schema.columns), task.epoch, read)
            except OSError as err:  # the file went away or became unreadable since the request
                raise DataError(f"cannot read row group: {err}", file=path, row_group=group.row_group) from err

        decoder = ChunkDecoder(load, job.paths, schema, job.options, self._pool, self._decode_threads)

        def decode(span: RowSpan) -> list[tuple[RowSpan, HostBatch]]:
            chunks = list(decoder.chunks(span))
            groups = [(job.paths[g.file_index], g.row_group) for g in span.window.groups]
            self.row_groups.rows_decoded(groups, tuple(schema.columns), task.epoch, span.start, span.stop,
                                         span.window.num_rows)
            return chunks

        ahead: deque[Future] = deque()
        spans = iter(pieces)
        try:
            while True:
                while len(ahead) < self._decode_threads:
                    span = next(spans, None)
                    if span is None:
                        break
                    ahead.append(self._pool.submit(decode, span))
                if not ahead:
                    return
                yield from ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()

    def _abort(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.counters.error()
        log.info("Read ends with %s: %s", code.name, message[:MAX_DETAILS_CHARS])
        abort(context, code, message)


class ReaderServer(HostedServer):
    """A reader service process's server: the ``Reader`` and ``Health`` services on one port.

    ``stop`` shuts down gracefully: health turns NOT_SERVING at once, open streams get
    ``grace_s`` seconds to finish, then end with UNAVAILABLE.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, threads: int = 4, cache_bytes: int = DEFAULT_CAPACITY_BYTES,
        max_streams: int = DEFAULT_MAX_STREAMS, data_roots: Sequence[str | Path] = (".",),
        security: ServerSecurity = ServerSecurity(),
    ) -> None:
        self.servicer = ReaderServicer(threads, cache_bytes, max_streams, data_roots)
        self.host = ServiceHost(host, port, security, max_streams + RESERVED_THREADS, [reader_handler(self.servicer)],
                                [SERVICE_NAME], MAX_REQUEST_BYTES, MAX_MESSAGE_BYTES)

    def stop(self, grace_s: float = 5.0) -> None:
        self.host.draining()
        self.servicer.draining.set()
        deadline = time.monotonic() + grace_s
        while self.servicer.counters.active and time.monotonic() < deadline:
            time.sleep(0.05)
        self.servicer.aborting.set()
        self.host.stop(1.0)
        self.servicer.close()


def reader_handler(servicer: ReaderServicer) -> grpc.GenericRpcHandler:
    """The ``Reader`` service's handler. Registered by hand rather than with the generated
    ``add_ReaderServicer_to_server`` because ``Read`` yields already serialized messages."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Read": grpc.unary_stream_rpc_method_handler(parsed(servicer.Read, ingest_pb2.ReadRequest)),
        "Status": grpc.unary_unary_rpc_method_handler(
            parsed(servicer.Status, ingest_pb2.StatusRequest),
            response_serializer=ingest_pb2.StatusReply.SerializeToString),
    })
