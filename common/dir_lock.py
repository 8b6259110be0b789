"""One owner per directory: an advisory ``flock`` on ``<directory>/.lock``, held for the
owner's lifetime and released by the kernel when the process dies (a crash leaves no stale
lock). The embedding store's directories and a run's directory use it.

A tier locks its own directory exclusively; a store service locks its whole ``--dir``
exclusively; a trainer's embedded store takes its directory shared (the ranks of one run
share it, each owning its own pieces). So two runs on the same pieces, a trainer and a
service, or two services on one directory find each other at once, and the second fails
with a :class:`DirectoryInUseError` naming the directory and, where it is known, the
holder's PID (written in the lock file).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from neorec.common.errors import PathError, UserError, file_in_the_way

LOCK_FILE = ".lock"


class DirectoryInUseError(UserError):
    """Another process (or another owner in this one) holds a store or run directory."""


class DirectoryLock:
    """The lock of ``directory`` (created if missing), held until :meth:`release`; ``what``
    the directory is and ``owners`` who may hold it, for the message of a refusal."""

    def __init__(self, directory: str | Path, shared: bool = False, what: str = "store directory",
                 owners: str = "a trainer or store service") -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise PathError(f"{what} {self.directory} cannot be made: {file_in_the_way(self.directory)} is a file, "
                            "not a directory") from None
        path = self.directory / LOCK_FILE
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(self._fd)
            self.release()
            raise DirectoryInUseError(
                f"{what} {self.directory} is in use by {f'process {holder}' if holder else 'another owner'} "
                f"({owners}); one owner at a time: stop it or choose another directory") from None
        except BaseException:
            self.release()
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Let another owner take the directory (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> int | None:
    """The PID the holder wrote in the lock file, if any."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None
