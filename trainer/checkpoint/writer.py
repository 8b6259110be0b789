"""Writing a snapshot, off the training path: encode (quantize, compress), write and fsync
this rank's files, record them; rank 0 then waits for every rank's record and commits the
checkpoint (:func:`~neorec.trainer.checkpoint.layout.commit`) and prunes old ones.

One checkpoint is in flight at a time: submitting the next waits for the last. An error in
the background (a full disk, another rank that never recorded its files) is raised, naming
its cause, by the next call into the writer from the training thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neorec.trainer.checkpoint import records
from neorec.common.durable import fsync_directories, remove_quietly, write_durably
from neorec.trainer.checkpoint.layout import (BEST, DENSE_FILE, CheckpointError, FileEntry, Manifest, RankRecord, RecordEntry,
                                       StoreEntry, commit, prune, rank_file, rank_record)
from neorec.trainer.checkpoint.snapshot import ShardSnapshot, split
from neorec.common.errors import describe
from neorec.trainer.run.run_dir import RunDirError

log = logging.getLogger(__name__)
RECORD_POLL_S = 0.05


@dataclass
class CheckpointJob:
    """What one rank writes for one checkpoint; rank 0's ``manifest`` is the checkpoint's
    manifest without its files and records, which the commit fills in."""

    directory: Path
    rank: int
    world_size: int
    attempt: str
    """Shared by the ranks of one training attempt (see :class:`RankRecord`)."""
    shards: list[ShardSnapshot]
    store: list[StoreEntry]
    """This rank's store pieces, already linked into the directory."""
    bits: int
    sparse_steps: int
    dense: bytes | None = None
    manifest: Manifest | None = None
    keep: int = 0
    protect: set[str] = field(default_factory=set)
    commit_timeout_s: float = 300.0
    snapshot_s: float = 0.0
    best: bool = False
    """Rank 0 makes ``BEST`` name it once committed."""


class CheckpointWriter:
    """Writes :class:`CheckpointJob` s in a background thread (or in the caller's, when not
    ``asynchronous``)."""

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: Manifest | None = None
        """Rank 0: the manifest of the last checkpoint committed."""

    def submit(self, job: CheckpointJob) -> None:
        """Write ``job`` (waiting for the checkpoint before it first)."""
        self.wait()
        if not self.asynchronous:
            self._run(job)
            self._raise()
            return
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True, name="checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        """Wait for the checkpoint in flight; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def abandon(self, timeout_s: float) -> None:
        """Training failed: give the checkpoint in flight up to ``timeout_s`` to finish (it
        may be the one the run resumes from), ignoring its error."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._error = None

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self, job: CheckpointJob) -> None:
        if self.asynchronous:
            _lower_priority()
        try:
            started = time.perf_counter()
            job.directory.mkdir(parents=True, exist_ok=True)
            record = _write_rank(job)
            if job.rank == 0:
                self.last_committed = _commit(job, record, time.perf_counter() - started)
        except OSError as err:
            self._error = RunDirError(f"cannot write checkpoint {err.filename or job.directory}: {describe(err)}")
        except BaseException as err:  # surfaced in the training thread
            self._error = err


def _write_rank(job: CheckpointJob) -> RankRecord:
    """Write this rank's embedding file (and rank 0's dense state), then its record. If a
    write fails (a full disk), the files this rank wrote are removed: the checkpoint stays
    incomplete, and its partial files hold no space the run needs to go on or resume."""
    try:
        return _write_rank_files(job)
    except OSError:
        for name in (rank_file(job.rank), rank_record(job.rank), *([DENSE_FILE] if job.dense is not None else [])):
            remove_quietly(job.directory / name)
        raise


def _write_rank_files(job: CheckpointJob) -> RankRecord:
    name = rank_file(job.rank)
    path = job.directory / name
    entries: list[RecordEntry] = []
    offset = 0
    try:
        with open(path, "wb") as f:
            for snapshot in job.shards:
                for piece in split(snapshot.rows):
                    data = records.encode(piece, job.bits)
                    f.write(data)
                    entries.append(RecordEntry(name, offset, len(data), piece.table, piece.row_offset, piece.rows,
                                               piece.col_offset, piece.cols, piece.count, zlib.crc32(data)))
                    offset += len(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # name the file (a failed write does not)
        raise OSError(err.errno, err.strerror, str(path)) from None
    files = [FileEntry(name, offset)]
    if job.dense is not None:
        write_durably(job.directory / DENSE_FILE, job.dense)
        files.append(FileEntry(DENSE_FILE, len(job.dense), hashlib.sha256(job.dense).hexdigest()))
    for piece in job.store:  # its segments are durable (the tier's snapshot); now their names here
        fsync_directories(job.directory / piece.directory, job.directory)
    fsync_directories(job.directory, job.directory.parent)
    touched: dict[str, int] = {}
    for snapshot in job.shards:
        touched[snapshot.rows.table] = touched.get(snapshot.rows.table, 0) + snapshot.touched
    record = RankRecord(job.rank, files, entries, job.sparse_steps, touched, job.attempt, job.store)
    write_durably(job.directory / rank_record(job.rank), json.dumps(record.to_json()).encode())
    return record


def _commit(job: CheckpointJob, own: RankRecord, write_s: float) -> Manifest:
    """Rank 0: wait for every rank's record, then commit the manifest and prune."""
    deadline = time.monotonic() + job.commit_timeout_s
    ranks: dict[int, RankRecord] = {0: own}
    while len(ranks) < job.world_size:
        for rank in range(job.world_size):
            path = job.directory / rank_record(rank)
            if rank not in ranks and path.is_file():
                record = RankRecord.from_json(json.loads(path.read_text()))
                if record.attempt == job.attempt:  # not one a crashed attempt left
                    ranks[rank] = record
        if len(ranks) < job.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(job.world_size)) - set(ranks))
                raise CheckpointError(f"checkpoint {job.directory}: ranks {missing} did not record their files within "
                                      f"{job.commit_timeout_s:g} s; it stays incomplete")
            time.sleep(RECORD_POLL_S)
    manifest = job.manifest
    assert manifest is not None, "rank 0 commits with the manifest"
    touched: dict[str, int] = {}
    for record in ranks.values():
        manifest.files.extend(record.files)
        manifest.records.extend(record.records)
        manifest.store.extend(record.store)
        manifest.sparse_steps = max(manifest.sparse_steps, record.sparse_steps)
        for table, count in record.touched.items():
            touched[table] = touched.get(table, 0) + count
    manifest.stats = {"bytes": sum(f.bytes for f in manifest.files), "touched": touched,
                      "snapshot_s": job.snapshot_s, "write_s": write_s}
    manifest.best = job.best
    commit(job.directory, manifest)
    if job.best:
        write_durably(job.directory.parent / BEST, (manifest.name + "\n").encode())
    deleted = prune(job.directory.parent, job.keep, job.protect | set(manifest.chain)) if job.keep else []
    log.info("checkpoint %s committed (%s, %d bytes)%s", manifest.name, manifest.kind, manifest.stats["bytes"],
             f"; deleted {', '.join(deleted)}" if deleted else "")
    return manifest


def manifest_fields(**fields: Any) -> Manifest:
    """A manifest to be completed by the commit (files, records and stats empty)."""
    return Manifest(files=[], records=[], sparse_steps=0, **fields)


WRITER_NICENESS = 10
"""How much the background writer yields the CPU to training (Linux: per-thread nice)."""


def _lower_priority() -> None:
    """Run this thread at a lower priority than training's (where the platform allows it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: the writer runs as it is
        pass
