"""The launcher's supervisor signals only processes it still owns: a child it has reaped (whose
PID the OS may have given to another process) is never signalled, nor a PID that stopped
being one of its descendants; its whole tree still stops."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from neorec.orchestration import supervisor
from neorec.orchestration.supervisor import ManagedProcess
from tests.orchestration.processes import alive


def _managed(tmp_path, code: str) -> ManagedProcess:
    return ManagedProcess("test", 0, [sys.executable, "-c", code], tmp_path / "test.log", io.StringIO())



def _wait_for_exit(process: ManagedProcess) -> int:
    deadline = time.monotonic() + 30
    while (code := process.exit_code()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return code


@pytest.fixture
def signals_sent(monkeypatch):
    sent = []
    for module, name in ((os, "kill"), (os, "killpg"), (signal, "pidfd_send_signal")):
        real = getattr(module, name)

        def record(target, sig, *rest, _real=real, _name=name):
            sent.append((_name, target, sig))
            return _real(target, sig, *rest)
        monkeypatch.setattr(module, name, record)
    return sent


def test_an_exited_child_stays_unreaped_until_stopped_and_is_never_signalled_after(tmp_path, signals_sent):
    process = _managed(tmp_path, "raise SystemExit(3)")
    process.start()
    pid = process.pid
    assert _wait_for_exit(process) == 3
    # noticed, not reaped: its PID (and group ID) cannot be reused while the launcher decides
    assert os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    process.stop(grace_s=0.0)
    with pytest.raises(ChildProcessError):  # reaped now
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    assert process.exit_code() == 3
    signals_sent.clear()
    process.stop(grace_s=0.0)  # e.g. the launcher's final stop of a trainer that finished
    assert signals_sent == []


def test_a_pid_that_is_no_longer_a_descendant_is_not_signalled(tmp_path, monkeypatch):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    real = supervisor.descendants
    # /proc was read as the PID changed hands: the stranger now holds a number seen in the tree
    monkeypatch.setattr(supervisor, "descendants", lambda pid: [*real(pid), stranger.pid])
    try:
        process = _managed(tmp_path, "import time; time.sleep(120)")
        process.start()
        process.stop(grace_s=5.0)
        assert process.exit_code() == -signal.SIGTERM
        assert stranger.poll() is None and alive(stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()


def test_stop_ends_the_whole_tree_a_descendant_in_its_own_session_included(tmp_path):
    process = _managed(tmp_path, "import subprocess, sys, time\n"
                                 "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], "
                                 "start_new_session=True)\n"
                                 "print(child.pid, flush=True)\n"
                                 "time.sleep(120)\n")
    process.start()
    deadline = time.monotonic() + 30
    while not process.last_lines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    grandchild = int(process.last_lines[0])
    assert alive(grandchild)
    process.stop(grace_s=0.5)  # the grandchild ignores SIGTERM: SIGKILLed after the grace
    deadline = time.monotonic() + 10
    while alive(grandchild):
        assert time.monotonic() < deadline
        time.sleep(0.02)
