"""``metrics.jsonl`` logs every interval, each epoch's last partial one included, and its
training time and QPS leave out the time the loop stood still for evaluations and
checkpoints (logged as their own fields)."""

import time

import pytest

from neorec.trainer.checkpoint.checkpointer import Checkpointer
from neorec.trainer.run import loop as loop_module
from neorec.trainer.run.step import StepReport
from neorec.trainer.run.train import train
from tests.trainer.checkpoint.test_resume import Crash
from tests.trainer.run_records import logged, records
from tests.trainer.test_train import _config

EVAL_PAUSE_S = 0.5
CHECKPOINT_PAUSE_S = 0.3


def test_every_interval_is_logged_including_each_epochs_last(criteo_dataset, tmp_path):
    summary = train(_config(criteo_dataset, tmp_path / "run", epochs=2))  # 18 steps an epoch, a line every 5
    records = logged(tmp_path / "run", "train")
    assert [r["step"] for r in records] == [5, 10, 15, 18, 20, 25, 30, 35, 36]
    assert [r["epoch"] for r in records] == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert [r["steps"] for r in records] == [5, 5, 5, 3, 2, 5, 5, 5, 1]
    assert sum(r["samples"] for r in records) == summary["train_samples"] == 36 * 256
    assert sum(r["seconds"] for r in records) == pytest.approx(summary["train_s"])


def test_train_qps_counts_training_time_only(criteo_dataset, tmp_path, monkeypatch):
    evaluate, save = loop_module.evaluate, Checkpointer.save

    def slow_evaluate(*args, **kwargs):
        time.sleep(EVAL_PAUSE_S)
        return evaluate(*args, **kwargs)

    def slow_save(self, *args, **kwargs):
        time.sleep(CHECKPOINT_PAUSE_S)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(loop_module, "evaluate", slow_evaluate)
    monkeypatch.setattr(Checkpointer, "save", slow_save)
    config = _config(criteo_dataset, tmp_path / "run", epochs=1, eval_every=5)
    config.checkpoint.every_steps = 5
    started = time.perf_counter()
    summary = train(config)
    wall = time.perf_counter() - started
    evaluations, checkpoints = 18 // 5 + 1, 18 // 5 + 1  # every 5 steps and at the end
    assert summary["eval_s"] >= evaluations * EVAL_PAUSE_S
    assert summary["checkpoint_stall_s"] >= checkpoints * CHECKPOINT_PAUSE_S
    assert summary["train_s"] + summary["eval_s"] + summary["checkpoint_stall_s"] <= wall
    assert summary["train_qps"] == pytest.approx(summary["train_samples"] / summary["train_s"])
    records = logged(tmp_path / "run", "train")
    # the evaluation and checkpoint after step 5 fall in the interval logged at step 10
    after_pause = next(r for r in records if r["step"] == 10)
    assert after_pause["eval_seconds"] >= EVAL_PAUSE_S and after_pause["checkpoint_seconds"] >= CHECKPOINT_PAUSE_S
    assert sum(r["seconds"] for r in records) == pytest.approx(summary["train_s"])
    assert sum(r["eval_seconds"] for r in records) >= (evaluations - 1) * EVAL_PAUSE_S  # the last is after the log


def test_a_run_resumed_at_an_epochs_end_logs_that_epochs_last_interval(criteo_dataset, tmp_path):
    def crash_after_19(report: StepReport) -> None:
        if report.global_step == 19:
            raise Crash(19)

    whole = _config(criteo_dataset, tmp_path / "whole", epochs=2)
    whole.checkpoint.every_steps = 18  # the epoch's last step: its partial interval (16-18) not yet logged
    train(whole)
    stopped = _config(criteo_dataset, tmp_path / "stopped", epochs=2)
    stopped.checkpoint.every_steps = 18
    with pytest.raises(Crash):
        train(stopped, progress=crash_after_19)
    train(stopped, resume=True)
    assert [r["step"] for r in logged(tmp_path / "stopped", "train")] == [5, 10, 15, 18, 20, 25, 30, 35, 36]
    assert records(tmp_path / "stopped") == records(tmp_path / "whole")
