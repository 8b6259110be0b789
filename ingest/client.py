"""The trainer-side client of the reader services: fan-in, a bounded number of batches in
flight, reorder, failover.

The client plans the epoch itself (exactly as :class:`~neorec.ingest.reader.InProcessReader`
does), cuts the rank's batches into tasks of consecutive batches, and hands the tasks
to fetcher threads, ``streams_per_worker`` per live worker. Each fetched batch is checked
against the plan (epoch, step, the exact rows it must hold) and for well-formedness (bag
lengths, every id inside its table), then parked until its turn, so the batch sequence is
that of the in-process reader whatever the number, speed or failures of the workers.

A worker fails when its stream breaks, when a stream owes batches but delivers none for
``progress_timeout_s`` (a hung or stopped process), or when it sends a malformed batch.
The batches its stream did not deliver are requeued, from the first one missing, for any
worker; the failed one is retried after a backoff, and is given no task while its health
probe (``grpc.health.v1``, every ``probe_interval_s``) has missed ``probe_misses`` times in
a row. Every planned row arrives exactly once.

Errors that another worker would repeat (a bad request, corrupt data, a task whose batches
came malformed ``max_task_attempts`` times) end the epoch with an :class:`IngestError`
carrying the cause; so does a stall, when no worker delivers anything for
``stall_timeout_s``. Any other exception in a fetcher thread ends the epoch at once, with
the exception as the cause.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from neorec.common.errors import UserError
from neorec.ingest.batch import HostBatch
from neorec.ingest.chunks import CHUNK_ROWS, LOCKSTEP_CHUNKS
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.fingerprint import fingerprint
from neorec.ingest.plan import RankPlan, ReadTask
from neorec.ingest.reader import ReaderConfig, SplitPlanner
from neorec.ingest.rows import Window
from neorec.ingest.schema import Dataset
from neorec.common.health import HealthProbe
from neorec.common.transport import ClientSecurity
from neorec.ingest.wire import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, MAX_REQUEST_ROWS, READ_METHOD, SERVICE_NAME, \
    WireError, decode_batch
from neorec.protos import ingest_pb2

log = logging.getLogger(__name__)

COMPRESSIONS = {"none": ingest_pb2.COMPRESSION_NONE, "zstd": ingest_pb2.COMPRESSION_ZSTD}

RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})
"""Status codes that mean "this worker, now", not "this request": retried elsewhere."""
_TICK_S = 0.1
"""How often the watchdog looks at the open streams."""


class IngestError(UserError, RuntimeError):
    """The reader services cannot deliver the planned batches."""


TASK_ROWS = 131_072
"""Rows of a task that reads row groups whole: two of the usual 64k-row groups, so that a
worker decodes a task's second group while it sends the first one's batches (with one
group per task, both of a worker's streams decode at once, then both send)."""
ROW_SHUFFLE_TASK_ROWS = LOCKSTEP_CHUNKS * CHUNK_ROWS
"""Rows of a task that reads shuffled rows: the chunks a worker decodes together in one
pass over their window's row groups (:mod:`neorec.ingest.chunks`). A smaller task takes a
smaller share of its window, and the window's columns are read once per task instead
(BENCHMARKS.md, ``neorec bench ingest``, row-level shuffling)."""


@dataclass(frozen=True)
class ClientOptions:
    """How the client uses the services.

    Attributes:
        task_rows: rows per task (a task is a whole number of batches, at least one); None
            picks them by the plan's shuffle: :data:`TASK_ROWS` when row groups are read
            whole, :data:`ROW_SHUFFLE_TASK_ROWS` when rows are shuffled.
        streams_per_worker: concurrent streams to each worker.
        compression: ``none`` or ``zstd`` (the batch bodies).
        call_timeout_s: deadline of one task's stream.
        stall_timeout_s: give up when no batch arrives for this long.
        progress_timeout_s: a stream that owes batches and delivers none for this long is
            cancelled and its worker treated as failed.
        probe_interval_s / probe_misses: health probes of every worker; a worker that missed
            ``probe_misses`` in a row gets no task until one answers SERVING.
        max_task_attempts: malformed or unexpected answers to the same batches tolerated
            before the epoch fails (broken connections and hangs do not count).
        backoff_s / max_backoff_s: first and longest wait before retrying a failed worker.
        security: TLS and token for the channels.
    """

    task_rows: int | None = None
    streams_per_worker: int = 2
    compression: str = "none"
    call_timeout_s: float = 120.0
    stall_timeout_s: float = 120.0
    progress_timeout_s: float = 5.0
    probe_interval_s: float = 1.0
    probe_misses: int = 3
    max_task_attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    security: ClientSecurity = field(default_factory=ClientSecurity)

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")
        task_rows_bad = self.task_rows is not None and not 0 < self.task_rows <= MAX_REQUEST_ROWS
        if task_rows_bad or self.streams_per_worker <= 0:
            raise ValueError(f"task_rows must lie in [1, {MAX_REQUEST_ROWS}] and streams_per_worker be positive")
        for name in ("call_timeout_s", "stall_timeout_s", "progress_timeout_s", "probe_interval_s", "backoff_s",
                     "max_backoff_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.probe_misses <= 0 or self.max_task_attempts <= 0:
            raise ValueError("probe_misses and max_task_attempts must be positive")


class RemoteReader:
    """Reads one split for one rank through reader services; same interface and same
    batches as :class:`~neorec.ingest.reader.InProcessReader`.

    The dataset directory must be readable here (for the plan: Parquet footers only) and
    at the same path on every worker.
    """

    def __init__(
        self,
        dataset: Dataset,
        split: str,
        options: DecodeOptions,
        config: ReaderConfig,
        addresses: Sequence[str],
        client: ClientOptions = ClientOptions(),
    ) -> None:
        if not addresses:
            raise ValueError("RemoteReader needs at least one reader service address")
        self.dataset = dataset
        self.client = client
        self.id_bounds = options.id_bounds(dataset.schema)
        """What the batches received are checked against (0: a raw feature's ids, any int64)."""
        self.planner = SplitPlanner(dataset, split, config)
        self.requeued_batches = 0
        """Batches re-requested from another worker after a failure (all epochs)."""
        self.workers = [_Worker(a, client) for a in addresses]
        self._fetches: set[_EpochFetch] = set()
        """Epochs being read (their fetcher threads run until the epoch ends or closes)."""
        self._lock = threading.Lock()
        files = []
        for name, path in zip(dataset.splits[split], self.planner.paths):
            mark = fingerprint(path)
            files.append(ingest_pb2.DataFile(name=name, size=mark.size, footer_crc32=mark.footer_crc32))
        self._request = ingest_pb2.ReadRequest(
            dataset=str(dataset.root.resolve()),
            split=split,
            files=files,
            decode=ingest_pb2.DecodeSpec(
                table_rows=options.table_rows,
                dense_transform=options.dense_transform,
                id_mapping=options.id_mapping,
                raw_features=options.raw_features,
            ),
            batch_size=config.batch_size,
            compression=COMPRESSIONS[client.compression],
        )
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="ingest-watchdog")
        self._watchdog.start()

    def plan(self, epoch: int) -> RankPlan:
        return self.planner.plan(epoch)

    @property
    def task_rows(self) -> int:
        """Rows per task (see :attr:`ClientOptions.task_rows`)."""
        if self.client.task_rows is not None:
            return self.client.task_rows
        return ROW_SHUFFLE_TASK_ROWS if self.planner.config.shuffle == "rows" else TASK_ROWS

    def epoch(self, epoch: int, first_step: int = 0) -> Iterator[HostBatch]:
        plan = self.plan(epoch)
        batches_per_task = max(1, self.task_rows // plan.batch_size)
        with self._lock:
            fetch = _EpochFetch(self, plan.tasks(batches_per_task, first_step), first_step, plan.num_batches)
            self._fetches.add(fetch)
        try:
            yield from fetch.batches()
        finally:
            fetch.close()
            with self._lock:
                self._fetches.discard(fetch)

    def close(self) -> None:
        """Stop the epochs still being read (their iterators then raise
        :class:`IngestError`), then the watchdog, then close the channels."""
        with self._lock:
            fetches = list(self._fetches)
        for fetch in fetches:
            fetch.close()
        self._stopping.set()
        self._watchdog.join()
        self.planner.close()
        for worker in self.workers:
            worker.health.cancel()
            worker.channel.close()

    def __enter__(self) -> "RemoteReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_for(self, task: ReadTask) -> tuple[ingest_pb2.ReadRequest, list[Window]]:
        """The request for ``task`` and the windows it numbers (those its spans read, in
        order of first use)."""
        request = ingest_pb2.ReadRequest()
        request.CopyFrom(self._request)
        request.epoch = task.epoch
        request.first_step = task.first_step
        request.num_batches = task.num_batches
        windows: dict[Window, int] = {}
        for s in task.spans:
            if s.window not in windows:
                windows[s.window] = len(windows)
                request.windows.append(ingest_pb2.Window(
                    groups=[ingest_pb2.RowGroup(file=g.file_index, row_group=g.row_group, num_rows=g.num_rows)
                            for g in s.window.groups],
                    permuted=s.window.permuted, seed=s.window.seed or 0))
            request.spans.append(ingest_pb2.RowSpan(window=windows[s.window], start=s.start, stop=s.stop))
        return request, list(windows)

    def _watch(self) -> None:
        """Probe every worker's health and cancel streams that stopped delivering, until
        :meth:`close`."""
        while not self._stopping.wait(_TICK_S):
            now = time.monotonic()
            for worker in self.workers:
                worker.health.tick(now)
            with self._lock:
                fetches = list(self._fetches)
            for fetch in fetches:
                fetch.cancel_stalled(now - self.client.progress_timeout_s)


class _Worker:
    """One reader service: its channel, its failure/backoff state and its health."""

    def __init__(self, address: str, client: ClientOptions) -> None:
        self.address = address
        self.channel = client.security.channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
        ])
        # raw responses: decode_batch reads the tensors straight out of the received bytes
        self.read = self.channel.unary_stream(READ_METHOD, request_serializer=ingest_pb2.ReadRequest.SerializeToString)
        self.health = HealthProbe(self.channel, SERVICE_NAME, client.probe_interval_s)
        self.lock = threading.Lock()
        self.failures = 0
        self.retry_at = 0.0
        self.last_error = ""

    def failed(self, error: str, client: ClientOptions) -> None:
        with self.lock:
            self.failures += 1
            self.last_error = error
            delay = min(client.backoff_s * 2 ** (self.failures - 1), client.max_backoff_s)
            self.retry_at = max(self.retry_at, time.monotonic() + delay)

    def succeeded(self) -> None:
        with self.lock:
            self.failures = 0

    def usable(self, client: ClientOptions) -> float:
        """Seconds until this worker may be given a task (0: now; inf: not while its
        health probes fail)."""
        with self.lock:
            if self.health.misses >= client.probe_misses:
                return float("inf")
            return max(0.0, self.retry_at - time.monotonic())


@dataclass(eq=False)
class _Stream:
    """A task's call in flight, and when it last delivered."""

    call: grpc.Call
    worker: _Worker
    last_progress: float
    stalled: bool = False


class _EpochFetch:
    """One epoch's tasks in flight: the task queue, parked batches and fetcher threads."""

    def __init__(self, reader: RemoteReader, tasks: list[ReadTask], first_step: int, num_batches: int) -> None:
        self.reader = reader
        self.first_step = first_step
        self.num_batches = num_batches
        self.keys = reader.dataset.schema.feature_names
        self.window = max(2, len(reader.workers) * reader.client.streams_per_worker) * max(
            (t.num_batches for t in tasks), default=1)
        self.cond = threading.Condition()
        self.queue: list[tuple[int, ReadTask]] = [(t.first_step, t) for t in tasks]
        heapq.heapify(self.queue)
        self.parked: dict[int, HostBatch] = {}
        self.next_step = first_step
        self.failure: IngestError | None = None
        self.closed = False
        self.streams: set[_Stream] = set()
        self.attempts: dict[int, int] = {}
        """Counted faults (malformed or unexpected answers) per first undelivered step."""
        self.last_progress = time.monotonic()
        self.threads = [
            threading.Thread(target=self._fetch_loop, args=(worker,), daemon=True,
                             name=f"fetch-{worker.address}-{i}")
            for worker in reader.workers
            for i in range(reader.client.streams_per_worker)
        ]
        for thread in self.threads:
            thread.start()

    def batches(self) -> Iterator[HostBatch]:
        stall = self.reader.client.stall_timeout_s
        for step in range(self.first_step, self.num_batches):
            with self.cond:
                while step not in self.parked and self.failure is None and not self.closed:
                    waited = time.monotonic() - self.last_progress
                    if waited >= stall:
                        raise IngestError(f"no reader service delivered a batch for {waited:.0f} s "
                                          f"(waiting for step {step}); {self._worker_report()}")
                    self.cond.wait(timeout=min(1.0, stall - waited))
                if self.failure is not None:  # at once, even with later batches parked
                    raise self.failure
                if self.closed:
                    raise IngestError("the reader was closed while this epoch was being read")
                batch = self.parked.pop(step)
                self.next_step = step + 1
                self.cond.notify_all()
            yield batch

    def close(self) -> None:
        with self.cond:
            self.closed = True
            streams = list(self.streams)
            self.cond.notify_all()
        for stream in streams:
            stream.call.cancel()
        for thread in self.threads:
            thread.join()

    def cancel_stalled(self, horizon: float) -> None:
        """Cancel the streams that have delivered nothing since ``horizon``."""
        with self.cond:
            stalled = [s for s in self.streams if s.last_progress < horizon and not s.stalled]
            for stream in stalled:
                stream.stalled = True
        for stream in stalled:
            stream.call.cancel()

    def _fetch_loop(self, worker: _Worker) -> None:
        try:
            while True:
                task = self._take(worker)
                if task is None:
                    return
                delivered = [0]
                try:
                    self._fetch(worker, task, delivered)
                    worker.succeeded()
                except _WorkerFault as fault:
                    if self._closed():
                        return
                    rest = task.after(delivered[0])
                    if fault.counted:
                        self._count_attempt(rest, worker, fault)
                    self._requeue(rest)
                    log.warning("reader service %s failed (%s); batches %d.. requeued",
                                worker.address, fault, rest.first_step)
                    worker.failed(str(fault), self.reader.client)
        except IngestError as err:
            self._fail(err)
        except Exception as err:  # a bug or an unforeseen failure: end the epoch now, with its cause
            failure = IngestError(f"reading from reader service {worker.address} failed: "
                                  f"{type(err).__name__}: {err}")
            failure.__cause__ = err
            self._fail(failure)

    def _fetch(self, worker: _Worker, task: ReadTask, delivered: list[int]) -> None:
        """Stream ``task`` from ``worker``, parking each checked batch and counting them in
        ``delivered[0]``. Raises :class:`_WorkerFault` (retry elsewhere) or
        :class:`IngestError`."""
        request, windows = self.reader.request_for(task)
        call = worker.read(request, timeout=self.reader.client.call_timeout_s)
        stream = _Stream(call, worker, time.monotonic())
        with self.cond:
            if self.closed:
                call.cancel()
            self.streams.add(stream)
        try:
            for message in call:
                if delivered[0] >= task.num_batches:
                    raise _WorkerFault(f"sent a batch past the task's {task.num_batches}", counted=True)
                batch = self._checked(worker, task, windows, delivered[0], message)
                with self.cond:
                    self.parked[batch.provenance.step] = batch
                    stream.last_progress = self.last_progress = time.monotonic()
                    self.cond.notify_all()
                delivered[0] += 1
        except grpc.RpcError as err:
            code = err.code()
            if stream.stalled:
                raise _WorkerFault(f"delivered no batch for {self.reader.client.progress_timeout_s:g} s") from err
            if code in RETRYABLE:
                raise _WorkerFault(f"{code.name}: {err.details()}", counted=code == grpc.StatusCode.INTERNAL) from err
            raise IngestError(f"reader service {worker.address} refused batches {task.first_step}.."
                              f"{task.first_step + task.num_batches - 1}: {code.name}: {err.details()}") from err
        finally:
            call.cancel()  # a no-op once the stream has ended; else the worker stops streaming it now
            with self.cond:
                self.streams.discard(stream)
        if delivered[0] < task.num_batches:
            raise _WorkerFault(f"stream ended after {delivered[0]} of {task.num_batches} batches")

    def _checked(self, worker: _Worker, task: ReadTask, windows: list[Window], index: int,
                 message: bytes) -> HostBatch:
        """Decode a message and check it is the task's ``index``-th batch, row for row, and
        well formed; a malformed one is the worker's fault (:class:`_WorkerFault`)."""
        try:
            batch = decode_batch(message, self.keys, windows)
            batch.check(self.reader.id_bounds)
        except (WireError, ValueError) as err:
            raise _WorkerFault(f"sent a malformed batch (step {task.first_step + index}): {err}", counted=True) from err
        expected_rows = task.batch_rows(index)
        got = batch.provenance
        if (got.epoch, got.step, got.rows) != (task.epoch, task.first_step + index, expected_rows) or (
            batch.batch_size != task.batch_size or batch.num_valid != sum(r.num_rows for r in expected_rows)
        ):
            raise _WorkerFault(
                f"sent epoch {got.epoch} step {got.step} ({batch.num_valid}/{batch.batch_size} samples) where the "
                f"plan has epoch {task.epoch} step {task.first_step + index} "
                f"({sum(r.num_rows for r in expected_rows)}/{task.batch_size}) or other rows", counted=True)
        return batch

    def _count_attempt(self, rest: ReadTask, worker: _Worker, fault: "_WorkerFault") -> None:
        with self.cond:
            attempts = self.attempts[rest.first_step] = self.attempts.get(rest.first_step, 0) + 1
        if attempts >= self.reader.client.max_task_attempts:
            raise IngestError(f"batches {rest.first_step}..{rest.first_step + rest.num_batches - 1} failed "
                              f"{attempts} times; last, reader service {worker.address} {fault}")

    def _take(self, worker: _Worker) -> ReadTask | None:
        """The next task starting fewer than ``window`` batches past the next one due, once
        ``worker`` may be given one; None when the epoch is over or closed."""
        client = self.reader.client
        with self.cond:
            while True:
                if self.closed or self.failure is not None or self.next_step >= self.num_batches:
                    return None
                wait = worker.usable(client)
                if wait <= 0 and self.queue and self.queue[0][0] < self.next_step + self.window:
                    return heapq.heappop(self.queue)[1]
                self.cond.wait(timeout=min(wait, client.probe_interval_s) if wait > 0 else 1.0)

    def _requeue(self, task: ReadTask) -> None:
        if task.num_batches <= 0:
            return
        with self.cond:
            self.reader.requeued_batches += task.num_batches
            heapq.heappush(self.queue, (task.first_step, task))
            self.cond.notify_all()

    def _fail(self, error: IngestError) -> None:
        with self.cond:
            if self.failure is None and not self.closed:
                self.failure = error
            self.cond.notify_all()

    def _closed(self) -> bool:
        with self.cond:
            return self.closed

    def _worker_report(self) -> str:
        return "; ".join(
            f"{w.address}: {w.last_error or 'no error'} ({w.failures} failures in a row"
            + (f"; health check: {w.health.last_error})" if w.health.last_error else ")")
            for w in self.reader.workers
        )


class _WorkerFault(Exception):
    """The worker, not the request, failed: the task's rest goes to another worker.
    ``counted``: a malformed or unexpected answer (not a broken connection or a hang), which
    counts towards the task's ``max_task_attempts``."""

    def __init__(self, message: str, counted: bool = False) -> None:
        super().__init__(message)
        self.counted = counted
