"""Ctrl-C (SIGINT to the process group, as a terminal sends it) stops ``neorec train`` with
exit status 130 within 5 s in every mode, leaving no process, no thread (the processes are
gone) and no listening port behind: in process, through a reader service (stopped, so
that a stream waits), as 2 ranks, with store tables, during checkpoint writes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neorec.orchestration.supervisor import descendants
from neorec.trainer.run.run_dir import METRICS
from tests.ingest.workers import start_worker
from tests.orchestration.processes import alive
from tests.cli import NEOREC

pytestmark = pytest.mark.usefixtures("demo_kernels")  # deadlines on first steps time training

EXIT_WITHIN_S = 10.0
"""Seconds a stopped command may take to exit: its ranks' teardown on a loaded 2-core host took
6 s; one that ignored the signal would run for minutes."""


def _train(dataset, run_dir: Path, *args: str) -> subprocess.Popen:
    """``neorec train`` of a long run, in a session of its own (its process group is what
    a terminal's Ctrl-C reaches)."""
    command = [*NEOREC, "train", "configs/demo.toml", "--set", f"data.path='{dataset.root}'",
               "--set", f"run.dir='{run_dir}'", "--set", "train.epochs=500", "--set", "train.batch_size=128",
               "--set", "model.max_table_rows=5000", "--set", "train.log_every=1", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _await_training(process: subprocess.Popen, run_dir: Path, lines: int = 3) -> None:
    deadline = time.monotonic() + 180
    metrics = run_dir / METRICS
    while not metrics.exists() or len(metrics.read_text().splitlines()) < lines:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"training did not start: {process.communicate()[1][-2000:]}")
        time.sleep(0.1)


def _await_stall(run_dir: Path, quiet_s: float = 2.0) -> None:
    """Until no step was logged for ``quiet_s``."""
    metrics, deadline = run_dir / METRICS, time.monotonic() + 120
    size, since = -1, time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "training did not stall"
        if metrics.stat().st_size != size:
            size, since = metrics.stat().st_size, time.monotonic()
        time.sleep(0.1)


def _listening_ports(pids: list[int]) -> set[int]:
    """TCP ports listened on by the processes ``pids`` (Linux ``/proc``)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return {port for port, inode in _listening() if inode in inodes}


def _listening() -> list[tuple[int, str]]:
    """(port, socket inode) of every listening TCP socket of this host's network namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found.append((int(fields[1].rsplit(":", 1)[1], 16), fields[9]))
    return found


def _interrupt(process: subprocess.Popen, to_group: bool = True) -> str:
    """SIGINT to the process group (or, ``to_group=False``, to the command's process alone);
    asserts exit 130 within :data:`EXIT_WITHIN_S`, no traceback (torchrun's own included,
    under ``--nproc``), and that nothing it started or listened on is left; returns its
    stderr."""
    tree = [process.pid, *descendants(process.pid)]
    ports = _listening_ports(tree)
    sent = time.monotonic()
    if to_group:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    took = time.monotonic() - sent
    stderr = process.stderr.read()
    assert process.returncode == 130, stderr[-3000:]
    assert took < EXIT_WITHIN_S, f"exit took {took:.1f} s"
    time.sleep(0.2)  # the ranks' last exits
    left = [pid for pid in tree[1:] if alive(pid)]
    assert not left, left
    with pytest.raises(ProcessLookupError):  # nothing left in its process group
        os.killpg(process.pid, 0)
    still = ports & {port for port, _ in _listening()}
    assert not still, f"ports {still} still listened on"
    assert "Traceback" not in stderr, stderr[-3000:]
    return stderr



def test_in_process(criteo_dataset, tmp_path):
    process = _train(criteo_dataset, tmp_path / "run")
    _await_training(process, tmp_path / "run")
    assert "neorec: interrupted" in _interrupt(process)


def test_while_loading_its_modules(criteo_dataset, tmp_path):
    """Ctrl-C as soon as torch's library is mapped: ``neorec train`` is still importing
    what its command needs, and says it was interrupted (no traceback)."""
    process = _train(criteo_dataset, tmp_path / "run")
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + 60
    while "libtorch" not in maps.read_text():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.002)
    assert "neorec: interrupted" in _interrupt(process)
    assert not (tmp_path / "run" / METRICS).exists()


def test_through_a_reader_service_that_stopped_sending(criteo_dataset, tmp_path):
    """A stopped service sends nothing: the background batch thread waits in its stream (no
    stall or progress timeout near) and the exit must not wait on it (the order of the closes
    is tested in tests/trainer/test_interrupted_run.py)."""
    worker = start_worker()
    try:
        process = _train(criteo_dataset, tmp_path / "run", "--ingest", worker.address,
                         "--set", "data.ingest_progress_timeout_s=100", "--set", "data.ingest_stall_timeout_s=100")
        _await_training(process, tmp_path / "run")
        worker.process.send_signal(signal.SIGSTOP)
        _await_stall(tmp_path / "run")  # the batches in flight are used up: the reader waits on the service
        _interrupt(process)
        worker.process.send_signal(signal.SIGCONT)
        assert worker.process.poll() is None  # the service outlives the trainer, unharmed
    finally:
        worker.process.send_signal(signal.SIGCONT)
        worker.stop()


def test_with_store_tables(criteo_dataset, tmp_path):
    process = _train(criteo_dataset, tmp_path / "run", "--set", "embedding_store.tables={t_C1 = 0.01, t_C3 = 0.02}")
    _await_training(process, tmp_path / "run")
    _interrupt(process)


def test_during_checkpoint_writes(criteo_dataset, tmp_path):
    """A checkpoint every step, synchronous and full: most of the time is spent writing one."""
    process = _train(criteo_dataset, tmp_path / "run", "--set", "checkpoint.every_steps=1",
                     "--set", "checkpoint.async=false", "--set", "checkpoint.mode='full'",
                     "--set", "model.max_table_rows=40000")
    _await_training(process, tmp_path / "run")
    _interrupt(process)
    inspected = subprocess.run([*NEOREC, "checkpoint", "inspect", "--verify",
                                str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr  # what committed is whole


@pytest.mark.slow
def test_two_ranks(criteo_dataset, tmp_path):
    process = _train(criteo_dataset, tmp_path / "run", "--nproc", "2")
    _await_training(process, tmp_path / "run")
    _interrupt(process)


@pytest.mark.slow
def test_two_ranks_when_the_command_alone_is_interrupted(criteo_dataset, tmp_path):
    """``kill -INT PID`` (or a supervisor's stop signal to its main process) stops the
    ranks as Ctrl-C does: it used to be ignored until training ended, then reported 130."""
    process = _train(criteo_dataset, tmp_path / "run", "--nproc", "2")
    _await_training(process, tmp_path / "run")
    _interrupt(process, to_group=False)


@pytest.mark.slow  # torch's import and a rendezvous wait, ~10 s
def test_torchrun_stopped_at_its_rendezvous_ends_in_one_line():
    """SIGINT before torchrun's own signal handlers are in place (waiting for a second node
    that never comes): one line and 130, not a KeyboardInterrupt traceback."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "neorec.orchestration.torchrun_main", "--nnodes=2",
                                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                "--module", "json.tool"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)
        assert process.poll() is None, process.stderr.read()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert "torchrun: stopped on SIGINT before the ranks started" in stderr
