"""Training with dynamic tables on 2 ranks end to end: each rank keeps its map shards, the
checkpoints keep them per map shard (incrementally), a run stopped with evictions in flight
resumes on 2 ranks bit for bit, and the checkpoints restore into one process."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer import checkpoint
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import DistributedContext
from neorec.trainer.run.build import build_model
from neorec.trainer.run.train import train
from tests.trainer.dynamic.test_dynamic_training import config_for, map_state
from tests.trainer.run_records import records
from tests.trainer.spawn import run_ranks
from tests.trainer.test_train import final_state, untimed

WORLD = 2


@pytest.fixture(scope="module")
def raw_dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """3,000 criteo-profile rows whose ids are raw 64-bit hashes from 20,000 per feature."""
    return generate(SynthSpec(rows=3_000, row_group_rows=500, seed=3, raw_ids=True, id_space=20_000),
                    tmp_path_factory.mktemp("raw"))


def sharded_config(dataset: Dataset, run_dir) -> TrainConfig:
    """Every table dynamic with 2 map shards of 32 slots (the planner places them)."""
    config = config_for(dataset, run_dir, train={"batch_size": 64, "eval_batch_size": 500, "epochs": 2,
                                                 "log_every": 4})
    for dynamic in config.model.dynamic.values():
        dynamic.shards = 2
    return config


def train_on_rank(rank: int, world: int, config: TrainConfig, resume: bool) -> dict:
    """This rank's summary of training (``resume``: continuing) as ``config`` says."""
    return train(config, context=DistributedContext(rank, world, world, rank), resume=resume)


def stopped_after(config: TrainConfig, steps: int) -> TrainConfig:
    """``config`` stopping after ``steps`` without a checkpoint there: what a run killed then
    leaves behind (killing ranks with collectives in flight would test the process group's
    teardown, not the checkpoints)."""
    return replace(config, train=replace(config.train, max_steps=steps),
                   checkpoint=replace(config.checkpoint, final=False))


@pytest.mark.slow
def test_two_ranks_checkpoint_and_resume_on_two_ranks_and_on_one_process(raw_dataset, tmp_path):
    whole = run_ranks(train_on_rank, WORLD, sharded_config(raw_dataset, tmp_path / "whole"), False)[0]
    assert all(c["evicted"] > 0 and c["rejected"] > 0 for c in whole["dynamic"].values())
    stopped = sharded_config(raw_dataset, tmp_path / "stopped")
    run_ranks(train_on_rank, WORLD, stopped_after(stopped, 13), False)  # checkpoints at 5 (full) and 10
    newest = checkpoint.open_checkpoint(tmp_path / "stopped" / "checkpoint").manifest
    assert (newest.step, newest.kind, whole["steps"] > 13) == (10, "incremental", True)
    resumed = run_ranks(train_on_rank, WORLD, stopped, True)[0]
    assert untimed(resumed) == untimed(whole)
    assert records(tmp_path / "stopped") == records(tmp_path / "whole")
    states = map_state(tmp_path / "whole")
    assert len(states) > 1 and set(states[0]) == {f"{t}/{s}" for t in whole["dynamic"] for s in range(2)}
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")  # restored into one process
    assert all(a[k].equal(b[k]) for k in a)

    restorable = checkpoint.open_checkpoint(tmp_path / "whole" / "checkpoint")
    model = build_model(raw_dataset, TrainConfig.from_dict(restorable.manifest.config))
    checkpoint.restore_model(restorable, model)  # one process holds both map shards of every table
    assert model.embeddings.counters() == whole["dynamic"]

    # one more epoch in one process, from the 2-rank run's final checkpoint (another rank count
    # goes on only from an epoch's start: each rank reads its own share of an epoch's rows)
    shutil.copytree(tmp_path / "whole", tmp_path / "alone")
    longer = sharded_config(raw_dataset, tmp_path / "alone")
    longer.train.epochs = 3
    alone = train(longer, resume=True)
    rows = raw_dataset.rows["train"]
    assert whole["steps"] == 2 * (rows // (64 * WORLD)) and alone["steps"] == whole["steps"] + rows // 64
    restarted = map_state(tmp_path / "alone")
    assert restarted[0].keys() == states[0].keys()
    assert all(alone["dynamic"][t]["admitted"] >= whole["dynamic"][t]["admitted"] for t in alone["dynamic"])
