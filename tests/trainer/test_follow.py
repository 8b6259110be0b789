"""Follow mode in process: progressive validation, order, idle exit, signals, and a run
killed and resumed at random points ending bit for bit as one never stopped."""

import os
import random
import signal
import sys
import time
from dataclasses import replace

import pytest
import torch

from neorec.ingest.partitions import PartitionError, PartitionOrderError, PartitionSchemaError, open_partition
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import partition_name, write_partition
from neorec.trainer.config import ConfigError, TrainConfig
from neorec.trainer.distributed import DistributedContext
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.run.step import StepReport
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.follow_helpers import SPEC, follow_config, partitioned
from tests.trainer.run_records import logged, records
from tests.trainer.spawn import run_ranks
from tests.trainer.test_train import final_state

STEPS = 9
"""Steps per partition: 1,200 rows in batches of 128 (the remainder dropped)."""


class Crash(Exception):
    """Stands for the process dying."""


def crash_at(step: int | None = None, waiting: int | None = None):
    """A progress callback that dies after ``step``, or at the ``waiting``-th report of
    waiting for a partition."""
    waits = [0]

    def progress(report: StepReport) -> None:
        if report.phase == "waiting":
            waits[0] += 1
            if waits[0] == waiting:
                raise Crash("waiting")
        elif report.global_step == step:
            raise Crash(step)
    return progress


def assert_same_run(a, b):
    assert records(a) == records(b)
    x, y = final_state(a), final_state(b)
    assert x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x), [k for k in x if not x[k].equal(y[k])]


def test_following_is_training_each_partition_once_after_evaluating_the_model_on_it(tmp_path):
    data = partitioned(tmp_path / "data", 2)
    config = follow_config(data, tmp_path / "follow")
    summary = train(config)
    assert summary["steps"] == 2 * STEPS and summary["partitions"] == 2 and summary["stopped_by"] == "idle"
    splits = [(r["split"], r.get("partition")) for r in records(tmp_path / "follow") if r["split"] != "train"]
    first, second = partition_name(0), partition_name(1)
    assert splits == [("progressive", first), ("partition", first), ("progressive", second), ("partition", second)]
    with pytest.raises(ConfigError, match=f"it is partitioned; evaluate on a ready partition, e.g. --set "
                                          f"data.eval_split='partitions/{second}'"):
        evaluate_checkpoint(tmp_path / "follow")  # a followed run has no fixed eval split
    (data / "partitions" / "2099-01-01T00").mkdir()  # landing: no marker yet
    not_ready = replace(config, data=replace(config.data, eval_split="partitions/2099-01-01T00", follow=False))
    with pytest.raises(ConfigError, match=f"partition '2099-01-01T00' of {data} does not exist or is not ready .*"
                                          f"e.g. --set data.eval_split='partitions/{second}'"):
        evaluate_checkpoint(tmp_path / "follow", not_ready)
    on_second = replace(config, data=replace(config.data, eval_split=f"partitions/{second}", follow=False))
    assert 0.5 < evaluate_checkpoint(tmp_path / "follow", on_second)["auc"] <= 1
    assert {r["partition"] for r in records(tmp_path / "follow", "train") if r["step"] <= STEPS} == {first}
    progressive = records(tmp_path / "follow", "progressive")
    assert progressive[1]["oracle_auc"] == open_partition(data, second).info["oracle"]["auc"]
    # the progressive evaluations' time is the run's evaluation time (it was left at 0)
    timed = logged(tmp_path / "follow", "progressive")
    assert summary["eval_s"] == pytest.approx(sum(r["rows"] / r["qps"] for r in timed), rel=1e-6)

    # The same as training the first partition as a fixed dataset and evaluating on the second.
    dataset = Dataset.load(data)
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    files = {split: [str(data / f) for f in open_partition(data, name).files]
             for split, name in (("train", first), ("eval", second))}
    Dataset(root=fixed, schema=dataset.schema, splits=files).save()
    raw = follow_config(fixed, tmp_path / "fixed-run").to_dict()
    raw["data"]["follow"] = False
    reference = train(TrainConfig.from_dict(raw))
    assert reference["steps"] == STEPS
    for key in ("auc", "logloss", "ne", "calibration", "rows"):
        assert progressive[1][key] == reference[f"eval_{key}"], key


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow), 2])
def test_killed_and_resumed_at_random_points_it_ends_as_a_run_never_stopped(tmp_path, seed):
    """Partitions 3 and 4 land while the stopped run is down; it picks them up on resume."""
    whole = tmp_path / "whole"
    train(follow_config(partitioned(tmp_path / "all", 4), whole))
    data = partitioned(tmp_path / "data", 2)
    stopped = follow_config(data, tmp_path / "stopped", checkpoint={"every_steps": 4})
    rng = random.Random(seed)
    first = rng.randrange(4, 2 * STEPS)  # after the first checkpoint
    with pytest.raises(Crash):
        train(stopped, progress=crash_at(step=first))
    if seed == 2:  # also die while waiting for the third partition
        with pytest.raises(Crash):
            train(stopped, progress=crash_at(waiting=1), resume=True)
    for index in (2, 3):
        write_partition(SPEC, data, index)
    second = rng.randrange(2 * STEPS + 1, 4 * STEPS)
    with pytest.raises(Crash):
        train(stopped, progress=crash_at(step=second), resume=True)
    summary = train(stopped, resume=True)
    assert summary["partitions"] == 4 and summary["steps"] == 4 * STEPS
    assert_same_run(whole, tmp_path / "stopped")


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_to_resume_from(tmp_path):
    data = partitioned(tmp_path / "data", 2)
    whole = tmp_path / "whole"
    train(follow_config(data, whole))
    config = follow_config(data, tmp_path / "stopped", data={"idle_exit_s": 0.0},
                           checkpoint={"every_steps": 0, "final": False})

    def interrupt(report: StepReport) -> None:
        if report.global_step == 12:
            os.kill(os.getpid(), signal.SIGINT)

    summary = train(config, progress=interrupt)
    assert summary["steps"] == 12 and summary["stopped_by"] == "SIGINT"
    # its eval metrics: the progressive validation of the partition it was training, not the last one finished
    assert (summary["last_partition"], summary["eval_partition"]) == (partition_name(0), partition_name(1))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    summary = train(follow_config(data, tmp_path / "stopped"), resume=True)
    assert summary["steps"] == 2 * STEPS
    assert_same_run(whole, tmp_path / "stopped")


def test_a_partition_whose_files_changed_since_the_checkpoint_inside_it_is_refused_on_resume(tmp_path):
    """Its plan would be another (other rows at the same step): some trained twice, others never."""
    data = partitioned(tmp_path / "data", 2)
    config = follow_config(data, tmp_path / "run", checkpoint={"every_steps": 4})
    with pytest.raises(Crash):
        train(config, progress=crash_at(step=STEPS + 5))  # checkpoint at step 12, 3 steps into partition 1
    directory = data / "partitions" / partition_name(1)
    added = directory / "part-00001.parquet"
    added.write_bytes((data / "partitions" / partition_name(0) / "part-00000.parquet").read_bytes())
    with pytest.raises(PartitionError, match=f"training partition '{partition_name(1)}', and a file of it was added"):
        train(config, resume=True)
    added.unlink()
    assert train(config, resume=True)["partitions"] == 2  # as it was: the resume goes on


def test_following_with_no_periodic_checkpoint_is_warned_of(tmp_path, caplog):
    """Such a run writes a checkpoint only when a signal stops it: a kill loses every
    partition trained, and --resume finds nothing to resume from."""
    data = partitioned(tmp_path / "data", 1)
    with caplog.at_level("WARNING", logger="neorec.trainer.run.follow"):
        train(follow_config(data, tmp_path / "periodic"))
        assert "no periodic checkpoint" not in caplog.text
        train(follow_config(data, tmp_path / "none", checkpoint={"every_steps": 0}))
    assert "no periodic checkpoint" in caplog.text and "checkpoint.every_partitions = 1" in caplog.text


def test_idle_exit_and_a_partition_landing_out_of_order(tmp_path):
    data = partitioned(tmp_path / "data", 0)
    write_partition(SPEC, data, 0)
    write_partition(SPEC, data, 2)
    started = time.monotonic()
    summary = train(follow_config(data, tmp_path / "run", data={"idle_exit_s": 1.0}))
    assert summary["partitions"] == 2 and summary["last_partition"] == partition_name(2)
    assert summary["stopped_by"] == "idle" and time.monotonic() - started >= 1.0
    write_partition(SPEC, data, 1)
    with pytest.raises(PartitionOrderError, match=partition_name(1)):
        train(follow_config(data, tmp_path / "run"), resume=True)


def test_a_partition_changing_the_schema_stops_the_run_naming_it(tmp_path):
    import pyarrow.parquet as pq

    data = partitioned(tmp_path / "data", 1)
    name = write_partition(SPEC, data, 1)
    path = data / "partitions" / name / "part-00000.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["I5"]), path)
    with pytest.raises(PartitionSchemaError, match=f"partition '{name}' changes the dataset's schema"):
        train(follow_config(data, tmp_path / "run"))
    assert [r["partition"] for r in records(tmp_path / "run", "partition")] == [partition_name(0)]


def test_the_embeddings_hear_of_every_partition_end(tmp_path, monkeypatch):
    heard = []
    monkeypatch.setattr(FusedEmbeddingBagCollection, "on_partition_end",
                        lambda self, name: heard.append((name, int(self.optimizer_step))), raising=False)
    train(follow_config(partitioned(tmp_path / "data", 2), tmp_path / "run"))
    assert heard == [(partition_name(0), STEPS), (partition_name(1), 2 * STEPS)]


def test_follow_settings_that_cannot_apply_are_refused(tmp_path):
    data = partitioned(tmp_path / "data", 0)
    with pytest.raises(ConfigError, match="train.eval_every"):
        train(follow_config(data, tmp_path / "a", train={"eval_every": 3}))
    with pytest.raises(ConfigError, match="checkpoint.keep_best"):
        train(follow_config(data, tmp_path / "b", checkpoint={"keep_best": True}))
    with pytest.raises(ConfigError, match="train.max_steps"):
        train(follow_config(data, tmp_path / "c", train={"max_steps": 5}))


def test_store_tables_follow_and_resume_as_tables_in_memory(tmp_path):
    from tests.embedding_store.test_store_runs import final_model

    data = partitioned(tmp_path / "data", 2)
    train(follow_config(data, tmp_path / "memory", embedding_store={"cache_fraction": 0.0}))
    stopped = follow_config(data, tmp_path / "store", embedding_store={"tables": {"t_C1": 0.01, "t_C3": 0.02}})
    with pytest.raises(Crash):
        train(stopped, progress=crash_at(step=STEPS + 3))
    summary = train(stopped, resume=True)
    assert summary["partitions"] == 2 and summary["store"]
    assert records(tmp_path / "memory") == records(tmp_path / "store")
    (tables, dense), (tables_store, dense_store) = (final_model(tmp_path / run, tmp_path / f"{run}-tier")
                                                    for run in ("memory", "store"))
    assert all(torch.equal(a, b) for name in tables for a, b in zip(tables[name], tables_store[name]))
    assert all(torch.equal(dense[k], dense_store[k]) for k in dense)


def test_tensorboard_gets_every_number_of_every_record(tmp_path, monkeypatch):
    from neorec.trainer.run.tensorboard import Board, open_board

    class Writer:
        def __init__(self):
            self.scalars, self.flushes = [], 0

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def flush(self):
            self.flushes += 1

    writer = Writer()
    Board(writer).record({"split": "progressive", "partition": "p", "step": 9, "epoch": 1, "auc": 0.75, "rows": 10,
                          "ok": True})
    assert writer.scalars == [("progressive/auc", 0.75, 9), ("progressive/rows", 10.0, 9)] and writer.flushes == 1
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as when tensorboard is not installed
    with pytest.raises(ConfigError, match=r"neorec\[tensorboard\]"):
        open_board(tmp_path)


def test_a_run_started_before_any_partition_waits_for_the_first(tmp_path):
    import threading

    data = partitioned(tmp_path / "data", 0)
    with pytest.raises(PartitionError, match="no partition .* became ready within data.idle_exit_s"):
        train(follow_config(data, tmp_path / "none"))
    lands = threading.Timer(0.5, write_partition, (SPEC, data, 0))
    lands.start()
    try:
        summary = train(follow_config(data, tmp_path / "run", data={"idle_exit_s": 1.5},
                                      embedding_store={"tables": {"t_C1": 0.01}}))  # its plan samples the partition
    finally:
        lands.join()
    assert summary["partitions"] == 1 and summary["steps"] == STEPS


def _stopped_on_rank_1(rank: int, world: int, data, root) -> str:
    """A two-rank follow run in which only rank 1 gets SIGTERM (after its step 6)."""
    def signal_rank_1(report: StepReport) -> None:
        if rank == 1 and report.global_step == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    config = follow_config(data, root / "run", data={"idle_exit_s": 0.0})
    return train(config, progress=signal_rank_1, context=DistributedContext(rank, world, world, rank))["stopped_by"]


def test_every_rank_names_the_signal_one_rank_got(tmp_path):
    data = partitioned(tmp_path / "data", 2)
    assert run_ranks(_stopped_on_rank_1, 2, data, tmp_path) == ["SIGTERM", "SIGTERM"]  # each rank exits 143
