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
_STOP_POLL_S = 0.02


def die_with_parent() -> None:
    """If this process was started by a launcher (:data:`PARENT_DEATH_ENV`), have the kernel
    SIGKILL it when its parent exits (Linux; elsewhere nothing happens)."""
    if os.environ.get(PARENT_DEATH_ENV):
        signal_on_parent_death(signal.SIGKILL)


def signal_on_parent_death(kind: signal.Signals) -> None:
    """Have the kernel send this process ``kind`` when its parent exits (Linux; elsewhere
    nothing happens); if the parent is gone already, exit at once. Also what a child runs
    between fork and exec (``preexec_fn``), the request surviving the exec."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, kind, 0, 0, 0)
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
        """None while it runs; its exit status (negative: killed by that signal) once it ended.

        The process is not reaped here (only :meth:`stop` reaps it): until then its PID and
        process group ID stay its own, so signalling them cannot reach a process that
        reused the number."""
        if self.process is None:
            return None
        if self.process.returncode is not None:
            return self.process.returncode
        info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def stop(self, grace_s: float) -> None:
        """SIGTERM (SIGCONT too, so a stopped process can act on it), ``grace_s`` to exit,
        then SIGKILL of whatever is left of its tree; then reap it. Only processes it still
        owns are signalled: its group while it is unreaped, its descendants through pidfds
        opened while they were its descendants; a process already reaped is left alone."""
        if self.process is None or self.process.returncode is not None:
            return
        tree = owned_descendants(self.process.pid)
        try:
            if self.exit_code() is None:
                self._signal(signal.SIGTERM, tree)
                self._signal(signal.SIGCONT, tree)
                deadline = time.monotonic() + grace_s
                while self.exit_code() is None and time.monotonic() < deadline:
                    time.sleep(_STOP_POLL_S)
            tree += owned_descendants(self.process.pid)  # those it started since
            self._signal(signal.SIGKILL, tree)
        finally:
            for descendant in tree:
                os.close(descendant)
        self.process.wait()
        if self._pump is not None:
            self._pump.join(timeout=2)

    def _signal(self, sig: int, tree: list[int]) -> None:
        """Send ``sig`` to its process group (it leads it; unreaped, so the group ID is its
        own) and to the descendants of ``tree`` (pidfds; some, like torchrun's ranks,
        start sessions of their own)."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for descendant in tree:
            try:
                signal.pidfd_send_signal(descendant, sig)
            except ProcessLookupError:
                pass


def owned_descendants(pid: int) -> list[int]:
    """Pidfds of every living process descended from ``pid``, a child of this process not
    yet reaped (Linux ``/proc``; elsewhere none). A PID read from ``/proc`` may be reused
    before its pidfd opens, so each is kept only if, once open, its process still has a
    parent in the tree: the pidfd then names that very process for good."""
    found = descendants(pid)
    tree = {pid, *found}
    fds = []
    for child in found:
        try:
            fd = os.pidfd_open(child)
        except (ProcessLookupError, OSError):
            continue
        if _parent(child) in tree:
            fds.append(fd)
        else:
            os.close(fd)
    return fds


def _parent(pid: int) -> int | None:
    """The parent PID of ``pid`` (None once it is gone)."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every living process descended from ``pid`` (Linux ``/proc``; elsewhere none)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        parent = _parent(int(entry.name))
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
