"""Checkpoints are data, never code: a ``dense.pt`` whose pickle would run a command is
refused by name (even when the manifest's checksum matches it), by ``neorec eval
--checkpoint`` and by ``--resume``, and the command never runs. With
``checkpoint.fallback``, a corrupt newest checkpoint is skipped out loud."""

import hashlib
import json
import pickle
import subprocess

import pytest

from neorec.trainer.checkpoint.layout import DENSE_FILE, MANIFEST, complete
from tests.trainer.run_records import logged
from tests.cli import neorec

ERROR = 2


def _train(data, run, *more):
    return neorec("train", "configs/demo.toml", "--set", f"data.path='{data}'", "--set", f"run.dir='{run}'",
                  "--set", "train.batch_size=256", "--set", "model.max_table_rows=1000",
                  "--set", "checkpoint.every_steps=5", "--set", "checkpoint.keep=5", *more)


class _RunsACommand:
    """Unpickling this runs ``touch marker`` (what a crafted checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(criteo_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("trust") / "run"
    result = _train(criteo_dataset.root, run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(complete(run / "checkpoint")) >= 2
    return run


def _replace_dense(checkpoint, data: bytes) -> None:
    """Give ``checkpoint`` a new dense.pt, and its manifest that file's size and SHA-256."""
    (checkpoint / DENSE_FILE).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for entry in manifest["files"]:
        if entry["name"] == DENSE_FILE:
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _copy(run, tmp_path):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    return copy


def _refused_by(command: str, dataset, run):
    """``neorec eval`` of the run, or ``train --resume`` of it; asserts it is refused as a
    user error (no traceback) and returns the result."""
    if command == "eval":
        result = neorec("eval", "--checkpoint", str(run))
    else:
        result = _train(dataset.root, run, "--set", "train.epochs=2", "--resume", str(run))
    assert result.returncode == ERROR, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_a_checkpoint_whose_pickle_runs_code_is_refused(criteo_dataset, trained, tmp_path, command):
    run = _copy(trained, tmp_path)
    marker = tmp_path / "marker"
    newest = complete(run / "checkpoint")[-1]
    _replace_dense(newest, pickle.dumps({"bottom": _RunsACommand(marker)}, protocol=2))
    result = _refused_by(command, criteo_dataset, run)
    assert f"{newest / DENSE_FILE}" in result.stderr and "refused" in result.stderr, result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_a_truncated_dense_file_is_named_as_truncated(criteo_dataset, trained, tmp_path, command):
    run = _copy(trained, tmp_path)
    dense = complete(run / "checkpoint")[-1] / DENSE_FILE
    dense.write_bytes(dense.read_bytes()[: dense.stat().st_size // 2])
    result = _refused_by(command, criteo_dataset, run)
    assert f"{dense} is " in result.stderr and "truncated or corrupt" in result.stderr, result.stderr


def test_fallback_names_the_skipped_checkpoint(criteo_dataset, trained, tmp_path):
    run = _copy(trained, tmp_path)
    done = complete(run / "checkpoint")
    newest, older = done[-1], done[-2]
    (newest / DENSE_FILE).write_bytes(b"corrupt")
    result = _train(criteo_dataset.root, run, "--set", "train.epochs=2", "--set", "checkpoint.fallback=true",
                    "--resume", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if newest.name in line and "skipped" in line]
    assert len(warnings) == 1, result.stderr
    assert str(newest / DENSE_FILE) in warnings[0] and "corrupt" in warnings[0] and older.name in warnings[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resume_skipped"] == [{"checkpoint": newest.name, "reason": summary["resume_skipped"][0]["reason"]}]
    assert str(newest / DENSE_FILE) in summary["resume_skipped"][0]["reason"]
    skipped = [e for e in logged(run) if e.get("event") == "resume_skipped"]
    assert [e["checkpoint"] for e in skipped] == [newest.name]
