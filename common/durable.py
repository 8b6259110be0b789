"""Writing files so that they survive a power loss: data fsynced before a file is named,
names (directory entries) fsynced before anything refers to them.

Every place that commits a file (a checkpoint's files and manifest, a store segment, a
run's JSON files) goes through these helpers.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s data and metadata to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(path: str | Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed, linked) durable."""
    fsync_file(path)


def fsync_directories(path: str | Path, up_to: str | Path) -> None:
    """Fsync ``path`` and each directory above it up to and including ``up_to`` (its
    ancestor): every entry on the way to ``path`` is durable."""
    path, up_to = Path(path), Path(up_to)
    while True:
        fsync_directory(path)
        if path == up_to or path == path.parent:
            return
        path = path.parent


def fsync_tree(root: str | Path) -> None:
    """Fsync every file and directory under ``root`` (``root`` too), each directory after
    what it holds: a tree written without fsyncs made durable before it is renamed into
    place."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(os.path.join(directory, name))
        fsync_directory(directory)


def write_durably(path: str | Path, data: bytes) -> None:
    """``path`` holds ``data`` once this returns, or is as it was: written to a temporary
    sibling, fsynced, renamed into place, and the directory fsynced. A write that fails (a
    full disk) removes the temporary file, so that it holds no space."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        remove_quietly(tmp)
        raise
    replace_durably(tmp, path)


def remove_quietly(path: str | Path) -> None:
    """Remove the file ``path`` if it is there, as the cleanup after a failure: an error
    removing it (which would hide the failure's own) is ignored."""
    try:
        os.unlink(path)
    except OSError:
        pass


def replace_durably(source: str | Path, target: str | Path) -> None:
    """Rename ``source`` (a complete, fsynced file or directory) to ``target`` atomically,
    and make the new name durable."""
    os.replace(source, target)
    fsync_directory(Path(target).parent)
