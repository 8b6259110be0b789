"""``neorec train --resume`` after the run was SIGKILLed: the resumed run ends with the
weights, optimizer states and metrics of the run that was never killed, in process,
through a reader service, and with two ranks."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.ingest.workers import start_worker, stop_all
from tests.trainer.run_records import records
from tests.trainer.test_train import final_state, untimed
from neorec.trainer.checkpoint.layout import complete, read_manifest
from tests.cli import NEOREC

pytestmark = pytest.mark.usefixtures("demo_kernels")  # deadlines on first steps time training


def _command(dataset, run, *more):
    return [*NEOREC, "train", "configs/demo.toml",
            "--set", f"data.path='{dataset.root}'", "--set", f"run.dir='{run}'", "--set", "train.batch_size=64",
            "--set", "model.max_table_rows=3000", "--set", "train.epochs=4", "--set", "train.log_every=10",
            "--set", "checkpoint.every_steps=7", *more]  # mostly between log lines: a cut interval resumes


def _kill_after_a_checkpoint(command, run, after_step: int) -> None:
    """Start ``command`` and SIGKILL it, all its processes, right after it has committed a
    checkpoint past ``after_step``."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while True:
            done = complete(run / "checkpoint")
            if done and read_manifest(done[-1]).step > after_step:
                break
            assert process.poll() is None, f"the run ended before it was killed: {process.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _same_run(whole, resumed) -> None:
    assert untimed(json.loads((resumed / "summary.json").read_text())) == \
        untimed(json.loads((whole / "summary.json").read_text()))
    assert records(resumed) == records(whole)
    a, b = final_state(whole), final_state(resumed)
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]


def _kill_and_resume(dataset, tmp_path, *more):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = subprocess.run(_command(dataset, whole, *more), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    _kill_after_a_checkpoint(_command(dataset, killed, *more), killed, after_step=40)
    result = subprocess.run([*_command(dataset, killed, *more), "--resume", str(killed)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    _same_run(whole, killed)


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_a_sigkilled_run_resumes_to_the_same_end(criteo_dataset, tmp_path):
    _kill_and_resume(criteo_dataset, tmp_path)


@pytest.mark.slow
def test_a_sigkilled_run_reading_through_a_reader_service_resumes_to_the_same_end(criteo_dataset, tmp_path):
    worker = start_worker()
    try:
        _kill_and_resume(criteo_dataset, tmp_path, "--ingest", worker.address)
    finally:
        stop_all([worker])


@pytest.mark.slow
def test_a_sigkilled_two_rank_run_resumes_to_the_same_end(criteo_dataset, tmp_path):
    _kill_and_resume(criteo_dataset, tmp_path, "--nproc", "2", "--set", "sharding.tables={t_C1='row_wise'}")
