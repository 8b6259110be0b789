"""The SSD tier of one table: rows in append-only segment files on local disk.

Rows written back (dirty rows leaving the cache) are buffered and appended to a new
segment file when the buffer is full: sequential writes, never rewrites in place. A
segment is ``MAGIC``, a header (row bytes, row count, CRC-32 of its body), the rows' ids
(int64) and their bytes; it is written to a temporary name and renamed, so a named segment
is always whole, and a corrupt or truncated one is an error naming the file. An index
(int64 per table row, memory-mapped, rebuilt from the segments on open) points at each
row's newest copy; a row never written is in no segment and reads as "not found" (its
value is its initial one). Segments whose rows were mostly superseded are compacted: their
live rows appended anew, the files deleted.

Reads are gathered segment by segment from memory maps (the page cache serves repeats), or
with ``direct_io`` read through ``O_DIRECT`` in aligned blocks by a few threads at once
(queue depth), so that every read is a disk read.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neorec.common.durable import fsync_directory, fsync_file, remove_quietly
from neorec.common.errors import UserError, describe
from neorec.common.dir_lock import DirectoryLock

MAGIC = b"NSG1"
HEADER = struct.Struct("<4sIQI")
"""magic, row bytes, row count, CRC-32 of ids and rows."""
BLOCK = 4096
SEGMENT_BYTES = 32 << 20
INDEX_FILE = "index.bin"
"""The index's file in a tier's directory (which marks the directory as a tier's)."""
INDEX_PAGE = mmap.PAGESIZE
"""The index's file is given disk blocks a page of the mapping at a time."""
"""Buffered rows are written as a segment once they reach this size."""
COMPACT_BELOW = 0.5
"""A segment whose live rows fall below this share of its rows is compacted."""
NEVER = 0
"""Index value of a row in no segment."""
SEGMENT_NAME = re.compile(r"\d{8,}\.seg")


class TierWriteError(UserError, OSError):
    """A tier's disk refused a write (full, over a quota or a file-size limit): its
    ``errno``, and a message naming the file."""

    def __str__(self) -> str:
        return self.strerror


class SegmentError(UserError, RuntimeError):
    """A segment file is corrupt or truncated; the message names it."""


@dataclass
class Segment:
    """One segment file: its number, rows, and how many of them are still the newest."""

    number: int
    path: Path
    count: int
    live: int
    payload: np.ndarray | None = None
    """Its rows, memory-mapped (uint8 ``[count, row_bytes]``)."""

    @property
    def body_offset(self) -> int:
        return HEADER.size + 8 * self.count


@dataclass
class TierStats:
    rows_read: int = 0
    rows_found: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    dirty_bytes: int = 0
    """Bytes of rows handed to :meth:`SegmentTier.write` (the write amplification's
    denominator)."""
    compactions: int = 0
    segments: int = 0
    live_rows: int = 0
    stored_rows: int = 0
    buffered_rows: int = 0


class SegmentTier:
    """The rows of one table of ``rows`` rows of ``row_bytes`` bytes each, under ``directory``."""

    def __init__(self, directory: str | Path, rows: int, row_bytes: int, *, segment_bytes: int = SEGMENT_BYTES,
                 direct_io: bool = False, read_threads: int = 4, reset: bool = False,
                 store_root: str | Path | None = None) -> None:
        """``reset``: delete the segments found under ``directory`` (a fresh run's tier);
        else they are the tier's rows. The tier owns ``directory`` until :meth:`close`
        (:class:`~neorec.common.dir_lock.DirectoryInUseError` if another owner
        has it); ``store_root``: the store directory it is a piece of, held shared."""
        if rows <= 0 or row_bytes <= 0:
            raise ValueError("a tier needs rows and row bytes")
        self.directory = Path(directory)
        self._locks = [] if store_root is None else [DirectoryLock(store_root, shared=True)]
        try:
            self._locks.append(DirectoryLock(self.directory))
            self._open(rows, row_bytes, segment_bytes, direct_io, read_threads, reset)
        except BaseException:
            self._release()
            raise

    def _open(self, rows: int, row_bytes: int, segment_bytes: int, direct_io: bool, read_threads: int,
              reset: bool) -> None:
        self.rows = rows
        self.row_bytes = row_bytes
        self.segment_bytes = segment_bytes
        self.direct_io = direct_io
        self.stats = TierStats()
        self.lock = threading.RLock()
        """Held by every operation: one caller at a time (a trainer's fetch thread and its
        main thread, or a service's handler threads)."""
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="tier-read") if direct_io else None
        self._buffer_rows: list[np.ndarray] = []
        self._buffer_data: list[np.ndarray] = []
        self._buffered: dict[int, tuple[int, int]] = {}
        """Row → (buffer piece, position in it) of rows written since the last flush."""
        self._buffer_bytes = 0
        self.segments: dict[int, Segment] = {}
        self.closed = False
        self._unsynced: set[int] = set()
        """Segments written without fsync (auto-flushes, compaction): synced, with the
        directory, by the next ``flush(sync=True)`` (every snapshot and close)."""
        for leftover in self.directory.glob("*.seg.tmp"):  # a flush a crash cut short
            leftover.unlink()
        if reset:
            for path in self.directory.glob("*.seg"):
                path.unlink()
        self._open_index()

    def _open_index(self) -> None:
        """Index the segments of the directory (they are the truth; the index is rebuilt)."""
        self.segments = {}
        index_path = self.directory / INDEX_FILE
        index_path.unlink(missing_ok=True)
        try:
            with open(index_path, "wb") as f:
                f.truncate(8 * self.rows)  # sparse: a table of billions of rows costs what it stores
        except OSError as err:  # a file-size limit, say
            raise TierWriteError(err.errno, f"cannot write the store's index {index_path}: {describe(err)}") from None
        self.index = np.memmap(index_path, dtype=np.int64, mode="r+", shape=(self.rows,))
        for path in sorted(self.directory.glob("*.seg")):
            self._replay(path)
        self._next = max(self.segments, default=0) + 1

    # -------------------------------------------------------------------- reading
    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, data)`` for int64 ``rows``: bool ``[n]`` whether each was ever written,
        uint8 ``[n, row_bytes]`` its newest bytes (zeros where not found)."""
        rows = np.asarray(rows, dtype=np.int64)
        with self.lock:
            self._check_rows(rows)
            data = np.zeros((rows.size, self.row_bytes), dtype=np.uint8)
            found = np.zeros(rows.size, dtype=bool)
            in_buffer = np.fromiter((r in self._buffered for r in rows.tolist()), dtype=bool, count=rows.size) \
                if self._buffered else np.zeros(rows.size, dtype=bool)
            for i in np.flatnonzero(in_buffer).tolist():
                piece, position = self._buffered[int(rows[i])]
                data[i] = self._buffer_data[piece][position]
            found |= in_buffer
            entries = np.where(in_buffer, NEVER, self.index[rows])
            stored = entries != NEVER
            found |= stored
            numbers, positions = entries >> 32, (entries & 0xFFFFFFFF) - 1
            for number in np.unique(numbers[stored]).tolist():
                which = np.flatnonzero(stored & (numbers == number))
                data[which] = self._read_segment(self.segments[number], positions[which])
            self.stats.rows_read += rows.size
            self.stats.rows_found += int(found.sum())
            self.stats.bytes_read += int(stored.sum()) * self.row_bytes
            return found, data

    def _read_segment(self, segment: Segment, positions: np.ndarray) -> np.ndarray:
        if not self.direct_io:
            return segment.payload[positions]
        out = np.empty((positions.size, self.row_bytes), dtype=np.uint8)
        starts = segment.body_offset + positions * self.row_bytes
        chunks = np.array_split(np.arange(positions.size), min(positions.size, 4 * self._pool._max_workers) or 1)
        list(self._pool.map(lambda part: self._read_direct(segment.path, starts[part], out, part), chunks))
        return out

    def _read_direct(self, path: Path, starts: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
        """Read rows at byte offsets ``starts`` of ``path`` with O_DIRECT into ``out[where]``."""
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            span = -(-(self.row_bytes + BLOCK - 1) // BLOCK) * BLOCK + BLOCK
            buffer = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT wants
            view = np.frombuffer(buffer, dtype=np.uint8)
            window = memoryview(buffer)
            for start, target in zip(starts.tolist(), where.tolist()):
                aligned = start // BLOCK * BLOCK
                length = -(-(start + self.row_bytes - aligned) // BLOCK) * BLOCK
                got = os.preadv(descriptor, [window[:length]], aligned)
                if got < start - aligned + self.row_bytes:
                    raise SegmentError(f"{path}: truncated (a row at byte {start} is past its end)")
                out[target] = view[start - aligned : start - aligned + self.row_bytes]
            del view
            window.release()
            buffer.close()
        finally:
            os.close(descriptor)

    # -------------------------------------------------------------------- writing
    def write(self, rows: np.ndarray, data: np.ndarray) -> None:
        """Rows ``rows`` (int64, distinct) now hold ``data`` (uint8 ``[n, row_bytes]``);
        buffered, written as a segment once the buffer is full."""
        rows = np.asarray(rows, dtype=np.int64)
        if data.shape != (rows.size, self.row_bytes):
            raise ValueError(f"expected rows of {self.row_bytes} bytes for {rows.size} rows, got {data.shape}")
        if not rows.size:
            return
        with self.lock:
            self._check_rows(rows)
            piece = len(self._buffer_rows)
            self._buffer_rows.append(rows.copy())
            self._buffer_data.append(np.ascontiguousarray(data, dtype=np.uint8).copy())
            for position, row in enumerate(rows.tolist()):
                self._buffered[row] = (piece, position)
            self._buffer_bytes += data.nbytes
            self.stats.dirty_bytes += data.nbytes
            if self._buffer_bytes >= self.segment_bytes:
                self.flush()

    def flush(self, sync: bool = False) -> None:
        """Write the buffered rows as a segment, then compact segments that have become
        mostly garbage; ``sync``: then make every segment and the directory durable (those
        written unsynced before included)."""
        with self.lock:
            if self._buffered:
                rows = np.fromiter(self._buffered, dtype=np.int64, count=len(self._buffered))
                where = np.array([self._buffered[r] for r in rows.tolist()], dtype=np.int64)
                data = np.empty((rows.size, self.row_bytes), dtype=np.uint8)
                for piece in np.unique(where[:, 0]).tolist():
                    mask = where[:, 0] == piece
                    data[mask] = self._buffer_data[piece][where[mask, 1]]
                self._append(rows, data, sync)
                self._buffer_rows, self._buffer_data, self._buffered, self._buffer_bytes = [], [], {}, 0
            self._compact(sync)
            if sync:
                self._sync()

    def _sync(self) -> None:
        """fsync the segments written unsynced (still present), then the directory."""
        for number in sorted(self._unsynced):
            if number in self.segments:
                fsync_file(self.segments[number].path)
        self._unsynced.clear()
        fsync_directory(self.directory)

    def _append(self, rows: np.ndarray, data: np.ndarray, sync: bool) -> None:
        number = self._next
        self._next += 1
        path = self.directory / f"{number:08d}.seg"
        self._reserve_index(rows)
        ids, body = rows.astype("<i8").tobytes(), data.tobytes()
        header = HEADER.pack(MAGIC, self.row_bytes, rows.size, zlib.crc32(body, zlib.crc32(ids)))
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(ids)
                f.write(body)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as err:  # a full disk: the rows stay buffered, the part-written file goes
            remove_quietly(tmp)
            if isinstance(err, OSError):
                raise TierWriteError(err.errno, f"cannot write the store's segment {path}: {describe(err)}") from None
            raise
        os.replace(tmp, path)
        if not sync:
            self._unsynced.add(number)
        self.stats.bytes_written += len(header) + len(ids) + len(body)
        self._add(number, path, rows)

    def _reserve_index(self, rows: np.ndarray) -> None:
        """Give the index's sparse file the disk blocks under ``rows``' entries before they
        are written through the mapping: a full disk is then an ``OSError`` (ENOSPC) naming
        the index, where a store to an unbacked page of the mapping would be a SIGBUS."""
        pages = np.unique(rows.astype(np.int64) * 8 // INDEX_PAGE)
        if not pages.size:
            return
        starts = pages[np.flatnonzero(np.diff(pages, prepend=pages[0] - 2) != 1)]
        ends = pages[np.flatnonzero(np.diff(pages, append=pages[-1] + 2) != 1)] + 1
        fd = os.open(self.index.filename, os.O_RDWR | os.O_CLOEXEC)
        try:
            for start, end in zip(starts.tolist(), ends.tolist()):
                os.posix_fallocate(fd, start * INDEX_PAGE, min(end * INDEX_PAGE, 8 * self.rows) - start * INDEX_PAGE)
        except OSError as err:
            raise TierWriteError(err.errno, f"cannot write the store's index {self.index.filename}: "
                                            f"{describe(err)}") from None
        finally:
            os.close(fd)

    def _add(self, number: int, path: Path, rows: np.ndarray) -> None:
        """Register segment ``number`` holding ``rows`` (in order) as their newest copy."""
        previous = self.index[rows]
        for old, count in zip(*np.unique(previous[previous != NEVER] >> 32, return_counts=True)):
            self.segments[int(old)].live -= int(count)
        self.index[rows] = (np.int64(number) << 32) | (np.arange(rows.size, dtype=np.int64) + 1)
        segment = Segment(number, path, rows.size, rows.size)
        segment.payload = np.memmap(path, dtype=np.uint8, mode="r", offset=segment.body_offset,
                                    shape=(rows.size, self.row_bytes)) if rows.size else np.zeros((0, self.row_bytes),
                                                                                                 np.uint8)
        self.segments[number] = segment

    def _replay(self, path: Path) -> None:
        """Index a segment found on open, after checking it is whole."""
        rows, _ = _segment_contents(path, self.row_bytes)
        self._check_rows(rows)
        self._reserve_index(rows)
        self._add(int(path.stem), path, rows)

    def _compact(self, sync: bool) -> None:
        """Append the live rows of mostly superseded segments anew and delete the segments."""
        for segment in sorted(self.segments.values(), key=lambda s: s.number):
            if segment.live >= COMPACT_BELOW * segment.count or segment.number == self._next - 1:
                continue
            if segment.live:
                positions = np.arange(segment.count, dtype=np.int64)
                ids = np.frombuffer(segment.path.read_bytes()[HEADER.size : segment.body_offset], dtype="<i8")
                live = self.index[ids] == ((np.int64(segment.number) << 32) | (positions + 1))
                self._append(ids[live].astype(np.int64), np.asarray(segment.payload[positions[live]]), sync)
            del self.segments[segment.number]
            segment.payload = None
            segment.path.unlink()
            self.stats.compactions += 1

    # ---------------------------------------------------------------- checkpoints
    def snapshot(self, directory: Path) -> list[tuple[str, int]]:
        """Make ``directory`` hold the tier's rows as they are now: every buffered row
        written and fsynced, then each segment hard-linked there (copied across file
        systems), the links made durable. Segments are never changed once named, so a link
        is a snapshot that costs no bytes. Returns the segments' names and sizes."""
        directory.mkdir(parents=True, exist_ok=True)
        with self.lock:
            self.flush(sync=True)
            out = []
            for segment in sorted(self.segments.values(), key=lambda s: s.number):
                _link_or_copy(segment.path, directory / segment.path.name)
                out.append((segment.path.name, segment.path.stat().st_size))
            fsync_directory(directory)
            return out

    def load(self, directory: Path, names: list[str], checked: bool = False) -> None:
        """Replace the tier's rows by the segments ``names`` of ``directory`` (a
        :meth:`snapshot`): its own segments and buffered rows are dropped, once every one of
        them is found whole (:class:`SegmentError` naming the first that is not, the tier
        unchanged), unless ``checked`` says the caller found them whole already (a
        checkpoint's restore checks every segment before any tier loads one)."""
        if not checked:
            check_segments([directory / name for name in names], self.row_bytes, self.rows)
        with self.lock:
            self._buffer_rows, self._buffer_data, self._buffered, self._buffer_bytes = [], [], {}, 0
            for segment in self.segments.values():
                segment.payload = None
                segment.path.unlink()
            for name in names:
                _link_or_copy(directory / name, self.directory / name)
            fsync_directory(self.directory)
            self._open_index()

    # ------------------------------------------------------------------ the rest
    def _check_rows(self, rows: np.ndarray) -> None:
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"rows must lie in [0, {self.rows}) (tier {self.directory})")

    def counters(self) -> TierStats:
        with self.lock:
            self.stats.segments = len(self.segments)
            self.stats.live_rows = sum(s.live for s in self.segments.values())
            self.stats.stored_rows = sum(s.count for s in self.segments.values())
            self.stats.buffered_rows = len(self._buffered)
            return TierStats(**vars(self.stats))

    def close(self) -> None:
        """Flush and release the segments' and the index's mappings (a second close does
        nothing)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.flush(sync=True)
            for segment in self.segments.values():
                segment.payload = None
            if self._pool is not None:
                self._pool.shutdown()
            self.index.flush()
            del self.index  # the mapping, and the descriptor it holds, go with the last reference
            self._release()

    def _release(self) -> None:
        for lock in self._locks:
            lock.release()


def _link_or_copy(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)
        fsync_file(target)


def check_segments(paths: list[Path], row_bytes: int, rows: int | None = None) -> None:
    """Raise :class:`SegmentError` naming the first of the segment files ``paths`` that is
    not whole (its header, row width or checksum), or, given the table's ``rows``, holds a
    row outside ``[0, rows)``; one file in memory at a time."""
    for path in paths:
        ids, _ = _segment_contents(path, row_bytes)
        if rows is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise SegmentError(f"{path}: rows outside [0, {rows}), this table's: another table's segment")


def read_segments(paths: list[Path], row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The newest copy of every row in the segment files ``paths``: int64 ``rows`` (sorted)
    and uint8 ``[n, row_bytes]`` data. Later segment numbers supersede earlier ones. Raises
    :class:`SegmentError` naming a corrupt file."""
    newest: dict[int, np.ndarray] = {}
    for path in sorted(paths, key=lambda p: int(p.stem)):
        rows, data = _segment_contents(path, row_bytes)
        newest.update(zip(rows.tolist(), data))
    rows = np.array(sorted(newest), dtype=np.int64)
    data = np.stack([newest[r] for r in rows.tolist()]) if rows.size else np.zeros((0, row_bytes), np.uint8)
    return rows, data


def segment_checksum(path: Path) -> int:
    """The CRC-32 of a segment's ids and rows as its header gives it (the body not read):
    which segment it is, for a checkpoint that names its segments."""
    with open(path, "rb") as f:
        return _header(f.read(HEADER.size), path)[3]


def _header(raw: bytes, path: Path) -> tuple[bytes, int, int, int]:
    """The header at the start of ``raw``: magic, row bytes, row count, CRC-32."""
    if len(raw) < HEADER.size or raw[:4] != MAGIC:
        raise SegmentError(f"{path}: not a segment, or truncated before its header")
    return HEADER.unpack_from(raw)


def _segment_contents(path: Path, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A whole segment's rows and data, after checking its header and checksum."""
    raw = path.read_bytes()
    _, stored_row_bytes, count, crc = _header(raw, path)
    if stored_row_bytes != row_bytes:
        raise SegmentError(f"{path}: rows of {stored_row_bytes} bytes, the table's are {row_bytes}")
    body = raw[HEADER.size:]
    if len(body) != count * (8 + row_bytes) or zlib.crc32(body) != crc:
        raise SegmentError(f"{path}: corrupt or truncated segment (its checksum does not match)")
    rows = np.frombuffer(body, dtype="<i8", count=count).astype(np.int64)
    data = np.frombuffer(body, dtype=np.uint8, offset=8 * count).reshape(count, row_bytes)
    return rows, data
