"""The ``neorec`` command as a user runs it (a real subprocess)."""

import json
import subprocess
import sys

from tests.conftest import FIXTURES


def _neorec(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "orchestration.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_synth_train_eval_round_trip(tmp_path):
    data = tmp_path / "data"
    result = _neorec("data", "synth", "--profile", "criteo", "--rows", "3000", "--out", str(data))
    assert result.returncode == 0, result.stderr
    assert json.loads((data / "dataset.json").read_text())["rows"] == {"train": 2400, "eval": 600}
    run = tmp_path / "run"
    result = _neorec("train", "configs/demo.toml", "--set", f"data.path='{data}'", "--set", f"run.dir='{run}'",
                     "--set", "train.batch_size=256", "--set", "model.max_table_rows=1000")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert "eval AUC" in result.stdout and "oracle" in result.stdout
    result = _neorec("eval", "configs/demo.toml", "--checkpoint", str(run / "checkpoint"),
                     "--set", f"data.path='{data}'", "--set", "model.max_table_rows=1000")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["auc"] == summary["eval_auc"]


def test_convert_criteo_fixture(tmp_path):
    result = _neorec("data", "convert", "criteo", str(FIXTURES / "criteo_sample.tsv"), "--out", str(tmp_path),
                     "--eval-every", "2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows"] == {"train": 2, "eval": 2}


def test_errors_are_reported_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbach_size = 3\n")
    result = _neorec("train", str(bad))
    assert result.returncode == 2
    assert "unknown key 'train.bach_size'" in result.stderr
    assert "Traceback" not in result.stderr
    result = _neorec("train", "configs/demo.toml", "--set", f"data.path='{tmp_path}/none'")
    assert result.returncode == 2 and "not a neorec dataset directory" in result.stderr


def test_bench_quick_prints_both_sides_and_ratio(tmp_path):
    out = tmp_path / "bench.json"
    result = _neorec("bench", "train", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["ratio"] == report["fused_qps"] / report["baseline_qps"]
