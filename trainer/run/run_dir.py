"""A run directory: where one training run's files live, and the rules that keep it
describing one run.

It holds ``config.json`` (the resolved config), ``metrics.jsonl``, ``summary.json``,
``plan.json`` (sharded runs), ``checkpoint/`` and ``store/`` (the embedding store's
tiers). A directory that already holds a run is only reused when told: ``overwrite``
removes that run's files first (never anything else), ``resume`` continues it. Before
training starts the directory must take a write (a read-only or unwritable directory is
found then, not after an epoch); JSON files are replaced atomically, so a crash leaves the
old file or the new one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from neorec.common.durable import write_durably
from neorec.common.errors import UserError, describe
from neorec.common.dir_lock import DirectoryLock
from neorec.trainer.checkpoint import layout as checkpoint_layout

log = logging.getLogger(__name__)

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLAN = "plan.json"
CHECKPOINTS = "checkpoint"
STORE = "store"
"""The tiers of tables on the embedding store (unless ``embedding_store.dir`` says where)."""
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""What ``flock`` fails with where the file system keeps no locks."""
RUN_FILES = (CONFIG, METRICS, SUMMARY, PLAN, CHECKPOINTS, STORE)
"""What a run writes; ``overwrite`` removes these and nothing else."""


class RunDirError(UserError, OSError):
    """The run directory cannot be used as asked."""


def check_claim(directory: str | Path, overwrite: bool = False, resume: bool = False) -> list[str]:
    """The run files ``directory`` holds (names from :data:`RUN_FILES`), once it is known
    that :func:`claim` may take it; changes nothing, so a run checks this first and claims
    the directory only when the rest of its set-up has been judged too.

    Raises :class:`RunDirError` when it is a file, when it holds another run and neither
    ``overwrite`` nor ``resume`` says what to do with it, or when ``resume`` finds no run.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file")
    held = [name for name in RUN_FILES if (path / name).exists() or (path / name).is_symlink()]
    if resume and not held:
        raise RunDirError(f"run directory {path} holds no run to resume")
    if held and not (overwrite or resume):
        if checkpoint_layout.complete(path / CHECKPOINTS):
            choices = "pass --overwrite to replace it, --resume to continue it"
        else:  # --resume would be refused: nothing to restore
            choices = "it holds no complete checkpoint to resume from: pass --overwrite to replace it"
        raise RunDirError(f"run directory {path} already holds a run ({', '.join(held)}); {choices}, or choose "
                          f"another run.dir")
    return held


def claim(directory: str | Path, overwrite: bool = False, resume: bool = False) -> Path:
    """Make ``directory`` ready for a run and return it: :func:`check_claim`, then, with
    ``overwrite``, the old run's files removed (a symbolic link among them is removed
    itself, not what it points to, which lies outside the run), then a write tried.

    Raises :class:`RunDirError` as :func:`check_claim` does, or when the directory cannot
    be created or written.
    """
    path = Path(directory)
    held = check_claim(path, overwrite, resume)
    if overwrite and not resume:
        for name in held:
            target = path / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".neorec-write-check"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        raise RunDirError(f"run directory {path} is not writable: {describe(err)}") from None
    return path


def lock(directory: str | Path, what: str = "run directory", owners: str = "a trainer") -> DirectoryLock | None:
    """The run directory's lock, the directory created if missing: one trainer a run
    directory (its rank 0), for the run's lifetime, so that a second trainer given the same
    directory (``--resume`` or ``--overwrite`` while the first runs) is refused before it
    changes anything. Also the lock of a directory in a run's (``what``, held by
    ``owners``): a job launcher's ``logs``. Raises :class:`DirectoryInUseError` naming the
    holder's PID, or :class:`RunDirError` when the directory cannot be created. None, with
    a warning, on a file system without locks (an NFS mount without its lock service, say)."""
    path = Path(directory)
    try:
        return DirectoryLock(path, what=what, owners=owners)
    except OSError as err:
        if err.errno in NO_LOCKS:
            log.warning("%s %s cannot be locked (%s): a second owner (%s) is not kept out", what, path,
                        describe(err), owners)
            return None
        raise RunDirError(f"{what} {path} is not writable: {describe(err)}") from None


def write_json(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON, atomically and durably; an ``OSError`` names the file."""
    try:
        write_durably(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
    except OSError as err:
        raise RunDirError(f"cannot write {path}: {describe(err)}") from None

