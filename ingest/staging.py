"""Writing a dataset directory all at once: the output goes to a temporary sibling and is
renamed into place only when complete, so a failed or interrupted ``neorec data import``,
``convert`` or ``synth`` leaves the directory as it was (empty, absent, or the old dataset).
A non-empty output directory is refused unless the caller means to replace it."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from neorec.common.durable import fsync_directory
from neorec.common.errors import FULL_OR_READ_ONLY, PathError, UserError, describe


class OutputExistsError(UserError):
    """The output directory already holds something, and replacing it was not asked for."""


@contextmanager
def staged_output(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """A new empty directory beside ``out`` to write the dataset into; when the block ends
    without an exception it becomes ``out`` (the old ``out``, if any, removed only then),
    else it is removed and ``out`` is untouched (a write the disk refused, a full one, is a
    :class:`PathError` naming ``out``). :class:`OutputExistsError` for a non-empty ``out``
    unless ``overwrite``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} is not empty: give --overwrite to replace what it holds, or another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_directory(out)
    try:
        yield staging
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in FULL_OR_READ_ONLY:  # Arrow's writers name no file
            raise PathError(f"cannot write the dataset {out}: {describe(err)}") from None
        raise
    _swap_in(staging, out)


def _staging_directory(out: Path) -> Path:
    """A new empty directory beside ``out``, made by a plain ``mkdir``: it becomes ``out``,
    so it gets the mode the umask gives a directory (``tempfile.mkdtemp``'s is 0700)."""
    staging = out.parent / f".{out.name}.{secrets.token_hex(8)}.partial"
    staging.mkdir()
    return staging


def _swap_in(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``; an existing ``out`` is moved aside first and removed
    once the new one is in place."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / out.name)
    try:
        os.replace(staging, out)
    except BaseException:
        if old is not None:
            os.replace(old / out.name, out)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_directory(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
