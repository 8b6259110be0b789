"""Processes of a job on this host, watched: started in their own process groups, their
output prefixed with their role and index (and kept in the run directory), their exits
noticed within a tick, and the whole tree of each stopped without leaving an orphan (their
health is probed with :class:`neorec.common.health.HealthProbe`).

:class:`ManagedProcess` is one process (and everything it starts).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

log = logging.getLogger(__name__)

PARENT_DEATH_ENV = "NEOREC_DIE_WITH_PARENT"
"""Set for the processes a launcher starts: each asks the kernel to kill it when its parent
dies (so that a launcher killed with SIGKILL leaves no orphan), and passes that on."""
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """If this process was started by a launcher (:data:`PARENT_DEATH_ENV`), have the kernel
    SIGKILL it when its parent exits (Linux; elsewhere nothing happens)."""
    parent = os.environ.get(PARENT_DEATH_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


class ManagedProcess:
    """One process of a job: its command, its log (prefixed lines to ``echo`` and to
    ``log_path``) and its process tree."""

    def __init__(self, role: str, index: int, command: Sequence[str], log_path: Path, echo: IO[str],
                 env: dict[str, str] | None = None) -> None:
        self.role = role
        self.index = index
        self.name = f"{role}-{index}"
        self.command = list(command)
        self.log_path = log_path
        self.echo = echo
        self.env = {**os.environ, **(env or {}), PARENT_DEATH_ENV: "1", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.starts = 0
        self.last_lines: list[str] = []
        """The last lines it wrote (for the error of a failed job)."""
        self._pump: threading.Thread | None = None
        self._echo_lock = threading.Lock()

    def start(self, extra_args: Sequence[str] = ()) -> None:
        """Start the command (with ``extra_args``) in a new session; its output is pumped to the
        log in a thread."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen([*self.command, *extra_args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                        start_new_session=True, text=True, errors="replace")
        self.started_at = time.monotonic()
        self.starts += 1
        self._pump = threading.Thread(target=self._copy_output, args=(self.process,), daemon=True,
                                      name=f"log-{self.name}")
        self._pump.start()

    def _copy_output(self, process: subprocess.Popen) -> None:
        prefix = f"[{self.name}] "
        with open(self.log_path, "a") as log_file:
            for line in process.stdout:
                with self._echo_lock:
                    self.echo.write(prefix + line)
                    self.echo.flush()
                log_file.write(line)
                log_file.flush()
                self.last_lines = (self.last_lines + [line.rstrip()])[-20:]

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        """None while it runs; its exit status (negative: killed by that signal) once it ended."""
        return None if self.process is None else self.process.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group and to every process descended from it (some,
        like torchrun's ranks, start sessions of their own)."""
        if self.process is None:
            return
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float) -> None:
        """SIGTERM (SIGCONT too, so a stopped process can act on it), ``grace_s`` to exit,
        then SIGKILL of whatever is left of its tree."""
        if self.process is None:
            return
        tree = [self.process.pid, *descendants(self.process.pid)]
        if self.exit_code() is None:
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        for pid in [*tree, *descendants(self.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        if self._pump is not None:
            self._pump.join(timeout=2)


def descendants(pid: int) -> list[int]:
    """Every living process descended from ``pid`` (Linux ``/proc``; elsewhere none)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
