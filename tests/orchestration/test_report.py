"""``neorec report`` plots what ``metrics.jsonl`` holds; ``checkpoint.keep_best`` keeps the
checkpoint of the best eval AUC, which ``neorec eval --best`` evaluates."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from neorec.orchestration.report import PLOTS, figures, read_run, text_summary
from neorec.trainer.checkpoint.layout import BEST, best_checkpoint, complete, read_manifest, step_name
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.run_records import logged
from tests.cli import NEOREC


@pytest.fixture(scope="module")
def runs(criteo_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("slow", 0.01), ("fast", 0.1)):
        train(TrainConfig.from_dict({
            "data": {"path": str(criteo_dataset.root)},
            "model": {"max_table_rows": 2000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
            "optimizer": {"sparse_lr": lr, "dense_lr": lr},
            "train": {"batch_size": 128, "epochs": 3, "log_every": 5, "eval_every": 10},
            "checkpoint": {"keep": 1, "keep_best": True},
            "run": {"dir": str(root / name)}}))
    return [root / "slow", root / "fast"]


def test_the_plotted_lines_are_the_logged_metrics(runs):
    runs_logged = [logged(run) for run in runs]
    drawn = figures([read_run(run) for run in runs])
    assert set(drawn) == set(PLOTS)
    for name, panels in PLOTS.items():
        for ax, (split, metric, _) in zip(drawn[name].axes, panels):
            assert [line.get_label() for line in ax.lines] == ["slow", "fast"]
            for line, records in zip(ax.lines, runs_logged):
                expected = [(r["step"], r[metric]) for r in records if r["split"] == split]
                assert expected and [tuple(p) for p in line.get_xydata().tolist()] == expected


def test_report_writes_pngs_and_a_summary(runs, tmp_path):
    done = subprocess.run([*NEOREC, "report", *map(str, runs), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in PLOTS:
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    summary = json.loads((runs[1] / "summary.json").read_text())
    line = next(x for x in done.stdout.splitlines() if x.startswith("fast"))
    assert f"{summary['eval_auc']:.4f}" in line


def test_the_best_checkpoint_is_kept_and_evaluated(runs):
    run = runs[1]
    evals = logged(run, "eval")
    best = max(evals, key=lambda r: r["auc"])  # the first of equals
    name = (run / "checkpoint" / BEST).read_text().strip()
    assert read_manifest(run / "checkpoint" / name).step == best["step"]
    assert name in {p.name for p in complete(run / "checkpoint")}  # kept though keep = 1
    assert evaluate_checkpoint(run, best=True)["auc"] == best["auc"]


def test_the_best_checkpoint_is_known_when_a_crash_came_between_its_commit_and_best(runs, tmp_path):
    """The manifest commits a checkpoint as the best; ``BEST`` is written after it. A run
    killed between the two still knows its best: a resume protects it from pruning and
    ``neorec eval --best`` evaluates it."""
    root = Path(shutil.copytree(runs[1], tmp_path / "run")) / "checkpoint"
    name = (root / BEST).read_text().strip()
    assert read_manifest(root / name).best
    assert not any(read_manifest(p).best for p in complete(root) if p.name > name)
    (root / BEST).unlink()  # killed before the run's first BEST
    assert best_checkpoint(root) == name
    (root / BEST).write_text(step_name(0) + "\n")  # killed before BEST moved from an older best
    assert best_checkpoint(root) == name
    assert evaluate_checkpoint(root.parent, best=True) == evaluate_checkpoint(root / name)


def test_a_following_run_gets_its_progressive_auc_and_lag_per_partition(tmp_path):
    from neorec.orchestration.report import PARTITIONS_PLOT, partition_table
    from tests.trainer.follow_helpers import follow_config, partitioned

    data = partitioned(tmp_path / "data", 3)
    train(follow_config(data, tmp_path / "follow"))
    progressive = logged(tmp_path / "follow", "progressive")
    lags = [r["lag_s"] for r in logged(tmp_path / "follow", "partition")]
    run = read_run(tmp_path / "follow")
    assert list(run.partitions) == [r["partition"] for r in progressive]
    assert [p["auc"] for p in run.partitions.values()] == [r["auc"] for r in progressive]
    assert [p["oracle_auc"] for p in run.partitions.values()] == [r["oracle_auc"] for r in progressive]
    assert [p["lag_s"] for p in run.partitions.values()] == lags
    auc_ax, lag_ax = figures([run])[PARTITIONS_PLOT].axes
    assert auc_ax.lines[0].get_ydata().tolist() == [r["auc"] for r in progressive]
    assert auc_ax.lines[1].get_label() == "oracle"
    assert lag_ax.lines[0].get_ydata().tolist() == lags
    table = partition_table([run]).splitlines()
    assert len(table) == 4 and table[1].split()[:2] == [progressive[0]["partition"], f"{progressive[0]['auc']:.4f}"]


@pytest.mark.parametrize("file,content,expected", [
    ("summary.json", b"{bad", "summary.json is not JSON"),
    ("summary.json", b"[1, 2]", "summary.json is not a JSON object"),
    ("metrics.jsonl", b'{"split": "eval", "step": 5, "auc": 0.7}\n[1, 2]\n', "metrics.jsonl: line 2 is not a JSON object"),
    ("metrics.jsonl", b'{"split": "eval", "auc": 0.7}\n', "metrics.jsonl: line 1 has no step number"),
    ("metrics.jsonl", b'{"split": "eval", "step": 5, "auc": 0.7}\n\xff\xfe\n', "metrics.jsonl is not UTF-8 text"),
])
def test_damaged_run_files_are_named(tmp_path, file, content, expected):
    from neorec.trainer.run.run_dir import RunDirError

    (tmp_path / "metrics.jsonl").write_text('{"split": "eval", "step": 5, "auc": 0.7}\n'
                                            '{"event": "resume_skipped", "step": 5, "reason": "torn"}\n')
    assert read_run(tmp_path).series[("eval", "auc")] == ([5], [0.7])  # an event line is not metrics
    (tmp_path / file).write_bytes(content)
    with pytest.raises(RunDirError, match=expected):
        read_run(tmp_path)


def test_a_summary_value_that_is_no_number_is_read_as_absent(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"split": "eval", "step": 5, "auc": 0.7}\n')
    (tmp_path / "summary.json").write_text('{"steps": null, "train_qps": "fast", "oracle_auc": 0.8}')
    run = read_run(tmp_path)
    assert run.summary == {"oracle_auc": 0.8}
    assert text_summary([run]).splitlines()[1].split()[1:3] == ["5", "0.7000"]  # the steps the metrics give


def test_a_last_line_cut_short_by_a_killed_run_is_left_out_with_a_warning(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"split": "eval", "step": 5, "auc": 0.7}\n{"split": "train", "st')
    assert read_run(tmp_path).series == {("eval", "auc"): ([5], [0.7])}
    assert "metrics.jsonl: line 2 is cut short (a run killed as it wrote it?): left out" in caplog.text
    (tmp_path / "metrics.jsonl").write_text('{"split": "eval", "step": 5, "auc": 0.7}\n{"split": "train", "st\n')
    with pytest.raises(Exception, match="line 2 is not JSON"):  # a whole line that is not JSON is damage
        read_run(tmp_path)


def test_a_config_that_evaluates_a_checkpoint_must_hold_its_model(runs):
    """``neorec eval CONFIG --checkpoint RUN``: a config whose model differs from the
    checkpoint's is refused by name (its weights would not fit, or its ids would mean other
    rows); one that differs elsewhere evaluates the same model."""
    from neorec.trainer.checkpoint.layout import CheckpointError

    saved = json.loads((runs[0] / "config.json").read_text())
    other_rows = TrainConfig.from_dict({**saved, "model": {**saved["model"], "max_table_rows": 500}})
    with pytest.raises(CheckpointError, match="eval: model.max_table_rows is 500, the checkpoint was made with 2000"):
        evaluate_checkpoint(runs[0], other_rows)
    one_thread = TrainConfig.from_dict({**saved, "train": {**saved["train"], "threads": 1}})
    assert evaluate_checkpoint(runs[0], one_thread) == evaluate_checkpoint(runs[0])
