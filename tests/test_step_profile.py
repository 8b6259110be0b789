"""scripts/step_profile.py on the CPU: a short profiled run of the demo model, reported."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "step_profile.py"


def test_a_profiled_cpu_run_reports_its_steps_and_top_operators(tmp_path):
    trace = tmp_path / "trace.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--rows", "3000", "--steps", "3",
                             "--top", "4", "--trace", str(trace), "--plain-steps", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 steps of 512 on cpu (not profiled):" in result.stdout
    assert "3 steps of 512 on cpu (profiled):" in result.stdout
    assert "0 kernel launches" in result.stdout  # no GPU, no launches
    assert "aten::" in result.stdout and trace.stat().st_size > 0


def test_counting_the_hosts_waits_needs_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--syncs"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "--syncs needs a CUDA device" in result.stderr
