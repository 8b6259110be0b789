"""``neorec train --follow`` as a user runs it: through a reader service, SIGKILLed and
resumed, stopped by SIGTERM, with two ranks."""

import json
import os
import random
import signal
import subprocess
import time

import pytest

from neorec.ingest.partitions import MARKER
from neorec.ingest.synth import write_partition
from neorec.trainer.checkpoint.layout import complete, read_manifest
from neorec.trainer.run.train import train
from tests.ingest.workers import start_worker, stop_all
from tests.trainer.follow_helpers import SPEC, follow_config, partitioned
from tests.trainer.run_records import records
from tests.trainer.test_follow import STEPS, assert_same_run
from tests.cli import NEOREC


def _command(data, run, *more):
    return [*NEOREC, "train", "configs/demo.toml", "--follow",
            "--set", f"data.path='{data}'", "--set", f"run.dir='{run}'", "--set", "train.batch_size=128",
            "--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16, 8]", "--set", "model.top_mlp=[16, 1]",
            "--set", "model.max_table_rows=3000", "--set", "train.log_every=4", "--set", "checkpoint.every_steps=5",
            "--set", "data.poll_interval_s=0.1", "--set", "train.threads=1", *more]


def _wait_for(condition, process, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def _trained(run) -> int:
    path = run / "metrics.jsonl"
    return sum('"split": "partition"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def test_following_through_a_reader_service_is_following_in_process(tmp_path):
    data = partitioned(tmp_path / "data", 2)
    train(follow_config(data, tmp_path / "local"))
    worker = start_worker()
    try:
        summary = train(follow_config(data, tmp_path / "remote", data={"ingest": [worker.address]}))
    finally:
        stop_all([worker])
    assert summary["partitions"] == 2
    assert_same_run(tmp_path / "local", tmp_path / "remote")


@pytest.mark.slow
def test_a_sigkilled_run_reading_through_a_reader_service_resumes_to_the_same_end(tmp_path):
    data = partitioned(tmp_path / "data", 2)
    worker = start_worker()
    try:
        ingest = ("--ingest", worker.address, "--idle-exit", "1")
        whole = subprocess.run(_command(partitioned(tmp_path / "all", 3), tmp_path / "whole", *ingest),
                               capture_output=True, text=True, timeout=600)
        assert whole.returncode == 0, whole.stderr[-3000:]
        killed = tmp_path / "killed"
        process = subprocess.Popen(_command(data, killed, *ingest), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        after = random.Random(7).randrange(5, 2 * STEPS - 1)
        try:
            _wait_for(lambda: (done := complete(killed / "checkpoint")) and read_manifest(done[-1]).step >= after,
                      process, f"a checkpoint past step {after}")
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        write_partition(SPEC, data, 2)  # lands while the trainer is down
        resumed = subprocess.run([*_command(data, killed, *ingest), "--resume", str(killed)],
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        stop_all([worker])
    assert json.loads((killed / "summary.json").read_text())["partitions"] == 3
    assert_same_run(tmp_path / "whole", killed)


def test_idle_behind_a_partition_never_marked_ready_exits_2_naming_it_and_resumes_once_it_is(tmp_path):
    """Ready partitions waiting behind one without its marker are not the end of the data:
    the run stops as idle does (its checkpoint written) but exits 2, naming the partition."""
    data = partitioned(tmp_path / "data", 1)
    held = write_partition(SPEC, data, 1)
    (data / "partitions" / held / MARKER).unlink()
    write_partition(SPEC, data, 2)
    run = tmp_path / "run"
    stopped = subprocess.run([*_command(data, run), "--idle-exit", "0.5"], capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert f"partition {held} was never marked ready" in stopped.stderr and "Traceback" not in stopped.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stopped_by"], summary["blocked_by"], summary["partitions"]) == ("blocked", held, 1)
    (data / "partitions" / held / MARKER).write_text("")
    resumed = subprocess.run([*_command(data, run), "--idle-exit", "0.5", "--resume", str(run)],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stopped_by"], summary["partitions"], summary["steps"]) == ("idle", 3, 3 * STEPS)
    assert "blocked_by" not in summary


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_sigterm_stops_with_a_final_checkpoint_and_the_run_resumes_to_the_same_end(tmp_path, nproc):
    data = partitioned(tmp_path / "data", 2)
    more = ("--nproc", nproc, "--set", "sharding.tables={t_C1='row_wise'}")
    whole = subprocess.run(_command(data, tmp_path / "whole", *more, "--idle-exit", "1"), capture_output=True,
                           text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = tmp_path / "stopped"
    process = subprocess.Popen(_command(data, stopped, *more), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # no idle exit: it follows until stopped
    try:
        _wait_for(lambda: _trained(stopped) >= 1, process, "the first partition trained")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, err[-3000:]  # as a command a signal stopped: not a finished run
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM", err[-3000:]
    assert read_manifest(complete(stopped / "checkpoint")[-1]).step == summary["steps"]
    resumed = subprocess.run([*_command(data, stopped, *more, "--idle-exit", "1"), "--resume", str(stopped)],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["partition"] for r in records(stopped, "partition")] == [r["partition"] for r in
                                                                       records(tmp_path / "whole", "partition")]
    assert_same_run(tmp_path / "whole", stopped)


@pytest.mark.slow
def test_bench_follow_quick_prints_the_follow_and_frozen_curves(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([*NEOREC, "bench", "follow", "--quick", "--json",
                             str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["throughput_ratio"] == report["follow_qps"] / report["fixed_qps"]
    rows = report["per_partition"]
    assert len(rows) == report["partitions"] == 3
    # until the first partition is trained the frozen model is the following one: the same AUC
    assert [r["frozen_auc"] for r in rows[:2]] == [r["follow_auc"] for r in rows[:2]]
    assert rows[2]["frozen_auc"] != rows[2]["follow_auc"] and all(r["lag_s"] >= r["train_s"] for r in rows)
    # the drift floor: the previous partition's teacher on each partition after the first
    assert rows[0]["late_oracle_auc"] is None and all(0.5 < r["late_oracle_auc"] < 1 for r in rows[1:])
    assert "\n".join(report["table"]) in result.stdout


def _trainer_status(run) -> dict:
    done = subprocess.run([*NEOREC, "status", str(run), "--json"],
                          capture_output=True, text=True, timeout=60)
    return next((s["status"] for s in json.loads(done.stdout) if s["role"] == "trainer"), {}) if done.stdout else {}


@pytest.mark.slow
def test_a_launched_job_follows_shows_partition_and_lag_and_stops_on_sigterm_after_a_checkpoint(tmp_path):
    from types import SimpleNamespace

    from tests.orchestration.test_launch import job_file

    data = partitioned(tmp_path / "data", 1)
    job = job_file(tmp_path, SimpleNamespace(root=data), workers=1, data__follow="true",
                   data__poll_interval_s="0.1", train__batch_size="128", train__log_every="4",
                   checkpoint__every_steps="5", model__embedding_dim="8", model__bottom_mlp="[16, 8]",
                   model__top_mlp="[16, 1]")
    run = tmp_path / "run"
    process = subprocess.Popen([*NEOREC, "launch", str(job)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for trained in (1, 2):
            _wait_for(lambda: _trained(run) >= trained, process, f"partition {trained} trained")
            name = records(run, "partition")[-1]["partition"]
            _wait_for(lambda: _trainer_status(run).get("phase") == "waiting", process, "the trainer waiting")
            status = _trainer_status(run)
            assert status["partition"] == name and status["partitionLagSeconds"] > 0
            if trained == 1:
                write_partition(SPEC, data, 1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["partitions"] == 2
    assert read_manifest(complete(run / "checkpoint")[-1]).step == summary["steps"] == 2 * STEPS
    plain = subprocess.run([*_command(data, tmp_path / "plain"), "--idle-exit", "1"], capture_output=True, text=True,
                           timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert records(run) == records(tmp_path / "plain")
