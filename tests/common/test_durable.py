"""``write_durably``: the file holds the new bytes, or the old ones and no temporary file."""

from __future__ import annotations

import errno
import os

import pytest

from neorec.common import durable


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "state.json"
    durable.write_durably(path, b"old")
    durable.write_durably(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    durable.write_durably(path, b"old")

    def full(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(durable.os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device"):
        durable.write_durably(path, b"new" * 1000)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
