"""``neorec bench train --contend``: quiet and contended QPS of the default thread count and
of one thread, with the competitor started for the measurement and stopped after it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tests.cli import NEOREC


def _spinning_processes() -> set[int]:
    """PIDs of live processes running the benchmark's competitor (``python -c 'while True: pass'``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"while True: pass" in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_bench_train_contend_reports_both_thread_counts_and_stops_its_competitor(tmp_path):
    before = _spinning_processes()
    out = tmp_path / "bench.json"
    result = subprocess.run([*NEOREC, "bench", "train", "--contend", "--quick",
                             "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert _spinning_processes() <= before, "the competitor outlived the benchmark"
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train-contention"
    assert report["one_thread"]["threads"] == 1 and 1 <= report["default"]["threads"] == report["fixed"]["threads"] <= report["cpus"]
    assert isinstance(report["governed"], bool)
    assert report["governor_reaction_s"] is None or (report["governed"] and report["governor_reaction_s"] > 0)
    for case in ("default", "fixed", "one_thread"):
        assert report[case]["quiet_qps"] > 0 and report[case]["contended_qps"] > 0
