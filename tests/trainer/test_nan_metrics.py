"""An eval split of one class has no AUC: it is reported as NaN and never taken for the
best model (``checkpoint.keep_best``, ``neorec eval --best``, ``neorec report``)."""

import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.ingest.schema import Dataset
from neorec.orchestration.report import RunCurves, text_summary
from neorec.trainer.checkpoint import CheckpointError
from neorec.trainer.checkpoint.layout import best_checkpoint
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.run_records import logged
from tests.trainer.test_train import _config


@pytest.fixture
def one_class_eval(criteo_dataset, tmp_path) -> Dataset:
    """The criteo fixture with every eval label 0."""
    shutil.copytree(criteo_dataset.root, tmp_path / "data")
    dataset = Dataset.load(tmp_path / "data")
    label = dataset.schema.label
    for path in dataset.files("eval"):
        table = pq.read_table(path)
        column = table.schema.get_field_index(label)
        zeros = pa.array([0] * table.num_rows, type=table.schema.field(column).type)
        pq.write_table(table.set_column(column, table.schema.field(column), zeros), path, row_group_size=700)
    return dataset


def test_a_nan_auc_is_reported_and_never_the_best(one_class_eval, tmp_path):
    config = _config(one_class_eval, tmp_path / "run", epochs=2, eval_every=6)
    config.checkpoint.keep_best = True
    summary = train(config)
    assert math.isnan(summary["eval_auc"]) and math.isfinite(summary["eval_logloss"])
    evals = logged(tmp_path / "run", "eval")
    assert len(evals) >= 3 and all(math.isnan(r["auc"]) for r in evals)
    assert best_checkpoint(tmp_path / "run" / "checkpoint") is None
    with pytest.raises(CheckpointError, match="has no best checkpoint: .*or none of its evaluations gave an AUC"):
        evaluate_checkpoint(tmp_path / "run", best=True)
    assert math.isnan(evaluate_checkpoint(tmp_path / "run")["auc"])


def test_the_report_never_calls_a_nan_auc_the_best():
    run = RunCurves("run", {("eval", "auc"): ([10, 20, 30], [0.70, float("nan"), 0.60])})
    row = text_summary([run]).splitlines()[1].split()
    assert row[2:5] == ["0.6000", "0.7000", "10"]  # final, best, at step
    only_nan = RunCurves("nan", {("eval", "auc"): ([10], [float("nan")])})
    assert text_summary([only_nan]).splitlines()[1].split()[2:5] == ["nan", "-", "-"]
