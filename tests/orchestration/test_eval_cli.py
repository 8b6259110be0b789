"""``neorec eval`` of a run trained through reader services reads the eval split in process
(the services are gone by then) unless ``--ingest`` names services to read through."""

import json
import time

import pytest

from tests.ingest.workers import start_worker, stop_all
from tests.cli import neorec


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_eval_of_a_run_trained_through_services_that_are_gone(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    worker = start_worker()
    try:
        trained = neorec("train", "configs/demo.toml", "--ingest", worker.address, "--set",
                         f"data.path='{criteo_dataset.root}'", "--set", f"run.dir='{run}'",
                         "--set", "train.batch_size=256", "--set", "model.max_table_rows=1000")
        assert trained.returncode == 0, trained.stderr
    finally:
        worker.stop()
    assert json.loads((run / "config.json").read_text())["data"]["ingest"] == [worker.address]
    summary = json.loads((run / "summary.json").read_text())
    started = time.monotonic()
    result = neorec("eval", "--checkpoint", str(run), timeout=120)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60  # not a stall timeout on the dead service (120 s)
    metrics = json.loads(result.stdout)
    assert metrics["auc"] == summary["eval_auc"] and metrics["logloss"] == summary["eval_logloss"]
    assert metrics["rows"] == criteo_dataset.rows["eval"]

    again = start_worker()  # told to, it reads through services, with the same numbers
    try:
        through = neorec("eval", "--checkpoint", str(run), "--ingest", again.address, timeout=120)
        assert through.returncode == 0, through.stderr
        assert json.loads(through.stdout) == metrics
        status = json.loads(neorec("ingest", "status", again.address).stdout)
        assert int(status["rowsServed"]) == criteo_dataset.rows["eval"]
    finally:
        stop_all([again])
