"""``neorec plan`` and ``neorec train --nproc`` as a user runs them."""

import json

import torch

from tests.orchestration.test_cli import _neorec
from trainer import checkpoint


def test_train_with_two_processes_writes_a_single_process_checkpoint(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    settings = ["--set", f"data.path='{criteo_dataset.root}'", "--set", "model.max_table_rows=2000",
                "--set", "train.batch_size=128", "--set", "sharding.tables={t_C1='row_wise'}"]
    result = _neorec("train", "configs/demo.toml", "--nproc", "2", "--set", f"run.dir='{run}'", *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("eval AUC") == 1  # rank 0 reports
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["train_samples"] == summary["steps"] * 2 * 128
    plan = json.loads((run / "plan.json").read_text())
    assert {t["table"]: t["sharding_type"] for t in plan["tables"]}["t_C1"] == "row_wise"
    state = torch.load(run / "checkpoint" / checkpoint.STATE_FILE, weights_only=True)
    assert int(state["model"]["embeddings.optimizer_step"]) == summary["steps"]
    result = _neorec("eval", "configs/demo.toml", "--checkpoint", str(run / "checkpoint"), *settings)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["auc"] == summary["eval_auc"]


def test_plan_prints_tables_and_ranks(criteo_dataset, tmp_path):
    out = tmp_path / "plan.json"
    result = _neorec("plan", "configs/demo.toml", "--world-size", "4", "--ranks-per-node", "2",
                     "--set", f"data.path='{criteo_dataset.root}'", "--json", str(out))
    assert result.returncode == 0, result.stderr
    for table in range(1, 27):
        assert f"t_C{table} " in result.stdout
    assert "estimated step (slowest rank)" in result.stdout and "round-robin" in result.stdout
    assert json.loads(out.read_text())["world_size"] == 4


def test_an_impossible_plan_is_explained(criteo_dataset):
    result = _neorec("plan", "configs/demo.toml", "--world-size", "2", "--memory-per-rank", "2MiB",
                     "--set", f"data.path='{criteo_dataset.root}'")
    assert result.returncode == 2
    assert "26 tables need" in result.stderr and "2 ranks x 2.00 MiB" in result.stderr
    assert "Options: more ranks or memory per rank" in result.stderr
    assert "Traceback" not in result.stderr
