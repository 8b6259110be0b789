"""Directories a process of this host made for itself and could not remove because it was
killed outright (SIGKILL, a crash): found by name, which holds the maker's PID, and
removed once that process is gone."""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path


def remove_abandoned(parent: str | Path, pattern: re.Pattern[str]) -> None:
    """Remove each directory in ``parent`` whose name matches ``pattern`` in full, whose
    ``pid`` group names a process that is gone and, where the pattern has a ``host``
    group, that was made on this host."""
    host = socket.gethostname()
    try:
        entries = list(os.scandir(parent))
    except OSError:  # nothing to tidy where nothing can be listed
        return
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if (found and found.groupdict().get("host", host) == host and entry.is_dir(follow_symlinks=False)
                and not process_alive(int(found["pid"]))):
            shutil.rmtree(entry.path, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    except OverflowError:  # no process has such a number
        return False
    return True
