"""The malloc thresholds neorec sets: a step's freed temporaries stay mapped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neorec.common.malloc_policy import MALLOC_VARIABLES, glibc, keep_freed_memory

_FAULTS_OF_REUSED_BLOCKS = """
import ctypes, resource, sys
import numpy as np
libc = ctypes.CDLL(None)
libc.mallopt(-3, 128 << 10)  # glibc's default thresholds, fixed (as some native libraries leave them)
libc.mallopt(-1, 128 << 10)
if sys.argv[1] == "import":
    import neorec
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
for _ in range(50):
    block = np.ones(1 << 17)  # 1 MiB, written
    del block
print(faults() - before)
"""


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc")
def test_importing_neorec_keeps_a_freed_block_for_the_next_one() -> None:
    """With the thresholds at glibc's defaults, each 1 MiB block is mapped and faulted in
    again (256 pages each time); after ``import neorec`` the same blocks reuse the heap."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES}
    faults = {}
    for mode in ("plain", "import"):
        run = subprocess.run([sys.executable, "-c", _FAULTS_OF_REUSED_BLOCKS, mode], env=env, capture_output=True,
                             text=True, check=True)
        faults[mode] = int(run.stdout.split()[-1])
    assert faults["plain"] > 40 * 256
    assert faults["import"] < 2 * 256


def test_a_users_own_malloc_settings_are_left_alone() -> None:
    for name in MALLOC_VARIABLES:
        assert not keep_freed_memory({name: "1048576"})
