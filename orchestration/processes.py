"""Starting service processes on this host: ``neorec ingest serve`` as a child process
that announces the address it bound (port 0 lets the OS choose)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

from neorec.common.abandoned import remove_abandoned
from neorec.common.cpus import available_cpus
from neorec.common.restarts import restart_count
from neorec.common.wording import counted
from neorec.common.errors import ConfigError
from neorec.orchestration.nodes import ONE_NODE, Nodes
from neorec.orchestration.supervisor import PARENT_DEATH_ENV, signal_on_parent_death

log = logging.getLogger(__name__)

_READY = re.compile(r"serving on (\S+)")
RANK_EXITS = "NEOREC_RANK_EXITS"
"""The environment variable naming the directory where each rank torchrun started leaves
its exit status (a file ``rank-R`` holding it), for :func:`run_torchrun` to tell a user's
error, which the rank named, from a failure."""
USER_ERROR = 2
"""The exit status of a user's error: one line naming it (:func:`neorec.orchestration.cli.main`)."""


@dataclass
class ServiceProcess:
    """A running service process and the address it serves on."""

    process: subprocess.Popen
    address: str

    def kill(self) -> None:
        """SIGKILL: the process dies without any cleanup."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for a graceful exit; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode


def start_reader_service(*args: str, host: str = "127.0.0.1", data_roots: Sequence[str] = ()) -> ServiceProcess:
    """Start ``neorec ingest serve`` on a free port of ``host`` and wait until it serves
    datasets under ``data_roots`` (default: its working directory).

    ``args`` are further ``ingest serve`` flags (e.g. ``--worker-threads 2``).
    """
    roots = [a for root in data_roots for a in ("--data-root", str(root))]
    process = subprocess.Popen(
        [sys.executable, "-m", "neorec.orchestration.cli", "ingest", "serve", "--host", host, "--port", "0", *roots, *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = process.stdout.readline()
    match = _READY.search(line)
    if match is None:
        process.kill()
        process.wait()
        raise RuntimeError(f"the reader service did not start (it printed {line!r})")
    return ServiceProcess(process, match.group(1))


def torchrun_command(nproc: int, module: str, args: list[str], nodes: Nodes = ONE_NODE,
                     log_dir: Path | None = None) -> list[str]:
    """The command running ``python -m MODULE ARGS`` as ``nproc`` ranks on this host under
    torchrun (:mod:`~neorec.orchestration.torchrun_main`): this host's share of the job
    ``nodes`` describes (default: the whole job, torchrun's standalone rendezvous on a free
    local port); torchrun's files in ``log_dir`` (default: a ``torchelastic_*`` directory of
    its own, which it leaves behind)."""
    logs = [f"--log-dir={log_dir}"] if log_dir is not None else []
    return [sys.executable, "-m", "neorec.orchestration.torchrun_main", *nodes.torchrun_flags(), *logs,
            f"--nproc-per-node={nproc}", "--module", module, *args]


def record_rank_exit(code: int) -> None:
    """Leave this rank's exit status where :func:`run_torchrun` reads it (nothing outside
    a rank it started)."""
    _leave_word("rank-", str(code))


def _leave_word(prefix: str, text: str) -> None:
    """Write ``text`` to ``PREFIX<rank>`` in the directory of exit statuses (nothing outside
    a rank :func:`run_torchrun` started). A hint: where it cannot be written, the rank's own
    message stands."""
    directory, rank = os.environ.get(RANK_EXITS), os.environ.get("RANK")
    if directory and rank is not None:
        try:
            (Path(directory) / f"{prefix}{int(rank)}").write_text(text)
        except (OSError, ValueError):
            pass


def rank_stopped_by_user_error() -> int | None:
    """In a rank :func:`run_torchrun` started: another rank that stopped with a user's error
    (:func:`record_rank_exit`), whose own line says what it was; None if none did."""
    directory, rank = os.environ.get(RANK_EXITS), os.environ.get("RANK")
    if not directory:
        return None
    return next((other for other, code in sorted(_rank_exits(Path(directory)).items())
                 if str(other) != rank and code == USER_ERROR), None)


LASTING = "lasting-"
"""A file ``lasting-R`` in the directory of exit statuses: rank R stopped with a lasting
error (:attr:`~neorec.common.errors.UserError.lasting`), in the attempt its text numbers."""


def record_lasting_error() -> None:
    """Leave word that this rank stopped with an error that every attempt meets again (a
    config, data, a followed partition never marked ready), for the ranks torchrun's
    ``--max-restarts`` starts next (:func:`earlier_attempt_lasting_error`; nothing outside
    a rank :func:`run_torchrun` started)."""
    _leave_word(LASTING, str(restart_count()))


def earlier_attempt_lasting_error() -> int | None:
    """In a rank :func:`run_torchrun` started again by torchrun's ``--max-restarts``: the
    rank whose lasting error (:func:`record_lasting_error`) ended an earlier attempt on this
    node, which this one would meet again; None if none did. (An attempt is told by the
    agent's count of its own restarts; after a group re-formed for another node's failure
    the count stays, and the ranks start as they would without the word.)"""
    directory = os.environ.get(RANK_EXITS)
    if not directory:
        return None
    attempt = restart_count()
    for path in sorted(Path(directory).glob(f"{LASTING}*")):
        try:
            if int(path.read_text()) < attempt:
                return int(path.name.removeprefix(LASTING))
        except (OSError, ValueError):
            continue
    return None


REFUSAL_SAID = "refused-"
"""A file ``refused-A`` in the directory of exit statuses: this node's local rank 0 has
written its line saying why attempt A is not started again."""
REFUSAL_WAIT_S = 10.0
"""How long the node's other ranks wait for that line before they exit anyway."""


def refusal_said() -> None:
    """In local rank 0 of a refused attempt, once its line is out: leave word for the
    node's other ranks (:func:`await_refusal_said`)."""
    word = _refusal_word()
    if word is not None:
        try:
            word.touch()
        except OSError:
            pass


def await_refusal_said(timeout_s: float = REFUSAL_WAIT_S) -> None:
    """In the other ranks of a refused attempt: wait until local rank 0 has said why
    (:func:`refusal_said`), at most ``timeout_s``. A rank that exited first would have
    torchrun stop the group, local rank 0 with it, maybe before its line was out."""
    word = _refusal_word()
    deadline = time.monotonic() + timeout_s
    while word is not None and not word.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _refusal_word() -> Path | None:
    """This attempt's ``refused-A`` file (None outside a rank :func:`run_torchrun` started)."""
    directory = os.environ.get(RANK_EXITS)
    return Path(directory) / f"{REFUSAL_SAID}{restart_count()}" if directory else None


def _rank_exits(directory: Path) -> dict[int, int]:
    """Rank → the exit status it left in ``directory`` (one cut short by a kill: none)."""
    exits = {}
    for path in directory.glob("rank-*"):
        try:
            text = path.read_text()
        except OSError:
            continue
        if text.isdigit():
            exits[int(path.name.removeprefix("rank-"))] = int(text)
    return exits


_SCRATCH = re.compile(r"neorec-torchrun-(?P<pid>[0-9]+)-[^/]+")
"""The temporary directory of :func:`run_torchrun` (by the PID of the process that made it)."""


def run_torchrun(nproc: int, neorec_args: list[str], nodes: Nodes = ONE_NODE) -> int:
    """Run ``neorec NEOREC_ARGS`` as ``nproc`` ranks on this host under torchrun (this
    node's share of ``nodes``); returns torchrun's exit status (2, a user's error, when a rank
    exited so: torchrun's own is 1 for any failed rank), or 128 + the number of the signal
    (SIGINT, SIGTERM) that stopped it: then the ranks' own statuses are not told apart
    (whether or not a rank failed as it stopped).
    torchrun's files and the ranks' statuses lie in a temporary directory, removed after
    (one left by a process killed outright is removed by the next run on this host)."""
    remove_abandoned(tempfile.gettempdir(), _SCRATCH)
    with tempfile.TemporaryDirectory(prefix=f"neorec-torchrun-{os.getpid()}-") as scratch:
        exits = Path(scratch) / "exits"
        exits.mkdir()
        code = _wait_for_torchrun(nproc, neorec_args, nodes, Path(scratch) / "logs", exits)
        if code != 1:
            return code
        recorded = _rank_exits(exits)
        if USER_ERROR in recorded.values():
            return USER_ERROR
        if len(recorded) < nproc:
            print(f"neorec: {counted(nproc - len(recorded), 'rank')} of this node ended without an exit status: "
                  f"killed by a signal, which torchrun's report above names (SIGKILL is often the kernel's "
                  f"out-of-memory killer); --resume RUN_DIR continues from the newest checkpoint", file=sys.stderr)
        return code


def _wait_for_torchrun(nproc: int, neorec_args: list[str], nodes: Nodes, log_dir: Path, exits: Path) -> int:
    threads = str(max(1, available_cpus() // nproc))  # the ranks share the CPUs this process may use
    command = torchrun_command(nproc, "neorec.orchestration.cli", neorec_args, nodes, log_dir)
    if not nodes.standalone:  # torchrun prints nothing while it waits for the other nodes
        log.info("node %d of %d: meeting the other nodes at %s (job %s); the ranks start once all %d are there",
                 nodes.rank, nodes.count, nodes.rendezvous, nodes.run_id, nodes.count)
    # torchrun stops the ranks when this process dies, even by SIGKILL (SIGTERM reaches it
    # from the kernel), and the ranks die with torchrun: nothing outlives the command.
    # torchrun runs in a session of its own, so that a signal reaches it once, from this
    # process, whoever sent it: a terminal's Ctrl-C (to this process group) and a SIGINT to
    # this process alone (`kill -INT PID`, a supervisor's stop signal) alike
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": threads, RANK_EXITS: str(exits),
                                             PARENT_DEATH_ENV: "1", **nodes.worker_environment()},
                               preexec_fn=partial(signal_on_parent_death, signal.SIGTERM), start_new_session=True)
    # SIGINT and SIGTERM are passed on to torchrun, which passes them on to the ranks: they
    # stop as they choose (following partitions: after a checkpoint), so this process waits
    # for them instead of killing them; stopped by a signal, it exits 128 + its number
    # (130, 143) whatever status torchrun chose.
    stopped_by: list[int] = []

    def pass_on(signum: int, frame) -> None:
        stopped_by.append(signum)
        process.send_signal(signum)

    previous = {kind: signal.signal(kind, pass_on) for kind in (signal.SIGINT, signal.SIGTERM)}
    from neorec.orchestration.job_shape import JobShapeCheck  # (torch: not at the parser's import)

    check = None if nodes.standalone else JobShapeCheck(nodes, nproc, lambda message: process.terminate())
    try:
        if check is not None:
            check.start()
        code = process.wait()
    finally:
        if check is not None:
            check.stop()
        for kind, handler in previous.items():
            signal.signal(kind, handler)
    if check is not None and check.mismatch is not None:
        raise ConfigError(check.mismatch)
    return 128 + stopped_by[0] if stopped_by else code
