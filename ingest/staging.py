"""Writing a dataset directory all at once: the output goes to a temporary sibling, is
fsynced, and is renamed into place only when complete, so a failed or interrupted ``neorec
data import``, ``convert`` or ``synth`` leaves the directory as it was (empty, absent, or
the old dataset). A non-empty output directory is refused unless the caller means to
replace it.

The temporary sibling is removed when the write fails, is interrupted (Ctrl-C) or is
terminated (SIGTERM: removed, then the signal takes its default course). One whose writer
was killed outright (SIGKILL, a crash) names its host and process, and the next write of the
same output on that host removes it once that process is gone."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from neorec.common.abandoned import remove_abandoned
from neorec.common.durable import fsync_directory, fsync_file, fsync_tree
from neorec.common.errors import FULL_OR_READ_ONLY, PathError, UserError, describe, file_in_the_way


class OutputExistsError(UserError):
    """The output directory already holds something, and replacing it was not asked for."""


@contextmanager
def staged_output(out: str | Path, overwrite: bool = False, inputs: Sequence[str | Path] = ()) -> Iterator[Path]:
    """A new empty directory beside ``out`` to write the dataset into; when the block ends
    without an exception it becomes ``out`` (the old ``out``, if any, removed only then),
    else it is removed and ``out`` is untouched (a write the disk refused, a full one, is a
    :class:`PathError` naming ``out``). :class:`OutputExistsError` for a non-empty ``out``
    unless ``overwrite``, for an ``out`` to overwrite that holds one of ``inputs`` (the
    files, directories or glob patterns the dataset is made from), and for an ``out`` that
    holds the current directory (renamed away, it would leave the shell in a removed one)."""
    named, out = out, Path(os.path.abspath(out))  # "." and ".." have no name to stage beside
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{named} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"{named} is not empty: give --overwrite to replace what it holds, or another "
                                    "--out")
        _check_inputs_outside(named, out, inputs)
    if out.is_dir() and Path.cwd().resolve().is_relative_to(out.resolve()):
        raise OutputExistsError(f"{named} holds the current directory, which the new dataset would replace: run "
                                "the command from another directory, or give another --out")
    blocking = file_in_the_way(out.parent)
    if blocking is not None:
        raise OutputExistsError(f"{named} cannot be made: {blocking} is a file, not a directory")
    staging = _prepared(named, out)
    writeback = _Writeback(staging)
    try:
        with _sigterm_raises():
            yield staging
        error = writeback.stop()
        if error is not None:
            raise error
        fsync_tree(staging)
    except BaseException as err:
        writeback.stop()
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, _Terminated):
            os.kill(os.getpid(), signal.SIGTERM)  # its default action again: the process ends as it would have
        if isinstance(err, OSError) and err.errno in FULL_OR_READ_ONLY:  # Arrow's writers name no file
            raise _cannot_write(named, err) from None
        raise
    _swap_in(staging, out)


WRITEBACK_PERIOD_S = 1.0


class _Writeback:
    """Fsyncs the files under ``root`` every :data:`WRITEBACK_PERIOD_S` while a dataset is
    written there, so that the disk takes them while the writer computes and the final fsync
    finds little left to write (fsyncing everything at the end made an import ~20% slower on
    a slow disk). ``stop`` returns the first error an fsync met (the kernel may report a
    failed write-back once only, so it must not be lost)."""

    def __init__(self, root: Path) -> None:
        self._stopping = threading.Event()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(root,), name="dataset-writeback", daemon=True)
        self._thread.start()

    def _run(self, root: Path) -> None:
        while not self._stopping.wait(WRITEBACK_PERIOD_S):
            for directory, _, files in os.walk(root):
                for name in files:
                    try:
                        fsync_file(os.path.join(directory, name))
                    except FileNotFoundError:  # replaced or removed by the writer meanwhile
                        continue
                    except OSError as err:
                        self._error = err
                        return

    def stop(self) -> OSError | None:
        self._stopping.set()
        self._thread.join()
        return self._error


class _Terminated(BaseException):
    """SIGTERM arrived while a dataset was being written."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` in the main thread while the block runs, where
    SIGTERM would otherwise end the process at once (its default action)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _prepared(named: str | Path, out: Path) -> Path:
    """The staging directory of ``out`` (:func:`_staging_directory`), its parent made and
    abandoned ones removed first; a directory that refuses it is a :class:`PathError`
    naming ``out`` as the user did, ``named`` (not the staging directory, which is ours)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        return _staging_directory(out)
    except OSError as err:
        raise _cannot_write(named, err) from None


def _cannot_write(named: str | Path, err: OSError) -> PathError:
    """The error of a dataset ``named`` that the file system refuses (``err``), in words."""
    words = describe(err)
    return PathError(f"cannot write the dataset {named}: {words[:1].lower()}{words[1:]}")


def _staging_directory(out: Path) -> Path:
    """A new empty directory beside ``out``, named for this host and process, made by a
    plain ``mkdir``: it becomes ``out``, so it gets the mode the umask gives a directory
    (``tempfile.mkdtemp``'s is 0700)."""
    staging = out.parent / f".{out.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(8)}.partial"
    staging.mkdir()
    return staging


def _check_inputs_outside(named: str | Path, out: Path, inputs: Sequence[str | Path]) -> None:
    """:class:`OutputExistsError` when replacing ``out`` would remove one of ``inputs`` (a
    pattern's directory part is what is compared)."""
    inside = out.resolve()
    for given in inputs:
        fixed = re.split(r"[*?[]", str(given), maxsplit=1)[0]  # a pattern's part before its first wildcard
        if "://" not in fixed and Path(os.path.abspath(fixed or ".")).resolve().is_relative_to(inside):
            raise OutputExistsError(f"{given} lies in {named}, which --overwrite would replace: write the dataset to "
                                    "another --out")


def _remove_abandoned(out: Path) -> None:
    """Remove the staging directories of ``out`` left by writers on this host that were
    killed (their process is gone)."""
    remove_abandoned(out.parent, re.compile(
        rf"\.{re.escape(out.name)}\.(?P<host>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{{16}}\.partial"))


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
