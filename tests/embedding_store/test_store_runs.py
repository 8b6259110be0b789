"""Whole training runs with tables on the embedding store: embedded and through a store
service, one process and two, interrupted and resumed — every table (weights and optimizer
state) and the MLPs end bit-identical to the same run with the tables in memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from neorec.embedding_store.client import StoreClient, StoreServiceError
from neorec.embedding_store.segments import SegmentTier, check_segments, read_segments
from neorec.embedding_store.service import StoreServer
from neorec.ingest.schema import Dataset
from tests.trainer.spawn import run_ranks
from neorec.trainer import checkpoint
from neorec.trainer.run.build import build_model, store_settings
from neorec.trainer.checkpoint import layout
from neorec.trainer.checkpoint.layout import CheckpointError
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import SINGLE_PROCESS, DistributedContext
from neorec.trainer.planner.from_config import job_plan
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, store_of
from neorec.trainer.run.step import StepReport
from neorec.trainer.run.train import train

STORE = {"t_C1": 0.005, "t_C3": 0.02}
"""Caches of 32 and 100 rows (sets of 32), of tables of 5,000 rows: most lookups miss."""


def _config(dataset: Dataset, run_dir: Path, store: dict | None = None, checkpoints: dict | None = None,
            **train) -> TrainConfig:
    return TrainConfig.from_dict({
        "checkpoint": checkpoints or {},
        "data": {"path": str(dataset.root)},
        "model": {"max_table_rows": 5000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32, 1],
                  "weight_dtype": train.pop("weight_dtype", "fp32")},
        "optimizer": {"sparse": train.pop("optimizer", "rowwise_adagrad")},
        "train": {"batch_size": 256, "eval_batch_size": 1000, "log_every": 5, **train},
        "run": {"dir": str(run_dir)},
        "embedding_store": store if store is not None else {"cache_fraction": 0.0},
    })


def final_model(run_dir: Path, tmp: Path) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Every table of a run's newest checkpoint (weights, then optimizer states) and the
    MLPs, restored into one process (store tables through a fresh tier under ``tmp``)."""
    restorable = checkpoint.open_checkpoint(run_dir / "checkpoint")
    saved = restorable.manifest.config
    config = TrainConfig.from_dict({**saved, "embedding_store": {**saved["embedding_store"], "service": ""}})
    dataset = Dataset.load(config.data.path)
    model = build_model(dataset, config, job_plan(dataset, config, SINGLE_PROCESS),
                        store=store_settings(config, tmp, reset=True))
    checkpoint.restore_model(restorable, model)
    embeddings = model.embeddings
    tables = {}
    for t in embeddings.tables:
        weight, states = embeddings.read_rows(t.name, torch.arange(t.num_embeddings))
        tables[t.name] = [weight, *states]
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings")}
    store = store_of(embeddings)
    if store is not None:
        store.close(write_back=False)
    return tables, dense


def assert_same_model(a, b) -> None:
    tables_a, dense_a = a
    tables_b, dense_b = b
    assert tables_a.keys() == tables_b.keys()
    for name in tables_a:
        for x, y in zip(tables_a[name], tables_b[name]):
            assert torch.equal(x, y), name
    assert dense_a.keys() == dense_b.keys()
    for key in dense_a:
        assert torch.equal(dense_a[key], dense_b[key]), key


@pytest.mark.parametrize("optimizer,weight_dtype", [("rowwise_adagrad", "fp32"), ("adam", "bf16")])
def test_a_run_with_tables_on_the_store_equals_the_run_in_memory(criteo_dataset, tmp_path, optimizer, weight_dtype):
    opts = {"epochs": 2, "optimizer": optimizer, "weight_dtype": weight_dtype}
    memory = train(_config(criteo_dataset, tmp_path / "memory", **opts))
    stored = train(_config(criteo_dataset, tmp_path / "store", {"tables": STORE}, **opts))
    assert stored["eval_auc"] == memory["eval_auc"] and stored["eval_logloss"] == memory["eval_logloss"]
    assert_same_model(final_model(tmp_path / "memory", tmp_path / "t1"), final_model(tmp_path / "store", tmp_path / "t2"))
    segments = list((tmp_path / "store" / "store").glob("t_C1@0/*.seg"))
    assert segments  # rows went to the tier
    manifest = checkpoint.open_checkpoint(tmp_path / "store" / "checkpoint").manifest
    assert {e.table for e in manifest.store} == set(STORE)
    assert not {r.table for r in manifest.records} & set(STORE)


def test_a_run_through_a_store_service_equals_the_run_in_memory(criteo_dataset, tmp_path):
    server = StoreServer(tmp_path / "service", data_roots=[tmp_path])  # it snapshots into the run's checkpoints
    server.start()
    try:
        memory = train(_config(criteo_dataset, tmp_path / "memory"))
        stored = train(_config(criteo_dataset, tmp_path / "store", {"tables": STORE, "service": server.address}))
        status = server.servicer.Status(None, None)
    finally:
        server.stop()
    assert stored["eval_auc"] == memory["eval_auc"]
    assert_same_model(final_model(tmp_path / "memory", tmp_path / "t1"), final_model(tmp_path / "store", tmp_path / "t2"))
    assert status.requests > 0 and status.errors == 0
    assert not status.pieces  # the trainer closed its pieces when it ended
    for key in ("t_C1@0", "t_C3@0"):  # the service held their rows
        assert list((tmp_path / "service" / key).glob("*.seg"))


def test_a_store_service_that_cannot_reach_the_run_s_checkpoints_is_refused_before_training(criteo_dataset,
                                                                                            tmp_path):
    """Its snapshots go into the run's checkpoint directory: a service whose data roots do
    not hold it would refuse the first checkpoint, hours into a real run."""
    from neorec.common.errors import ConfigError

    server = StoreServer(tmp_path / "service")  # its own directory only
    server.start()
    try:
        config = _config(criteo_dataset, tmp_path / "run", {"tables": STORE, "service": server.address})
        with pytest.raises(ConfigError, match=rf"its data roots \({tmp_path / 'service'}\) do not hold this run's "
                                              rf"checkpoints \({tmp_path / 'run' / 'checkpoint'}\): start it with "
                                              rf"--data-root {tmp_path / 'run'}"):
            train(config)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        config.checkpoint.every_steps, config.checkpoint.final = 0, False
        assert train(config)["steps"] > 0  # without checkpoints, nothing is snapshot
    finally:
        server.stop()


def test_a_store_service_holds_each_piece_for_one_run(criteo_dataset, tmp_path):
    """A run's pieces are refused to another run while they are open (that run's trainer
    alive, or gone without closing them), and not to a restart of the same run."""
    server = StoreServer(tmp_path / "service", data_roots=[tmp_path])
    server.start()
    client = StoreClient(server.address)
    try:
        first = tmp_path / "first"
        rows = min(criteo_dataset.schema.table_cardinalities()["t_C3"], 5000)  # as the run opens its piece:
        client.open_tier("t_C3@0", rows, (8 + 1) * 4, owner=str(first.absolute()))  # 8 weights, a row-wise state
        store = {"tables": STORE, "service": server.address}
        second = re.escape(str((tmp_path / "second").absolute()))
        with pytest.raises(StoreServiceError, match=f"'t_C3@0' for {second}: it is held by {re.escape(str(first))}"):
            train(_config(criteo_dataset, tmp_path / "second", store, max_steps=5))
        assert [p.key for p in client.status().pieces] == ["t_C3@0"]  # its t_C1@0, opened first, was released
        assert train(_config(criteo_dataset, first, store, max_steps=5))["steps"] == 5  # the same run takes it over
    finally:
        client.close()
        server.stop()


def test_a_resumed_run_replaces_the_tier_by_its_checkpoint(criteo_dataset, tmp_path):
    whole = tmp_path / "whole"
    train(_config(criteo_dataset, whole, {"tables": STORE}, epochs=2))
    cut = tmp_path / "cut"
    # Checkpoints at steps 10 and 20; steps 21-25 reach the tier but no checkpoint.
    train(_config(criteo_dataset, cut, {"tables": STORE}, {"every_steps": 10, "final": False}, epochs=2,
                  max_steps=25))
    assert checkpoint.open_checkpoint(cut / "checkpoint").manifest.step == 20
    resumed = _config(criteo_dataset, cut, {"tables": STORE}, epochs=2)
    train(resumed, resume=True)
    assert_same_model(final_model(whole, tmp_path / "t1"), final_model(cut, tmp_path / "t2"))


def test_a_checkpoint_with_store_tables_is_not_restored_into_memory_tables(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    train(_config(criteo_dataset, run, {"tables": STORE}, max_steps=5))
    with pytest.raises(CheckpointError, match="on the embedding store"):
        train(_config(criteo_dataset, run, max_steps=10), resume=True)


def _train_two_ranks(rank: int, world: int, config: dict) -> None:
    train(TrainConfig.from_dict(config), context=DistributedContext(rank, world, world, rank))


def test_two_ranks_with_row_wise_store_shards_equal_two_ranks_in_memory(criteo_dataset, tmp_path):
    # The same plan for both (left to itself, the planner places the others around the
    # store tables' smaller memory): the runs are then the same computation.
    sharding = {"tables": {**{f"t_C{i}": f"table_wise:{i % 2}" for i in range(2, 27)}, "t_C1": "row_wise"}}
    memory = _config(criteo_dataset, tmp_path / "memory", max_steps=12).to_dict()
    stored = _config(criteo_dataset, tmp_path / "store", {"tables": STORE}, max_steps=12).to_dict()
    for config in (memory, stored):
        config["sharding"] = sharding
        run_ranks(_train_two_ranks, 2, config)
    manifest = checkpoint.open_checkpoint(tmp_path / "store" / "checkpoint").manifest
    assert sorted(e.key for e in manifest.store) == ["t_C1@0", "t_C1@730", "t_C3@0"]  # t_C1: 1,460 rows
    # Restored into one process: the row-wise pieces are merged into one tier.
    assert_same_model(final_model(tmp_path / "memory", tmp_path / "t1"), final_model(tmp_path / "store", tmp_path / "t2"))


def test_a_corrupt_segment_is_named_when_resuming_and_fallback_takes_the_checkpoint_before(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    train(_config(criteo_dataset, run, {"tables": STORE}, {"every_steps": 5}, max_steps=10))
    manifest = checkpoint.open_checkpoint(run / "checkpoint").manifest
    entry = next(e for e in manifest.store if e.files)
    segment = run / "checkpoint" / manifest.name / entry.directory / entry.files[-1].name
    data = bytearray(segment.read_bytes())
    data[-1] ^= 0xFF
    segment.unlink()  # a link: replace the file, not the tier's copy
    segment.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(segment))}: corrupt"):  # the checkpoint's copy
        train(_config(criteo_dataset, run, {"tables": STORE}, max_steps=15), resume=True)
    summary = train(_config(criteo_dataset, run, {"tables": STORE}, {"fallback": True}, max_steps=15), resume=True)
    assert summary["steps"] == 15 and [s["checkpoint"] for s in summary["resume_skipped"]] == [manifest.name]


def test_another_whole_segment_in_a_segment_s_place_is_named_by_verify_and_resume(criteo_dataset, tmp_path):
    """A whole segment of the same rows and size (another run's, another checkpoint's) in a
    segment's place passes every size and checksum of its own, and would restore other
    rows: the manifest's checksums name it."""
    run = tmp_path / "run"
    train(_config(criteo_dataset, run, {"tables": STORE}, {"every_steps": 5}, max_steps=10))
    manifest = checkpoint.open_checkpoint(run / "checkpoint").manifest
    directory = run / "checkpoint" / manifest.name
    entry = next(e for e in manifest.store if e.files)
    segment = directory / entry.directory / entry.files[-1].name
    rows, data = read_segments([segment], entry.row_bytes)
    other = SegmentTier(tmp_path / "other", rows=entry.rows, row_bytes=entry.row_bytes)
    other.write(rows, data[::-1].copy())  # the same rows, their values in another order
    other.flush(sync=True)
    (made,) = (tmp_path / "other").glob("*.seg")
    segment.unlink()  # a link: replace the file, not the tier's copy
    segment.write_bytes(made.read_bytes())
    other.close()
    check_segments([segment], entry.row_bytes)  # whole, as a segment
    expected = f"^{re.escape(str(segment))} is whole but not the segment this checkpoint was taken with"
    with pytest.raises(CheckpointError, match=expected):
        layout.verify(directory, manifest)
    with pytest.raises(CheckpointError, match=expected):
        train(_config(criteo_dataset, run, {"tables": STORE}, max_steps=15), resume=True)


def test_a_damaged_segment_of_the_tier_itself_does_not_stop_a_resume(criteo_dataset, tmp_path):
    """The checkpoint restored replaces the tier: its own segments (a crash may have cut one
    short) are not read."""
    run = tmp_path / "run"
    train(_config(criteo_dataset, run, {"tables": STORE}, {"every_steps": 5, "final": False}, max_steps=8))
    newest = max((run / "store" / "t_C1@0").glob("*.seg"))
    newest.write_bytes(newest.read_bytes()[:-3])
    summary = train(_config(criteo_dataset, run, {"tables": STORE}, max_steps=12), resume=True)
    assert summary["steps"] == 12


class Crash(Exception):
    """Stands for the failure that ends a run."""


def test_a_failed_run_reports_its_failure_not_a_failure_releasing_its_store(criteo_dataset, tmp_path, monkeypatch):
    def broken_close(self, write_back: bool = True) -> None:
        raise StoreServiceError("store service HOST:PORT: Close failed with INTERNAL: gone")

    def crash(report: StepReport) -> None:
        if report.global_step == 3:
            raise Crash("the run's own failure")

    monkeypatch.setattr(StoreBackedEmbeddings, "close", broken_close)
    with pytest.raises(Crash):
        train(_config(criteo_dataset, tmp_path / "run", {"tables": STORE}), progress=crash)
