"""scripts/jit_hotspots.py: samples in JIT code mapped to its instructions."""

import importlib.util
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import numba
import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "jit_hotspots.py"
spec = importlib.util.spec_from_file_location("jit_hotspots", SCRIPT)
jit_hotspots = importlib.util.module_from_spec(spec)
sys.modules["jit_hotspots"] = jit_hotspots  # dataclasses look their module up
spec.loader.exec_module(jit_hotspots)

needs_objdump = pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")


@needs_objdump
def test_samples_are_counted_on_their_instructions_and_regions(tmp_path):
    # nop; prefetchw (%rsi,%r8,1); add $0x40,%r8; ret  at 0x1000, and a region nothing sampled
    code = bytes([0x90, 0x42, 0x0F, 0x0D, 0x0C, 0x06, 0x49, 0x83, 0xC0, 0x40, 0xC3])
    hot, cold = jit_hotspots.Region(0x1000, code), jit_hotspots.Region(0x9000, bytes([0xC3]))
    samples = Counter({0x1006: 30, 0x1000: 5, 0x100A: 1, 0x5000: 4})  # 0x5000: outside both
    text = jit_hotspots.report([cold, hot], samples, tmp_path, top=2, context=1)
    lines = text.splitlines()
    assert lines[0] == "40 samples; in JIT code: 36"
    assert "== 0x1000 (11 bytes): 36 samples, 90.0%" in text and "0x9000" not in text
    assert lines[3:5] == ["      30  0x1006  add    $0x40,%r8", "       5  0x1000  nop"]  # the top 2, hottest first
    before = lines.index("  -- before 0x1006:")
    assert lines[before + 1:before + 3] == ["       0  0x1001  prefetchw (%rsi,%r8,1)",
                                            "      30  0x1006  add    $0x40,%r8"]


def test_the_executable_mappings_of_a_process_hold_numba_code():
    @numba.njit
    def twice(x):
        return 2 * x

    assert twice(21) == 42
    regions = jit_hotspots.executable_regions(os.getpid())
    assert regions and all(len(r.code) == r.end - r.start > 0 for r in regions)
