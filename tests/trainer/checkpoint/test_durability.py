"""A committed manifest names only durable files: before ``manifest.json`` is renamed into
place, every file it lists (a rank's embedding file, ``dense.pt``, the store's segments,
including those the store wrote by auto-flush and compaction) was fsynced, and so was
every directory on the way to it. Recorded by wrapping ``os.fsync``, for full,
incremental and store-holding checkpoints."""

import os
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.checkpoint.helpers import module, tables_info, train_steps
from neorec.embedding_store.segments import SegmentTier
from neorec.trainer.checkpoint.checkpointer import Checkpointer
from neorec.trainer.checkpoint.layout import MANIFEST, read_manifest
from neorec.trainer.config import CheckpointConfig
from neorec.trainer.embedding.store_backed import StorePiece

ROW_BYTES = 32


class _DiskLog:
    """Every fsync (the inode it synced) and every rename into a ``manifest.json``, in order."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, object]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            info = os.fstat(fd)
            self.events.append(("fsync", (info.st_dev, info.st_ino)))
            return real_fsync(fd)

        def replace(source, target, *args, **kwargs):
            real_replace(source, target, *args, **kwargs)
            if Path(target).name == MANIFEST:
                self.events.append(("manifest", Path(target).parent.name))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def synced_before_commit(self, name: str) -> set:
        """Inodes fsynced before checkpoint ``name``'s manifest was renamed into place."""
        synced = set()
        for kind, value in self.events:
            if kind == "manifest" and value == name:
                return synced
            if kind == "fsync":
                synced.add(value)
        raise AssertionError(f"the manifest of {name} was never renamed into place")


def _inode(path: Path):
    info = path.stat()
    return info.st_dev, info.st_ino


def _assert_durable(root: Path, name: str, log: _DiskLog) -> None:
    directory = root / name
    manifest = read_manifest(directory)
    listed = [directory / f.name for f in manifest.files]
    listed += [directory / piece.directory / f.name for piece in manifest.store for f in piece.files]
    synced = log.synced_before_commit(name)
    assert listed
    for path in listed:
        assert _inode(path) in synced, f"{path} was not fsynced before the manifest committed"
        for parent in [path.parent, *path.parent.parents]:
            assert _inode(parent) in synced, f"{parent} (holding {path.name}) was not fsynced"
            if parent == root:
                break


def _checkpointer(root: Path, embeddings, store=list) -> Checkpointer:
    return Checkpointer(root, CheckpointConfig(mode="incremental", keep=10), rank=0, world_size=1, attempt="test",
                        views=embeddings.shard_views, store=store, local_optimizer_steps=embeddings.local_optimizer_steps,
                        tables=tables_info(embeddings), run_config={}, plan=None, sum_over_ranks=lambda v: list(v),
                        commit_timeout_s=10.0)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_full_and_incremental_checkpoints_commit_only_durable_files(tmp_path, monkeypatch, asynchronous):
    log = _DiskLog(monkeypatch)
    embeddings = module()
    root = tmp_path / "checkpoint"
    writer = _checkpointer(root, embeddings)
    writer.writer.asynchronous = asynchronous
    for step in (1, 2):
        train_steps(embeddings, 2, seed=step)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense={"step": step}, wait=True)
    assert [read_manifest(root / f"step-00000000{s}").kind for s in (1, 2)] == ["full", "incremental"]
    for step in (1, 2):
        _assert_durable(root, f"step-00000000{step}", log)


def test_a_checkpoint_holding_store_segments_commits_only_durable_segments(tmp_path, monkeypatch):
    tier = SegmentTier(tmp_path / "tier", rows=400, row_bytes=ROW_BYTES, segment_bytes=40 * ROW_BYTES)
    rng = np.random.default_rng(0)
    for _ in range(12):  # auto-flushes, and compaction of the segments they supersede
        rows = rng.choice(60, 30, replace=False).astype(np.int64)
        tier.write(rows, rng.integers(0, 255, (30, ROW_BYTES), dtype=np.uint8))
    assert tier.counters().compactions > 0
    log = _DiskLog(monkeypatch)  # from here: what the checkpoint made durable
    embeddings = module()
    train_steps(embeddings, 1, seed=1)
    piece = StorePiece("big", "big@0", 0, 400, ROW_BYTES, tier)
    root = tmp_path / "checkpoint"
    _checkpointer(root, embeddings, store=lambda: [piece]).save(
        global_step=1, epoch=0, step_in_epoch=1, dense=None, wait=True)
    manifest = read_manifest(root / "step-000000001")
    assert manifest.store and len(manifest.store[0].files) > 1
    _assert_durable(root, "step-000000001", log)
    tier.close()
