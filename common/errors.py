"""The error family for what a user gave neorec: a config, a data set, a path, an address.

Every error that judges the user's input derives from :class:`UserError`, raised where the
input is judged; the ``neorec`` command prints such an error as one ``neorec: error: …`` line
and exits 2. Any other exception is a bug in neorec: it keeps its traceback and exits 1.
"""

from __future__ import annotations

import errno
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FULL_OR_READ_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""The errors of a write that the place written to refuses (a full disk, a quota, a file
too large, a read-only file system): the user's to fix, not a bug."""


class UserError(Exception):
    """Bad input from the user (config, data, paths, addresses, command-line arguments),
    with a message that names what is wrong and where."""

    lasting = False
    """Whether the same command meets the error again however often it is started (a
    config, a data set, a spec: true of those kinds), so that torchrun's elastic restarts
    are not spent on it; false where a restart may mend it (a service that was down, a
    full disk, a lock another process held, a rank that died)."""


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key."""

    lasting = True


class PathError(UserError):
    """A file or directory the user named cannot be read or written (missing, a directory
    where a file was expected, no permission, a full disk)."""


def file_in_the_way(directory: str | Path) -> Path | None:
    """The first of ``directory`` and the directories above it that exists and is not a
    directory (so ``directory`` cannot be made), or None."""
    path = Path(directory)
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


@contextmanager
def user_paths() -> Iterator[None]:
    """Turn an :class:`OSError` raised inside into a :class:`PathError` naming the path:
    for the boundary where a command opens the paths its user named (an ``OSError``
    elsewhere is not the user's doing)."""
    try:
        yield
    except UserError:
        raise
    except OSError as err:
        where = f"{err.filename}: " if err.filename is not None else ""
        raise PathError(f"{where}{err.strerror or err}") from err


def describe(err: OSError) -> str:
    """An ``OSError`` in words (``no space left on device`` for ENOSPC)."""
    if err.errno == errno.ENOSPC:
        return "no space left on device"
    return err.strerror or str(err)
