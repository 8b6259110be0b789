"""How the threads of the OpenMP pools (torch's, and Numba's ``omp`` threading layer, which
loads a second OpenMP runtime) wait for work: asleep, not spinning.

An OpenMP runtime's idle threads spin by default (GNU's for about 300,000 rounds of a
pause loop after every parallel region) so that the next region starts without a wake-up.
That pays on a host that is the job's alone, and ruins it on a shared one: the training
step runs dozens of short parallel regions, each ending in a barrier; a thread spinning at
the barrier holds its core while the thread it waits for, preempted by another process,
queues for a core behind it, and the two pools' idle threads spin against each other's
working ones. With one competing process on two cores the step ran at a small fraction
of its speed. Waiting threads that sleep give their core back at once, so the preempted
thread runs on it and a region costs a wake-up, not a scheduler time slice.

The runtimes read the policy once, when they load, so it is set in the environment
before torch (or a Numba parallel kernel) is first imported: :mod:`neorec` does it on
import. A user's own setting of any of :data:`WAIT_VARIABLES` is left as it is
(``OMP_WAIT_POLICY=ACTIVE`` restores spinning, for a host that runs nothing else).
"""

from __future__ import annotations

import os
from typing import MutableMapping

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""The variables that choose how OpenMP threads wait (the standard one, GNU's and Intel's)."""


def prefer_passive_waiting(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` unless one of :data:`WAIT_VARIABLES`
    is set already; returns whether it set it. Processes started later inherit it."""
    if any(name in environ for name in WAIT_VARIABLES):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
