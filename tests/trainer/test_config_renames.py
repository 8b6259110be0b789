"""Renamed config keys (``RENAMED_KEYS``) are still read under their old names, with a
warning naming both, in a config file and in the config a checkpoint saved; both names at
once are refused."""

import json
import logging
from pathlib import Path

import pytest

from neorec.orchestration.config import load_config
from neorec.trainer.checkpoint.layout import MANIFEST, complete
from neorec.trainer.config import RENAMED_KEYS, ConfigError, TrainConfig
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.test_train import _config

OLD, NEW = "train.prefetch", "train.background_batches"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_every_old_name_reads_as_its_new_one_with_one_warning(caplog):
    for old, new in RENAMED_KEYS.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        raw = {old_section: {old_key: 3}, "run": {"dir": "x"}}
        caplog.clear()
        config = TrainConfig.from_dict(raw)
        assert getattr(getattr(config, new_section), new_key) == 3
        assert raw == {old_section: {old_key: 3}, "run": {"dir": "x"}}  # the caller's table is left as it was
        (warning,) = _warnings(caplog)
        assert old in warning and new in warning
        assert new_key in config.to_dict()[new_section] and old_key not in config.to_dict()[old_section]


def test_an_old_name_in_a_config_file_and_in_an_override(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[train]\nprefetch = 4\n")
    assert load_config(path).train.background_batches == 4
    assert load_config(tmp_path / "old.toml", ["train.prefetch=0"]).train.background_batches == 0


@pytest.mark.parametrize("text,overrides", [("[train]\nprefetch = 4\nbackground_batches = 4\n", []),
                                            ("[train]\nbackground_batches = 4\n", ["train.prefetch=2"])])
def test_both_names_at_once_are_refused(tmp_path, text, overrides):
    path = tmp_path / "both.toml"
    path.write_text(text)
    source = f"--set {overrides[-1]}" if overrides else path  # the last to give one of the names
    with pytest.raises(ConfigError, match=rf"{source}: {OLD} and {NEW}: .*give only {NEW}"):
        load_config(path, overrides)


def test_the_old_name_keeps_its_checks():
    with pytest.raises(ConfigError, match=f"{NEW}: expected an integer"):
        TrainConfig.from_dict({"train": {"prefetch": "many"}})
    with pytest.raises(ConfigError, match=f"{NEW}: must be >= 0"):
        TrainConfig.from_dict({"train": {"prefetch": -1}})


def test_a_checkpoint_saved_under_the_old_name_evaluates(criteo_dataset, tmp_path, caplog):
    run = tmp_path / "run"
    summary = train(_config(criteo_dataset, run))
    (newest,) = complete(run / "checkpoint")[-1:]
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["config"]["train"]["prefetch"] = manifest["config"]["train"].pop("background_batches")
    (newest / MANIFEST).write_text(json.dumps(manifest))
    caplog.clear()
    metrics = evaluate_checkpoint(run)
    assert metrics["auc"] == summary["eval_auc"] and metrics["logloss"] == summary["eval_logloss"]
    assert any(OLD in w and NEW in w for w in _warnings(caplog))


def test_the_configuration_page_names_every_renamed_key():
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for old, new in RENAMED_KEYS.items():
        assert f"`{old}` → `{new}`" in page
