"""Several torchrun nodes on this host (c10d rendezvous on loopback), each a separate
``neorec train --nnodes N --node-rank I --rdzv HOST:PORT`` process, against ``--nproc`` on
one node; and the elastic agent restarting a job whose rank was killed."""

import json
import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neorec.ingest.schema import Dataset
from neorec.trainer import checkpoint
from neorec.trainer.checkpoint.layout import complete
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import DistributedContext
from neorec.trainer.planner.from_config import job_plan
from neorec.trainer.run.build import build_model
from tests.ingest.workers import start_worker, stop_all
from tests.orchestration.test_sharded_cli import _rank_processes
from tests.trainer.spawn import _free_port, run_ranks
from tests.trainer.run_records import records
from tests.trainer.test_train import final_state, untimed
from tests.cli import NEOREC, neorec

pytestmark = pytest.mark.usefixtures("demo_kernels")  # deadlines on first steps time training

SHARDED = "{t_C1='row_wise', t_C2='column_wise', t_C3='table_wise', t_C4='data_parallel'}"


def _settings(dataset, run, *extra):
    pairs = [f"data.path='{dataset.root}'", "model.max_table_rows=300", "model.embedding_dim=8",
             "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.batch_size=64",
             "train.eval_batch_size=1000", "train.log_every=2", "checkpoint.every_steps=3", f"run.dir='{run}'",
             *extra]
    return [a for p in pairs for a in ("--set", p)]


def _node_commands(nnodes: int, nproc: int, settings: list[str], *flags: str) -> list[list[str]]:
    endpoint = f"127.0.0.1:{_free_port()}"
    return [[*NEOREC, "train", "configs/demo.toml", "--nproc", str(nproc),
             "--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv", endpoint, *flags, *settings]
            for node in range(nnodes)]


def _run_nodes(commands: list[list[str]], timeout: float = 300) -> None:
    nodes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    try:
        for node in nodes:
            _, stderr = node.communicate(timeout=timeout)
            assert node.returncode == 0, stderr[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()



def assert_same_run(run: Path, reference: Path) -> None:
    """The same plan, summary (timings aside), metrics and final model, bit for bit."""
    assert json.loads((run / "plan.json").read_text()) == json.loads((reference / "plan.json").read_text())
    assert untimed(json.loads((run / "summary.json").read_text())) == \
        untimed(json.loads((reference / "summary.json").read_text()))
    assert records(run) == records(reference)
    a, b = final_state(run), final_state(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_nodes_of_one_rank_train_what_two_ranks_on_one_node_train(criteo_dataset, tmp_path):
    settings = ["train.max_steps=6", f"sharding.tables={SHARDED}"]
    _run_nodes(_node_commands(2, 1, _settings(criteo_dataset, tmp_path / "nodes", *settings)))
    result = neorec("train", "configs/demo.toml", "--nproc", "2", *_settings(criteo_dataset, tmp_path / "one",
                                                                              *settings))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "nodes", tmp_path / "one")


@pytest.mark.slow
def test_two_nodes_of_two_ranks_through_reader_services_train_what_four_ranks_on_one_node_train(
        criteo_dataset, tmp_path):
    """Each node's ranks are its local ranks (``LOCAL_WORLD_SIZE`` 2): the planner's node
    topology, so a table_row_wise group is a node; one node of four ranks told so
    (``sharding.ranks_per_node = 2``) trains the same, reading in process."""
    tables = SHARDED[:-1] + ", t_C5='table_row_wise:1'}"
    settings = ["train.max_steps=4", f"sharding.tables={tables}", "train.threads=1"]
    workers = [start_worker(), start_worker()]
    try:
        ingest = ",".join(w.address for w in workers)
        _run_nodes(_node_commands(2, 2, _settings(criteo_dataset, tmp_path / "nodes", *settings), "--ingest", ingest))
    finally:
        stop_all(workers)
    result = neorec("train", "configs/demo.toml", "--nproc", "4",
                    *_settings(criteo_dataset, tmp_path / "one", *settings, "sharding.ranks_per_node=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "nodes" / "plan.json").read_text())
    assert {t["table"]: t["sharding_type"] for t in plan["tables"]}["t_C5"] == "table_row_wise"
    assert_same_run(tmp_path / "nodes", tmp_path / "one")


@pytest.mark.slow
def test_the_elastic_agent_restarts_a_killed_rank_and_the_run_ends_as_if_uninterrupted(criteo_dataset, tmp_path):
    """Two nodes under ``--max-restarts 1``; rank 1 is SIGKILLed after the first checkpoint.
    Both agents restart their workers, which resume from the newest checkpoint (not refuse
    the run directory) and end where an uninterrupted run ends, bit for bit."""
    settings = ["train.max_steps=15", "checkpoint.mode='full'", f"sharding.tables={SHARDED}"]
    commands = _node_commands(2, 1, _settings(criteo_dataset, tmp_path / "killed", *settings), "--max-restarts", "1")
    nodes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    try:
        checkpoints = tmp_path / "killed" / "checkpoint"
        deadline = time.monotonic() + 240
        while not complete(checkpoints):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes)
            time.sleep(0.05)
        ranks = {}
        for node in nodes:
            ranks.update(_rank_processes(node.pid))
        os.kill(ranks[1], signal.SIGKILL)
        logs = ""
        for node in nodes:
            _, stderr = node.communicate(timeout=300)
            assert node.returncode == 0, stderr[-3000:]
            logs += stderr
        assert "resuming from the newest checkpoint" in logs, logs[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["steps"] == 15
    _run_nodes(_node_commands(2, 1, _settings(criteo_dataset, tmp_path / "whole", *settings)))
    assert_same_run(tmp_path / "killed", tmp_path / "whole")


def _restored(rank: int, world: int, run_config: dict, root: str, ranks_per_node: int, tables: dict) -> dict:
    """Every table (weights, optimizer state) and the MLPs of the checkpoint at ``root``
    restored into ``world`` ranks on nodes of ``ranks_per_node``, as that job plans them
    (``tables``: ``sharding.tables``)."""
    config = TrainConfig.from_dict(run_config)
    config = replace(config, sharding=replace(config.sharding, ranks_per_node=ranks_per_node, tables=tables))
    dataset = Dataset.load(config.data.path)
    context = DistributedContext(rank, world, ranks_per_node, rank % ranks_per_node)
    plan = job_plan(dataset, config, context)
    model = build_model(dataset, config, plan)
    checkpoint.restore_model(checkpoint.open_checkpoint(Path(root)), model)
    tables = {t.name: model.embeddings.gather_table(t.name) for t in model.embeddings.tables}
    return {"tables": tables, "mlps": {**model.bottom.state_dict(), **model.top.state_dict()},
            "plan": plan.to_dict()}


def _assert_restored(restored: dict, run: Path) -> None:
    """``restored`` holds the single-process restore of ``run``'s newest checkpoint."""
    restorable = checkpoint.open_checkpoint(run / "checkpoint")
    config = TrainConfig.from_dict(restorable.manifest.config)
    single = build_model(Dataset.load(config.data.path), config)
    checkpoint.restore_model(restorable, single)
    for name, (weights, states) in restored["tables"].items():
        assert torch.equal(weights, single.embeddings.table_weight(name).float()), name
        assert all(torch.equal(a, b) for a, b in zip(states, single.embeddings.table_state(name))), name
    expected = {**single.bottom.state_dict(), **single.top.state_dict()}
    assert all(torch.equal(restored["mlps"][k], expected[k]) for k in expected)


@pytest.mark.slow
def test_checkpoints_restore_from_two_nodes_of_two_ranks_into_one_node_of_three_and_back(criteo_dataset, tmp_path):
    """A 2 × 2 job's checkpoint restores into 1 × 3 ranks (``--resume --nproc 3``, which
    trains on and writes a 3-rank checkpoint), and that one into 2 × 2: every table and
    optimizer state, and the MLPs, bit for bit (row-wise Adagrad; no column-wise shards,
    whose row-wise state is one value per shard row)."""
    on_nodes = {"t_C1": "row_wise", "t_C2": "table_wise", "t_C3": "data_parallel", "t_C4": "table_row_wise"}
    on_one = {**on_nodes, "t_C4": "row_wise"}  # one node: no groups of nodes to split rows within

    def settings(tables: dict, steps: int) -> list[str]:
        return _settings(criteo_dataset, tmp_path / "run", f"train.max_steps={steps}", "checkpoint.mode='full'",
                         "sharding.tables={" + ", ".join(f"{t}='{k}'" for t, k in tables.items()) + "}",
                         "train.threads=1")

    _run_nodes(_node_commands(2, 2, settings(on_nodes, 0)))  # one whole epoch
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    first = json.loads((run / "summary.json").read_text())["steps"]
    on_three = run_ranks(_restored, 3, config, str(run / "checkpoint"), 3, on_one)
    assert {t["sharding_type"] for t in on_three[0]["plan"]["tables"]} >= {"row_wise", "table_wise"}
    _assert_restored(on_three[0], run)

    # the epoch ended: the resumed run, on another number of ranks, trains on in the next
    result = neorec("train", "configs/demo.toml", "--nproc", "3", "--resume", str(run), *settings(on_one, first + 1),
                    "--set", "train.epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 3
    assert (run / "checkpoint" / "LATEST").read_text().strip() == f"step-{first + 1:09d}"
    on_four = run_ranks(_restored, 4, config, str(run / "checkpoint"), 2, on_nodes)
    assert "table_row_wise" in {t["sharding_type"] for t in on_four[0]["plan"]["tables"]}
    _assert_restored(on_four[0], run)


@pytest.mark.slow
def test_nodes_started_with_different_nnodes_are_refused_on_every_node(criteo_dataset, tmp_path):
    """torchrun's rendezvous takes each node's own count: the node told of three waited for
    a third that never came (until torchrun's timeout), the other with it; a node told of
    fewer nodes than came could run a job of another shape than it planned (as could a
    node of another --nproc)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    commands = [[*NEOREC, "train", "configs/demo.toml", "--nnodes", str(count), "--node-rank", str(rank), "--rdzv",
                 endpoint, *_settings(criteo_dataset, tmp_path / "run")] for rank, count in ((0, 3), (1, 2))]
    nodes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    try:
        outcomes = [(node.communicate(timeout=120)[1], node.returncode) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for stderr, code in outcomes:
        assert code == 2, stderr[-3000:]
        assert stderr.splitlines()[-1].startswith(
            "neorec: error: the nodes of job 'neorec' were started differently: --nnodes "), stderr[-3000:]
