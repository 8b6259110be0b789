"""The trainer-side client of the reader services: fan-in, prefetch, reorder, failover.

The client plans the epoch itself (exactly as :class:`~ingest.reader.InProcessReader`
does), cuts the rank's batches into tasks of consecutive batches, and hands the tasks
to fetcher threads, ``streams_per_worker`` per live worker. Each fetched batch is checked
against the plan (epoch, step and the exact rows it must hold) and parked until its turn,
so the batch sequence is that of the in-process reader whatever the number, speed or
failures of the workers. When a worker fails mid-stream, the batches it did not deliver
are requeued for any worker (the failed one is retried after a backoff): every planned
row arrives exactly once.

Errors that another worker would repeat (a bad request, corrupt data) end the epoch with
an :class:`IngestError` carrying the service's message; so does a stall, when no worker
delivers anything for ``stall_timeout_s``.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc

from ingest.batch import HostBatch
from ingest.decoder import DecodeOptions
from ingest.plan import RankPlan, ReadTask
from ingest.reader import ReaderConfig, SplitPlanner
from ingest.schema import Dataset
from ingest.wire import MAX_MESSAGE_BYTES, READ_METHOD, WireError, decode_batch
from protos import ingest_pb2

log = logging.getLogger(__name__)

COMPRESSIONS = {"none": ingest_pb2.COMPRESSION_NONE, "zstd": ingest_pb2.COMPRESSION_ZSTD}

RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
})
"""Status codes that mean "this worker, now", not "this request": retried elsewhere."""


class IngestError(RuntimeError):
    """The reader services cannot deliver the planned batches."""


@dataclass(frozen=True)
class ClientOptions:
    """How the client uses the services.

    Attributes:
        task_rows: rows per task (a task is a whole number of batches, at least one). Two of
            the usual 64k-row groups: a worker decodes a task's second group while it sends
            the first one's batches (with one group per task, both of a worker's streams
            decode at once, then both send).
        streams_per_worker: concurrent streams to each worker.
        compression: ``none`` or ``zstd`` (the batch bodies).
        call_timeout_s: deadline of one task's stream.
        stall_timeout_s: give up when no batch arrives for this long.
        backoff_s / max_backoff_s: first and longest wait before retrying a failed worker.
    """

    task_rows: int = 131_072
    streams_per_worker: int = 2
    compression: str = "none"
    call_timeout_s: float = 120.0
    stall_timeout_s: float = 120.0
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")
        if self.task_rows <= 0 or self.streams_per_worker <= 0:
            raise ValueError("task_rows and streams_per_worker must be positive")


def check_address(address: str) -> str:
    """``address`` if it reads ``host:port``; else ValueError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"reader service address {address!r} is not host:port")
    return address


class RemoteReader:
    """Reads one split for one rank through reader services; same interface and same
    batches as :class:`~ingest.reader.InProcessReader`.

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
        self.planner = SplitPlanner(dataset, split, config)
        self.requeued_batches = 0
        """Batches re-requested from another worker after a failure (all epochs)."""
        self.workers = [_Worker(a) for a in addresses]
        self._fetches: set[_EpochFetch] = set()
        """Epochs being read (their fetcher threads run until the epoch ends or closes)."""
        self._lock = threading.Lock()
        self._request = ingest_pb2.ReadRequest(
            dataset=str(dataset.root.resolve()),
            split=split,
            files=dataset.splits[split],
            decode=ingest_pb2.DecodeSpec(
                table_rows=options.table_rows,
                dense_transform=options.dense_transform,
                id_mapping=options.id_mapping,
            ),
            batch_size=config.batch_size,
            compression=COMPRESSIONS[client.compression],
        )

    def plan(self, epoch: int) -> RankPlan:
        return self.planner.plan(epoch)

    def epoch(self, epoch: int) -> Iterator[HostBatch]:
        plan = self.plan(epoch)
        batches_per_task = max(1, self.client.task_rows // plan.batch_size)
        with self._lock:
            fetch = _EpochFetch(self, plan.tasks(batches_per_task), plan.num_batches)
            self._fetches.add(fetch)
        try:
            yield from fetch.batches()
        finally:
            fetch.close()
            with self._lock:
                self._fetches.discard(fetch)

    def close(self) -> None:
        """Stop the epochs still being read (their iterators then raise
        :class:`IngestError`), then close the channels."""
        with self._lock:
            fetches = list(self._fetches)
        for fetch in fetches:
            fetch.close()
        self.planner.close()
        for worker in self.workers:
            worker.channel.close()

    def __enter__(self) -> "RemoteReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_for(self, task: ReadTask) -> ingest_pb2.ReadRequest:
        request = ingest_pb2.ReadRequest()
        request.CopyFrom(self._request)
        request.epoch = task.epoch
        request.first_step = task.first_step
        request.num_batches = task.num_batches
        request.ranges.extend(
            ingest_pb2.RowRange(file=r.file_index, row_group=r.row_group, start=r.start, stop=r.stop)
            for r in task.ranges
        )
        return request


class _Worker:
    """One reader service: its channel and its failure/backoff state."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])
        # raw responses: decode_batch reads the tensors straight out of the received bytes
        self.read = self.channel.unary_stream(READ_METHOD, request_serializer=ingest_pb2.ReadRequest.SerializeToString)
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


class _EpochFetch:
    """One epoch's tasks in flight: the task queue, parked batches and fetcher threads."""

    def __init__(self, reader: RemoteReader, tasks: list[ReadTask], num_batches: int) -> None:
        self.reader = reader
        self.num_batches = num_batches
        self.keys = reader.dataset.schema.feature_names
        self.window = max(2, len(reader.workers) * reader.client.streams_per_worker) * max(
            (t.num_batches for t in tasks), default=1)
        self.cond = threading.Condition()
        self.queue: list[tuple[int, ReadTask]] = [(t.first_step, t) for t in tasks]
        heapq.heapify(self.queue)
        self.parked: dict[int, HostBatch] = {}
        self.next_step = 0
        self.failure: IngestError | None = None
        self.closed = False
        self.calls: set[grpc.Call] = set()
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
        for step in range(self.num_batches):
            with self.cond:
                while step not in self.parked and self.failure is None and not self.closed:
                    waited = time.monotonic() - self.last_progress
                    if waited >= stall:
                        raise IngestError(f"no reader service delivered a batch for {waited:.0f} s "
                                          f"(waiting for step {step}); {self._worker_report()}")
                    self.cond.wait(timeout=min(1.0, stall - waited))
                if self.failure is not None:
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
            calls = list(self.calls)
            self.cond.notify_all()
        for call in calls:
            call.cancel()
        for thread in self.threads:
            thread.join()

    def _fetch_loop(self, worker: _Worker) -> None:
        while True:
            task = self._take(worker)
            if task is None:
                return
            delivered = 0
            try:
                delivered = self._fetch(worker, task)
                if delivered < task.num_batches:
                    raise _WorkerFault(f"stream ended after {delivered} of {task.num_batches} batches")
                worker.succeeded()
            except _WorkerFault as fault:
                if self._closed():
                    return
                self._requeue(task.after(delivered))
                log.warning("reader service %s failed (%s); batches %d.. requeued",
                            worker.address, fault, task.first_step + delivered)
                worker.failed(str(fault), self.reader.client)
            except IngestError as err:
                self._fail(err)
                return

    def _fetch(self, worker: _Worker, task: ReadTask) -> int:
        """Stream ``task`` from ``worker``, parking each checked batch; returns how many
        arrived. Raises :class:`_WorkerFault` (retry elsewhere) or :class:`IngestError`."""
        request = self.reader.request_for(task)
        call = worker.read(request, timeout=self.reader.client.call_timeout_s)
        with self.cond:
            if self.closed:
                call.cancel()
            self.calls.add(call)
        delivered = 0
        try:
            for message in call:
                batch = self._checked(worker, task, delivered, message)
                with self.cond:
                    self.parked[batch.provenance.step] = batch
                    self.last_progress = time.monotonic()
                    self.cond.notify_all()
                delivered += 1
        except grpc.RpcError as err:
            code = err.code()
            if code in RETRYABLE:
                raise _WorkerFault(f"{code.name}: {err.details()}") from err
            raise IngestError(f"reader service {worker.address} refused batches {task.first_step}.."
                              f"{task.first_step + task.num_batches - 1}: {code.name}: {err.details()}") from err
        finally:
            with self.cond:
                self.calls.discard(call)
        return delivered

    def _checked(self, worker: _Worker, task: ReadTask, index: int, message: bytes) -> HostBatch:
        """Decode a message and check it is the task's ``index``-th batch, row for row."""
        try:
            batch = decode_batch(message, self.keys)
        except WireError as err:
            raise IngestError(f"reader service {worker.address} sent a malformed batch: {err}") from err
        expected_rows = task.batch_rows(index)
        got = batch.provenance
        if (got.epoch, got.step, got.rows) != (task.epoch, task.first_step + index, expected_rows) or (
            batch.batch_size != task.batch_size or batch.num_valid != sum(r.num_rows for r in expected_rows)
        ):
            raise IngestError(
                f"reader service {worker.address} sent epoch {got.epoch} step {got.step} with rows {got.rows} "
                f"({batch.num_valid}/{batch.batch_size} samples) where the plan has epoch {task.epoch} "
                f"step {task.first_step + index} with rows {expected_rows}"
            )
        return batch

    def _take(self, worker: _Worker) -> ReadTask | None:
        """The next task within the prefetch window, once ``worker`` may be retried;
        None when the epoch is over or closed."""
        with self.cond:
            while True:
                if self.closed or self.failure is not None or self.next_step >= self.num_batches:
                    return None
                wait = worker.retry_at - time.monotonic()
                if wait <= 0 and self.queue and self.queue[0][0] < self.next_step + self.window:
                    return heapq.heappop(self.queue)[1]
                self.cond.wait(timeout=wait if wait > 0 else 1.0)

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
            f"{w.address}: {w.last_error or 'no error'} ({w.failures} failures in a row)"
            for w in self.reader.workers
        )


class _WorkerFault(Exception):
    """The worker, not the request, failed: the task's rest goes to another worker."""
