"""The malloc settings neorec makes: a step's freed temporaries stay mapped, however large."""

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

_MAPPED_BYTES_OF_A_LARGE_BLOCK = """
import ctypes, sys
import numpy as np


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "import":
    import neorec
before = libc.mallinfo2().hblkhd  # bytes in blocks that have a mapping of their own
block = np.ones(48 << 17)  # 48 MiB: above the largest threshold glibc's own adaptation reaches (32 MiB)
print(libc.mallinfo2().hblkhd - before)
"""


def _run(script: str, *args: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES}
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc")
def test_importing_neorec_keeps_a_freed_block_for_the_next_one() -> None:
    """With the thresholds at glibc's defaults, each 1 MiB block is mapped and faulted in
    again (256 pages each time); after ``import neorec`` the same blocks reuse the heap."""
    assert _run(_FAULTS_OF_REUSED_BLOCKS, "plain") > 40 * 256
    assert _run(_FAULTS_OF_REUSED_BLOCKS, "import") < 2 * 256


@pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"), reason="glibc's malloc, 2.33 or later")
def test_after_importing_neorec_even_a_large_block_comes_from_the_heap() -> None:
    """A 48 MiB block gets a mapping of its own under glibc's defaults (unmapped when freed,
    faulted in afresh next time); after ``import neorec`` it comes from the heap."""
    assert _run(_MAPPED_BYTES_OF_A_LARGE_BLOCK, "plain") >= 48 << 20
    assert _run(_MAPPED_BYTES_OF_A_LARGE_BLOCK, "import") == 0


def test_a_users_own_malloc_settings_are_left_alone() -> None:
    for name in MALLOC_VARIABLES:
        assert not keep_freed_memory({name: "1048576"})
