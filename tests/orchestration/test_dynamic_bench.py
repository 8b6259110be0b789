"""``neorec bench dynamic --quick``: the JSON the issue's figures are read from."""

from __future__ import annotations

import json
import subprocess

import pytest
from tests.cli import NEOREC


@pytest.mark.slow  # the benchmark end to end, ~14 s: CI runs it with -m slow
def test_bench_dynamic_reports_the_capacity_curve_the_step_ratio_the_map_and_the_memory(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([*NEOREC, "bench", "dynamic", "--quick",
                             "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    for curve in ("capacities", "demo_capacities"):
        capacities = [point["capacity"] for point in report[curve]]
        assert capacities == sorted(capacities) and len(capacities) == 3
        for point in report[curve]:
            assert all(0.5 < point[key] <= 1.0 for key in ("dynamic_auc", "hashed_auc", "vocab_auc"))
    assert report["step_over_static"] > 0
    assert report["map"]["lookup_ids_per_s_per_thread"] > 0 and report["map"]["train_remap_ids_per_s_per_thread"] > 0
    memory = report["memory"]
    assert memory["live"] == memory["capacity"] < memory["admitted"] == memory["evicted"] + memory["live"]
    assert memory["peak_rss_bytes"] > memory["rss_before_table_bytes"]
