"""A run stopped mid-way and resumed from its newest checkpoint ends exactly as the run that
was never stopped: weights, optimizer states and metrics, bit for bit."""

import shutil
from dataclasses import asdict, replace

import pytest
import torch.distributed as dist

from tests.trainer.run_records import records
from tests.trainer.spawn import run_ranks
from tests.trainer.test_train import final_state, untimed
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import SINGLE_PROCESS, DistributedContext
from neorec.trainer.run.state import Interval, LoopState
from neorec.trainer.run.step import StepReport
from neorec.trainer.run.train import train


def config_for(dataset, run_dir, **checkpoint) -> TrainConfig:
    return TrainConfig.from_dict({
        "data": {"path": str(dataset.root)},
        "model": {"max_table_rows": 3000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
        "optimizer": {"sparse": "adam", "dense": "adam"},
        "train": {"batch_size": 128, "eval_batch_size": 500, "epochs": 2, "log_every": 4, "eval_every": 7},
        "checkpoint": {"every_steps": 5, **checkpoint},
        "run": {"dir": str(run_dir)},
    })


class Crash(Exception):
    """Stands for the process dying after some step."""


def crash_after(step: int):
    def progress(report: StepReport) -> None:
        if report.global_step == step:
            raise Crash(step)
    return progress


@pytest.mark.parametrize("stop_at", [13, 37])  # mid-epoch (after a checkpoint at 10), in epoch 2
def test_resuming_a_stopped_run_ends_bit_identical(criteo_dataset, tmp_path, stop_at):
    whole = train(config_for(criteo_dataset, tmp_path / "whole"))
    stopped = config_for(criteo_dataset, tmp_path / "stopped")
    with pytest.raises(Crash):
        train(stopped, progress=crash_after(stop_at))
    resumed = train(stopped, resume=True)
    assert untimed(resumed) == untimed(whole)
    assert records(tmp_path / "stopped") == records(tmp_path / "whole")
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]


def test_a_run_resumed_from_its_best_checkpoint_at_an_epoch_end_evaluates_that_epoch_once(criteo_dataset, tmp_path):
    def config(run_dir):
        config = config_for(criteo_dataset, run_dir, every_steps=1000, keep_best=True)
        config.train.eval_every = 0  # evaluations at the epochs' ends only
        return config

    whole = train(config(tmp_path / "whole"))
    with pytest.raises(Crash):  # the newest checkpoint: the best one, after the first epoch's evaluation
        train(config(tmp_path / "stopped"), progress=crash_after(whole["steps"] // 2 + 1))
    resumed = train(config(tmp_path / "stopped"), resume=True)
    assert untimed(resumed) == untimed(whole)
    assert records(tmp_path / "stopped") == records(tmp_path / "whole")
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]


def test_a_run_stopped_by_max_steps_inside_an_epoch_resumes_the_rest_of_that_epoch(criteo_dataset, tmp_path):
    whole = train(config_for(criteo_dataset, tmp_path / "whole"))
    stopped = config_for(criteo_dataset, tmp_path / "stopped")
    first = train(replace(stopped, train=replace(stopped.train, max_steps=13)))
    assert first["steps"] == 13
    resumed = train(stopped, resume=True)  # the limit lifted: the first epoch's last steps, then the second
    assert resumed["steps"] == whole["steps"] and resumed["eval_auc"] == whole["eval_auc"]
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]


def test_resuming_refuses_another_model_and_a_directory_without_a_run(criteo_dataset, tmp_path):
    from neorec.trainer.checkpoint.layout import CheckpointError
    from neorec.trainer.run.run_dir import RunDirError

    config = config_for(criteo_dataset, tmp_path / "run")
    with pytest.raises(Crash):
        train(config, progress=crash_after(6))
    other = config_for(criteo_dataset, tmp_path / "run")
    other.model.embedding_dim = 16
    other.model.bottom_mlp = [16, 16]
    with pytest.raises(CheckpointError, match="model.embedding_dim is 16, the checkpoint was made with 8"):
        train(other, resume=True)
    with pytest.raises(RunDirError, match="holds no run to resume"):
        train(config_for(criteo_dataset, tmp_path / "empty"), resume=True)
    following = config_for(criteo_dataset, tmp_path / "run")
    following.data.follow, following.train.eval_every = True, 0
    with pytest.raises(CheckpointError, match="data.follow is True, the checkpoint was made with False"):
        train(following, resume=True)


def test_resuming_refuses_a_dataset_written_again_at_the_same_path(criteo_dataset, tmp_path):
    """The path is the same, the rows are not: the resumed run would go on with other data."""
    from neorec.trainer.checkpoint.layout import CheckpointError

    data = tmp_path / "data"
    shutil.copytree(criteo_dataset.root, data)
    config = config_for(Dataset.load(data), tmp_path / "run")
    with pytest.raises(Crash):
        train(config, progress=crash_after(6))
    other = generate(SynthSpec(rows=6_000, row_group_rows=700, file_rows=2_100, seed=4), tmp_path / "other")
    rewritten = other.splits["train"][1]
    assert rewritten == Dataset.load(data).splits["train"][1]  # same name, same rows, other values
    shutil.copy(other.root / rewritten, data / rewritten)
    with pytest.raises(CheckpointError, match=rf"--resume: {data / rewritten} was rewritten since the run that made "
                                              "checkpoint step-0+5 began"):
        train(config, resume=True)
    shutil.copy(criteo_dataset.root / rewritten, data / rewritten)  # the same file again: the run goes on
    assert train(config, resume=True)["steps"] == 2 * (criteo_dataset.rows["train"] // 128)


def test_evaluating_a_checkpoint_on_a_dataset_written_again_at_the_same_path_warns(criteo_dataset, tmp_path,
                                                                                   caplog):
    """The metrics would be of the model on other data: said, naming the file (it was
    silent), and not said for the run's own data."""
    from neorec.trainer.run.train import evaluate_checkpoint

    data = tmp_path / "data"
    shutil.copytree(criteo_dataset.root, data)
    config = config_for(Dataset.load(data), tmp_path / "run")
    with pytest.raises(Crash):
        train(config, progress=crash_after(6))
    with caplog.at_level("WARNING", logger="neorec.trainer.run.train"):
        evaluate_checkpoint(tmp_path / "run")
        assert "was rewritten" not in caplog.text
        other = generate(SynthSpec(rows=6_000, row_group_rows=700, file_rows=2_100, seed=4), tmp_path / "other")
        rewritten = other.splits["eval"][0]
        assert rewritten == Dataset.load(data).splits["eval"][0]
        shutil.copy(other.root / rewritten, data / rewritten)
        evaluate_checkpoint(tmp_path / "run")
    assert f"{data / rewritten} was rewritten since the run that made checkpoint step-" in caplog.text


def test_data_imported_again_with_other_vocabularies_is_named_before_the_tables_are(tmp_path, caplog):
    """Converted again from other days, the dataset has other vocabularies, hence other
    table sizes: resuming names the rewritten file (not a table the model sizes otherwise),
    and evaluating warns of it before restoring refuses the tables."""
    from neorec.ingest.importer import import_dataset
    from neorec.ingest.presets import preset
    from neorec.trainer.checkpoint.layout import CheckpointError
    from neorec.trainer.run.train import evaluate_checkpoint
    from tests.ingest.test_presets import criteo_line, write_criteo

    def convert(days: range, values: int) -> Dataset:
        lines = [criteo_line(str(n % 2), [str(n)] * 13, [f"{(n % values) + k:08x}" for k in range(26)])
                 for n in range(300)]
        spec, source = preset("criteo", [str(write_criteo(tmp_path / f"day_{d}", lines)) for d in days])
        shutil.rmtree(tmp_path / "data", ignore_errors=True)
        return import_dataset(spec, tmp_path / "data", source=source, profile="criteo")

    config = config_for(convert(range(2), 50), tmp_path / "run")
    config.train.batch_size = 32
    with pytest.raises(Crash):
        train(config, progress=crash_after(6))
    convert(range(2), 200)  # more distinct values: larger tables
    with pytest.raises(CheckpointError, match=rf"--resume: {tmp_path / 'data'}/\S+ was rewritten since"):
        train(config, resume=True)
    with caplog.at_level("WARNING", logger="neorec.trainer.run.train"), pytest.raises(CheckpointError):
        evaluate_checkpoint(tmp_path / "run")
    assert "was rewritten since the run that made checkpoint" in caplog.text


def _interval_across_a_checkpoint(rank: int, world: int) -> dict:
    """Rank-distinct loss shares: steps 1-2, a checkpoint (rank 0's state is what it keeps),
    a restore, steps 3-4, the log line; and the same four steps uninterrupted."""
    context = DistributedContext(rank, world, world, rank)
    shares = [0.1 * (rank + 1) + 0.01 * step for step in range(4)]
    whole = Interval(context, LoopState())
    for share in shares:
        whole.add(share, 64 + rank)
    before = Interval(context, LoopState())
    for share in shares[:2]:
        before.add(share, 64 + rank)
    before.store()
    kept = [asdict(before.state) if rank == 0 else None]
    dist.broadcast_object_list(kept)
    restored = LoopState(**kept[0])
    Interval.resume(restored, context)
    after = Interval(context, restored)
    for share in shares[2:]:
        after.add(share, 64 + rank)
    return {"whole": whole.close(False)[0], "resumed": after.close(False)[0]}


def test_a_log_interval_cut_by_a_checkpoint_resumes_each_rank_s_own_share():
    for result in run_ranks(_interval_across_a_checkpoint, 2):
        assert result["resumed"]["loss"] == result["whole"]["loss"]
        assert result["resumed"]["samples"] == result["whole"]["samples"] == 4 * (64 + 65)


def test_a_cut_interval_resumed_on_fewer_ranks_goes_to_rank_0():
    state = LoopState(interval_loss_shares=0.5, interval_samples=64, interval_by_rank=[0.5, 0.25, 64.0, 60.0])
    Interval.resume(state, SINGLE_PROCESS)
    assert (state.interval_loss_shares, state.interval_samples) == (0.75, 124)


def _manifest(world_size: int, step_in_epoch: int):
    from neorec.trainer.checkpoint.layout import Manifest

    return Manifest(name="step-000000030", step=30, epoch=0, step_in_epoch=step_in_epoch, kind="full",
                    chain=["step-000000030"], bits=32, world_size=world_size, config={}, plan=None, tables={},
                    files=[], records=[], sparse_steps=30)


def test_another_rank_count_resumes_only_from_an_epoch_s_start():
    """Each rank reads its own share of an epoch: inside an epoch, another rank count
    would train some rows twice and others never."""
    from neorec.trainer.checkpoint.checkpointer import check_position_carries_over
    from neorec.trainer.checkpoint.layout import CheckpointError

    check_position_carries_over(_manifest(1, 30), 1)
    check_position_carries_over(_manifest(2, 0), 1)
    with pytest.raises(CheckpointError, match="made by 1 rank, 30 steps into its epoch .* this run has 2"):
        check_position_carries_over(_manifest(1, 30), 2)
