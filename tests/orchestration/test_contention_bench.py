"""``neorec bench train --contend``: quiet and contended QPS of the default thread count and
of one thread, with the competitor started for the measurement and stopped after it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from neorec.benchmarks.contention_bench import competing_process


def test_the_competitor_runs_inside_the_block_only():
    with competing_process() as process:
        assert process.poll() is None
    assert process.poll() is not None


def test_bench_train_contend_reports_both_thread_counts(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "neorec.orchestration.cli", "bench", "train", "--contend", "--quick",
                             "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train-contention"
    assert report["one_thread"]["threads"] == 1 and 1 <= report["default"]["threads"] <= report["cpus"]
    for case in ("default", "one_thread"):
        figures = report[case]
        assert figures["quiet_qps"] > 0 and figures["contended_qps"] > 0
        assert figures["ratio"] == pytest.approx(figures["contended_qps"] / figures["quiet_qps"])
    assert report["contended_default_vs_one_thread"] == pytest.approx(
        report["default"]["contended_qps"] / report["one_thread"]["contended_qps"])
    assert set(report["wait_policy"]) <= {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"}
