"""The SSD tier against a dictionary: any sequence of writes, reads, flushes, compactions
and reopenings reads back the newest value of every row; corrupt segments are named."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from neorec.embedding_store import segments
from neorec.embedding_store.segments import SegmentError, SegmentTier

ROWS, WIDTH = 5000, 24


def _check(tier: SegmentTier, model: dict[int, np.ndarray], rng: np.random.Generator) -> None:
    rows = rng.choice(ROWS, 400, replace=False).astype(np.int64)
    found, data = tier.read(rows)
    for row, f, d in zip(rows.tolist(), found, data):
        assert f == (row in model), row
        if f:
            assert np.array_equal(d, model[row]), row


@pytest.mark.parametrize("direct_io", [False, True])
def test_random_operations_always_read_the_newest_value(tmp_path, direct_io):
    rng = np.random.default_rng(0)
    tier = SegmentTier(tmp_path, ROWS, WIDTH, segment_bytes=20_000, direct_io=direct_io)
    model: dict[int, np.ndarray] = {}
    hot = rng.choice(ROWS, 300, replace=False)
    for step in range(300):
        action = rng.random()
        if action < 0.6:  # write a batch of distinct rows, mostly hot ones: old copies become garbage
            rows = np.unique(np.where(rng.random(60) < 0.8, rng.choice(hot, 60), rng.integers(0, ROWS, 60)))
            data = rng.integers(0, 256, (rows.size, WIDTH), dtype=np.uint8)
            tier.write(rows, data)
            model.update({int(r): d for r, d in zip(rows, data)})
        elif action < 0.75:
            tier.flush()
        elif action < 0.8:  # reopen: the index is rebuilt from the segments alone
            tier.close()
            tier = SegmentTier(tmp_path, ROWS, WIDTH, segment_bytes=20_000, direct_io=direct_io)
        _check(tier, model, rng)
    counters = tier.counters()
    assert counters.compactions > 0 and counters.live_rows <= len(model)
    assert counters.bytes_written <= 2.5 * counters.dirty_bytes  # appends plus compaction
    tier.close()


def test_a_corrupt_or_truncated_segment_is_named(tmp_path):
    tier = SegmentTier(tmp_path, ROWS, WIDTH, segment_bytes=1 << 20)
    tier.write(np.arange(100, dtype=np.int64), np.ones((100, WIDTH), dtype=np.uint8))
    tier.close()
    segment = next(tmp_path.glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[-10] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match=f"{segment}: corrupt or truncated"):
        SegmentTier(tmp_path, ROWS, WIDTH)
    segment.write_bytes(bytes(data[:500]))
    with pytest.raises(SegmentError, match=str(segment)):
        SegmentTier(tmp_path, ROWS, WIDTH)


def test_a_half_written_segment_is_never_taken_for_one(tmp_path):
    tier = SegmentTier(tmp_path, ROWS, WIDTH)
    tier.write(np.arange(10, dtype=np.int64), np.full((10, WIDTH), 7, dtype=np.uint8))
    tier.close()
    (tmp_path / "00000099.seg.tmp").write_bytes(b"NSG1 half a segment")  # a crash during a flush
    reopened = SegmentTier(tmp_path, ROWS, WIDTH)
    found, data = reopened.read(np.arange(12, dtype=np.int64))
    assert found.tolist() == [True] * 10 + [False] * 2 and (data[:10] == 7).all()
    assert not (tmp_path / "00000099.seg.tmp").exists()


def test_a_flush_on_a_full_disk_keeps_the_rows_buffered_and_no_part_written_file(tmp_path, monkeypatch):
    tier = SegmentTier(tmp_path, ROWS, WIDTH)
    tier.write(np.arange(10, dtype=np.int64), np.full((10, WIDTH), 7, dtype=np.uint8))

    def full(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(segments.os, "fsync", full)
    with pytest.raises(segments.TierWriteError, match=r"^cannot write the store's segment .*00000001\.seg: no space"):
        tier.flush(sync=True)
    assert list(tmp_path.glob("*.tmp")) == []  # the part-written segment holds no space
    found, data = tier.read(np.arange(10, dtype=np.int64))
    assert found.all() and (data == 7).all()  # still buffered
    monkeypatch.undo()  # the disk has room again
    tier.close()
    found, data = SegmentTier(tmp_path, ROWS, WIDTH).read(np.arange(10, dtype=np.int64))
    assert found.all() and (data == 7).all()


def test_the_index_s_blocks_are_given_before_a_flush_so_a_full_disk_is_an_error_not_a_sigbus(tmp_path, monkeypatch):
    """The index is a sparse file written through a mapping: a store to a page the full disk
    could not back would kill the process with SIGBUS."""
    rows = np.array([3, 900, 901, ROWS - 1], dtype=np.int64)
    tier = SegmentTier(tmp_path, ROWS, WIDTH)
    given: list[tuple[int, int]] = []
    monkeypatch.setattr(segments.os, "posix_fallocate", lambda fd, offset, length: given.append((offset, length)))
    tier.write(rows, np.full((rows.size, WIDTH), 5, dtype=np.uint8))
    tier.flush(sync=True)
    page = segments.INDEX_PAGE
    pages = sorted({int(r) * 8 // page for r in rows})
    covered = [p for offset, length in given for p in range(offset // page, -(-(offset + length) // page))]
    assert sorted(covered) == pages  # the pages under the rows' entries, each once (runs of pages in one call)
    assert all(offset + length <= 8 * ROWS for offset, length in given)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(segments.os, "posix_fallocate", full)
    tier.write(rows, np.full((rows.size, WIDTH), 6, dtype=np.uint8))
    with pytest.raises(segments.TierWriteError, match=f"^cannot write the store's index {tmp_path / 'index.bin'}: "
                                                       "no space left on device$"):
        tier.flush(sync=True)
    assert list(tmp_path.glob("*.tmp")) == [] and tier.read(rows)[1].min() == 6  # still buffered
    monkeypatch.undo()
    tier.close()


def test_rows_outside_the_table_are_refused(tmp_path):
    tier = SegmentTier(tmp_path, ROWS, WIDTH)
    with pytest.raises(IndexError, match=r"\[0, 5000\)"):
        tier.read(np.array([ROWS]))
    with pytest.raises(ValueError, match="24 bytes"):
        tier.write(np.array([1]), np.zeros((1, 3), dtype=np.uint8))


def test_an_index_larger_than_the_file_size_limit_is_named(tmp_path):
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "from neorec.embedding_store.segments import SegmentTier, TierWriteError\n"
            "try:\n    SegmentTier(sys.argv[1], 10**6, 8)\nexcept TierWriteError as err:\n    print(err)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == f"cannot write the store's index {tmp_path / 't' / 'index.bin'}: File too large", \
        done.stderr
