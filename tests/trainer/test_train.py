import json
import shutil

import pytest
import torch

from neorec.ingest.errors import DataError
from neorec.ingest.schema import Dataset
from neorec.trainer import checkpoint
from neorec.trainer.run.build import build_model
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.readers import eval_reader_config, train_reader_config
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.run_records import logged


def _config(dataset: Dataset, run_dir, **train_overrides) -> TrainConfig:
    return TrainConfig.from_dict({
        "data": {"path": str(dataset.root)},
        "model": {"max_table_rows": 5000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32, 1]},
        "train": {"batch_size": 256, "eval_batch_size": 1000, "log_every": 5, **train_overrides},
        "run": {"dir": str(run_dir)},
    })


def untimed(summary: dict) -> dict:
    """A run summary without what depends on the machine's speed (rates, waits, stalls)."""
    return {k: v for k, v in summary.items() if "qps" not in k and "wait" not in k and not k.endswith("_s")}


def final_state(run_dir) -> dict[str, torch.Tensor]:
    """The model state of a run's newest checkpoint, restored into a single-process model:
    weights, optimizer state and step counters of the embeddings, the MLPs."""
    restorable = checkpoint.open_checkpoint(run_dir / "checkpoint")
    config = TrainConfig.from_dict(restorable.manifest.config)
    model = build_model(Dataset.load(config.data.path), config)
    checkpoint.restore_model(restorable, model)
    return model.state_dict()


def test_same_config_and_seed_give_bit_identical_runs(criteo_dataset, tmp_path):
    summaries = [train(_config(criteo_dataset, tmp_path / f"run{i}", epochs=2)) for i in range(2)]
    a, b = final_state(tmp_path / "run0"), final_state(tmp_path / "run1")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert untimed(summaries[0]) == untimed(summaries[1])
    other = train(_config(criteo_dataset, tmp_path / "run2", epochs=2, seed=1))
    assert other["eval_auc"] != summaries[0]["eval_auc"]


def test_the_oracle_is_reported_only_beside_the_split_it_is_of(criteo_dataset, tmp_path):
    """The dataset's oracle is of its eval split: a run evaluating another split (here the
    train split) printed it beside its own AUC as if comparable."""
    config = _config(criteo_dataset, tmp_path / "run")
    config.data.eval_split, config.train.max_steps = "train", 2
    summary = train(config)
    assert "oracle_auc" not in summary and summary["eval_rows"] == criteo_dataset.rows["train"]


def test_run_directory_contents_and_checkpoint_eval(criteo_dataset, tmp_path):
    run_dir = tmp_path / "run"
    config = _config(criteo_dataset, run_dir)
    summary = train(config)
    assert summary["steps"] == criteo_dataset.rows["train"] // 256
    assert summary["oracle_auc"] == criteo_dataset.oracle["eval_auc"]
    assert summary["eval_rows"] == criteo_dataset.rows["eval"]
    assert json.loads((run_dir / "config.json").read_text()) == config.to_dict()
    train_records, eval_records = logged(run_dir, "train"), logged(run_dir, "eval")
    assert [r["step"] for r in train_records] == [5, 10, 15, summary["steps"]]
    assert all({"step", "epoch", "loss", "qps"} <= r.keys() for r in train_records)
    assert all({"auc", "logloss", "ne"} <= r.keys() for r in eval_records)
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    restored = evaluate_checkpoint(run_dir)
    assert restored["auc"] == summary["eval_auc"]
    assert restored["logloss"] == summary["eval_logloss"]


def test_the_newest_checkpoint_pruned_while_it_is_evaluated_is_chosen_again(criteo_dataset, tmp_path, monkeypatch):
    """A run still training commits a checkpoint and prunes the one ``neorec eval`` chose,
    between choosing it and reading its files: the newest is chosen again."""
    from neorec.trainer.checkpoint import layout

    run_dir = tmp_path / "run"
    config = _config(criteo_dataset, run_dir)
    config.checkpoint.every_steps = 10
    train(config)
    names = [p.name for p in layout.complete(run_dir / "checkpoint")]
    restore = checkpoint.restore_model
    chosen = []

    def pruned_as_read(restorable, model, *dense):
        chosen.append(restorable.manifest.name)
        if len(chosen) == 1:
            layout.remove(run_dir / "checkpoint" / restorable.manifest.name)
        return restore(restorable, model, *dense)

    monkeypatch.setattr(checkpoint, "restore_model", pruned_as_read)
    metrics = evaluate_checkpoint(run_dir)
    assert chosen == names[-1:] + names[-2:-1]
    monkeypatch.setattr(checkpoint, "restore_model", restore)
    assert metrics == evaluate_checkpoint(run_dir / "checkpoint" / names[-2])
    monkeypatch.setattr(checkpoint, "restore_model", pruned_as_read)
    chosen.clear()
    with pytest.raises(FileNotFoundError):  # a checkpoint named is not replaced by another
        evaluate_checkpoint(run_dir / "checkpoint" / names[-2])


def test_a_run_s_relative_data_path_is_explained_when_evaluated_from_elsewhere(criteo_dataset, tmp_path,
                                                                              monkeypatch):
    from neorec.common.errors import ConfigError

    monkeypatch.chdir(criteo_dataset.root.parent)
    config = _config(criteo_dataset, tmp_path / "run", max_steps=3)
    config.data.path = criteo_dataset.root.name  # relative, as a user's config often is
    train(config)
    assert "auc" in evaluate_checkpoint(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"the run's data.path '{criteo_dataset.root.name}' is relative to the "
                                          rf"directory it started in, and {tmp_path} holds no dataset there"):
        evaluate_checkpoint(tmp_path / "run")


def test_training_learns(criteo_dataset, tmp_path):
    summary = train(_config(criteo_dataset, tmp_path / "run", epochs=1))
    assert summary["eval_auc"] > 0.65
    assert summary["eval_ne"] < 1.0


def test_a_checkpoint_without_a_manifest_is_refused(tmp_path):
    (tmp_path / "checkpoint" / "step-000000010").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        checkpoint.open_checkpoint(tmp_path / "checkpoint")


def test_default_config_reaches_the_oracle_on_200k_rows(tmp_path):
    """The quality bar: one epoch of the demo config on ~200k criteo-profile training rows
    ends within 0.02 AUC of the planted teacher's oracle."""
    from neorec.ingest.synth import SynthSpec, generate
    from neorec.orchestration.config import load_config

    dataset = generate(SynthSpec(rows=250_000), tmp_path / "data")
    config = load_config("configs/demo.toml", [f"data.path='{dataset.root}'", f"run.dir='{tmp_path / 'run'}'"])
    summary = train(config)
    assert summary["oracle_auc"] - summary["eval_auc"] < 0.02


def test_eval_split_is_read_in_file_order_whatever_the_train_shuffle(criteo_dataset, tmp_path):
    for shuffle in ("rows", "row_groups", "none"):
        config = _config(criteo_dataset, tmp_path / "run")
        config.data.shuffle = shuffle
        assert train_reader_config(config).shuffle == shuffle
        assert eval_reader_config(config).shuffle == "none"


def test_empty_eval_split_is_a_named_error_before_training(criteo_dataset, tmp_path):
    shutil.copytree(criteo_dataset.root, tmp_path / "data")
    copy = Dataset.load(tmp_path / "data")
    copy.splits["eval"], copy.rows["eval"] = [], 0
    copy.save()
    with pytest.raises(DataError, match="split 'eval' of .* holds no rows"):
        train(_config(copy, tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    copy.splits["train"] = copy.splits["eval"] = copy.splits["train"][:1]
    copy.rows["train"] = copy.rows["eval"] = 2100
    copy.save()
    with pytest.raises(DataError, match="split 'train' of .* holds 2100 rows, fewer than one step of 1 x 4096"):
        train(_config(copy, tmp_path / "run", batch_size=4096))
