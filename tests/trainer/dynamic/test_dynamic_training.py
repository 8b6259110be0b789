"""Training with dynamic tables end to end: raw 64-bit ids in the data, the map and sketch in
Check-N-Run checkpoints (incremental), exact resume with evictions in flight, counters in
the metrics, the store tier below a dynamic table, map shards that do not fit refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer import checkpoint
from neorec.trainer.checkpoint.restore import load_dense_chain
from neorec.trainer.config import ConfigError, TrainConfig
from neorec.trainer.run.build import build_model
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.checkpoint.test_resume import Crash, crash_after
from tests.trainer.run_records import logged, records
from tests.trainer.test_train import final_state, untimed


@pytest.fixture(scope="module")
def raw_dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """3,000 criteo-profile rows whose ids are raw 64-bit hashes from 20,000 per feature."""
    return generate(SynthSpec(rows=3_000, row_group_rows=500, seed=3, raw_ids=True, id_space=20_000),
                    tmp_path_factory.mktemp("raw"))


def config_for(dataset: Dataset, run_dir, capacity: int = 64, half_life: int = 0, **sections) -> TrainConfig:
    dynamic = {f.table: {"capacity": capacity, "min_count": 2, "ttl": 3, "sketch_width": 1024,
                         "sketch_half_life": half_life} for f in dataset.schema.sparse}
    return TrainConfig.from_dict({
        "data": {"path": str(dataset.root)},
        "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1], "dynamic": dynamic},
        "optimizer": {"sparse": "adam"},
        "train": {"batch_size": 128, "eval_batch_size": 500, "epochs": 2, "log_every": 4},
        "checkpoint": {"every_steps": 5},
        "run": {"dir": str(run_dir)},
        **sections,
    })


def map_state(run_dir) -> list[dict]:
    return [d["incremental"] for d in load_dense_chain(checkpoint.open_checkpoint(run_dir / "checkpoint"))]


@pytest.mark.parametrize("half_life", [0, 4], ids=["lasting-counts", "halving-counts"])
def test_resume_with_evictions_in_flight_is_bit_identical(raw_dataset, tmp_path, half_life):
    """(With a sketch half-life of 4 steps, halvings fall between the checkpoints.)"""
    whole = train(config_for(raw_dataset, tmp_path / "whole", half_life=half_life))
    assert all(c["evicted"] > 0 and c["rejected"] > 0 for c in whole["dynamic"].values())
    stopped = config_for(raw_dataset, tmp_path / "stopped", half_life=half_life)
    with pytest.raises(Crash):
        train(stopped, progress=crash_after(13))  # checkpoints at 5 (full) and 10 (incremental)
    resumed = train(stopped, resume=True)
    assert untimed(resumed) == untimed(whole)
    assert records(tmp_path / "stopped") == records(tmp_path / "whole")
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")
    assert all(a[k].equal(b[k]) for k in a)
    assert len(map_state(tmp_path / "whole")) > 1  # the maps restored from a full checkpoint and increments
    restorable = checkpoint.open_checkpoint(tmp_path / "whole" / "checkpoint")  # as evaluating a checkpoint does
    model = build_model(raw_dataset, TrainConfig.from_dict(restorable.manifest.config))
    checkpoint.restore_model(restorable, model)
    assert model.embeddings.counters() == whole["dynamic"]


def test_the_run_s_own_config_evaluates_its_checkpoint(raw_dataset, tmp_path):
    steps = {"batch_size": 128, "eval_batch_size": 500, "max_steps": 4, "log_every": 4}
    run = config_for(raw_dataset, tmp_path / "run", train=steps)  # shards = 0: the run's world size
    train(run)
    assert evaluate_checkpoint(tmp_path / "run", config=run) == evaluate_checkpoint(tmp_path / "run")
    other = config_for(raw_dataset, tmp_path / "run", train=steps)
    other.model.dynamic["t_C1"] = replace(other.model.dynamic["t_C1"], shards=2)
    with pytest.raises(checkpoint.CheckpointError, match=r"^eval: model.dynamic.t_C1.shards is 2, the checkpoint was made with 1;"):
        evaluate_checkpoint(tmp_path / "run", config=other)


def test_a_corrupt_dense_state_older_in_the_chain_is_named_not_restored(raw_dataset, tmp_path):
    """The id maps are kept incrementally over the chain's dense states: the full
    checkpoint's ``dense.pt`` is read on every restore, and one whose bytes changed (as a
    flipped bit of a map's tensor, which loads as another map) is refused by name."""
    run = config_for(raw_dataset, tmp_path / "run", train={"batch_size": 128, "eval_batch_size": 500,
                                                            "max_steps": 12, "log_every": 4},
                     checkpoint={"every_steps": 5, "final": False})  # 5 (full), 10 (incremental)
    train(run)
    restorable = checkpoint.open_checkpoint(tmp_path / "run" / "checkpoint")
    assert len(restorable.chain) > 1
    full = tmp_path / "run" / "checkpoint" / restorable.chain[0].name / "dense.pt"
    data = bytearray(full.read_bytes())
    data[len(data) // 2] ^= 1  # inside the tensors' bytes: still a loadable file
    full.write_bytes(bytes(data))
    for restore in (lambda: evaluate_checkpoint(tmp_path / "run"), lambda: train(run, resume=True)):
        with pytest.raises(checkpoint.CheckpointError, match=f"^{full} does not match its checksum: corrupt"):
            restore()


def test_same_data_and_seed_give_the_same_map_and_weights(raw_dataset, tmp_path):
    runs = [train(config_for(raw_dataset, tmp_path / f"run{i}", checkpoint={"mode": "full", "every_steps": 0},
                             train={"batch_size": 128, "eval_batch_size": 500, "epochs": 1, "log_every": 4,
                                    "threads": threads}))
            for i, threads in enumerate((1, 2))]
    assert untimed(runs[0]) == untimed(runs[1])
    a, b = map_state(tmp_path / "run0")[-1], map_state(tmp_path / "run1")[-1]
    for table in a:
        for key in ("meta", "live", "stats"):
            assert np.array_equal(a[table]["map"][key], b[table]["map"][key])
        assert np.array_equal(a[table]["sketch"]["values"], b[table]["sketch"]["values"])
    wa, wb = final_state(tmp_path / "run0"), final_state(tmp_path / "run1")
    assert all(wa[k].equal(wb[k]) for k in wa)


def test_counters_are_in_the_metrics(raw_dataset, tmp_path):
    summary = train(config_for(raw_dataset, tmp_path / "run", train={"batch_size": 128, "eval_batch_size": 500,
                                                                     "max_steps": 8, "log_every": 4}))
    train_lines = logged(tmp_path / "run", "train")
    assert [line["step"] for line in train_lines] == [4, 8]
    first, last = train_lines[0]["dynamic"]["t_C1"], train_lines[-1]["dynamic"]["t_C1"]
    assert set(first) == {"admitted", "rejected", "evicted", "live"}
    assert last["admitted"] > first["admitted"] and last == summary["dynamic"]["t_C1"]
    assert last["live"] == min(64, last["admitted"] - last["evicted"])


def test_a_store_backed_dynamic_table_trains_as_in_memory(raw_dataset, tmp_path):
    memory = train(config_for(raw_dataset, tmp_path / "memory", checkpoint={"every_steps": 0}))
    store = train(config_for(raw_dataset, tmp_path / "store", checkpoint={"every_steps": 0},
                             embedding_store={"tables": {"t_C3": 0.5, "t_C4": 0.5}, "ways": 4}))
    assert store["store"]["misses"] > 0 and store["store"]["evictions"] > 0
    del store["store"], store["world_size"]  # (a run with a plan reports its world size)
    assert untimed(memory) == untimed(store)  # the dynamic counters among them
    assert records(tmp_path / "memory") == records(tmp_path / "store")  # every logged loss, bit for bit


def test_raw_ids_need_a_dynamic_table_and_dynamic_tables_need_the_data(raw_dataset, tmp_path):
    config = config_for(raw_dataset, tmp_path / "run")
    del config.model.dynamic["t_C5"]
    with pytest.raises(ConfigError, match=r"feature 'C5' holds raw 64-bit ids.*\[model.dynamic.t_C5\]"):
        train(config)
    config = config_for(raw_dataset, tmp_path / "run")
    config.model.dynamic["t_nope"] = config.model.dynamic["t_C5"]
    with pytest.raises(ConfigError, match="model.dynamic.t_nope: the dataset has no table"):
        train(config)
    with pytest.raises(ConfigError, match=r"model.dynamic.t_C1.capacity: must be a positive"):
        TrainConfig.from_dict({"model": {"dynamic": {"t_C1": {"capacity": 0}}}})
    by_partitions = {"model": {"dynamic": {"t_C1": {"capacity": 8, "ttl": 1, "ttl_unit": "partitions"}}}}
    with pytest.raises(ConfigError, match=r"^model.dynamic.t_C1.ttl_unit: 'partitions' counts .* follows none"):
        TrainConfig.from_dict(by_partitions)  # no id would ever expire
    halving = {"model": {"dynamic": {"t_C1": {"capacity": 8, "min_count": 2, "sketch_half_life": 3,
                                              "ttl_unit": "partitions"}}}}
    with pytest.raises(ConfigError, match=r"follows none, so no admission count would halve"):
        TrainConfig.from_dict(halving)
    TrainConfig.from_dict({**halving, "data": {"follow": True}})
    with pytest.raises(ConfigError, match=r"^checkpoint.every_partitions: counts the partitions"):
        TrainConfig.from_dict({"checkpoint": {"every_partitions": 2}})
    TrainConfig.from_dict({**by_partitions, "data": {"follow": True}, "checkpoint": {"every_partitions": 2}})
    with pytest.raises(ConfigError, match=r"^model.dynamic.t_C1.capacity: 10 rows do not split into 4 equal map "
                                          r"shards \(shards = 4\); make the capacity a multiple of it$"):
        TrainConfig.from_dict({"model": {"dynamic": {"t_C1": {"capacity": 10, "shards": 4}}}})
    with pytest.raises(ConfigError, match=r"^model.dynamic.t_C1.shards: 3 map shards do not split over 2 ranks"):
        TrainConfig.from_dict({"model": {"dynamic": {"t_C1": {"capacity": 9, "shards": 3}}}, "launch": {"nproc": 2}})
    with pytest.raises(ConfigError, match=r"^model.dynamic.t_C1.capacity: 9 rows do not split into 2 equal"):
        TrainConfig.from_dict({"model": {"dynamic": {"t_C1": {"capacity": 9}}}, "launch": {"nproc": 2}})
