"""How the threads of the OpenMP pools (torch's, and Numba's ``omp`` threading layer, which
loads a second OpenMP runtime) wait for work: a short spin, then asleep.

An OpenMP runtime's idle threads spin by default after every parallel region so that
the next region starts without a wake-up: GNU's for 300,000 rounds of its pause loop
(about 3 ms by its own estimate of 100,000 rounds a millisecond), Intel's for 200 ms.
That pays on a host that is the job's alone, and ruins it on a shared one: the training
step runs dozens of short parallel regions, each ending in a barrier; a thread spinning at
the barrier holds its core while the thread it waits for, preempted by another process,
queues for a core behind it, and the two pools' idle threads spin against each other's
working ones. With one competing process on two cores the step ran at a small fraction
of its speed, slower than with one thread.

:data:`WAIT_POLICY` keeps a spin of about 100 microseconds by GNU's estimate
(``GOMP_SPINCOUNT`` 10,000): long enough that a region following the last one closely
(torch runs its operators one after the other) finds its threads awake, short enough that
a thread waiting for a preempted one gives its core back soon. A tenth of it (the first
setting) was too short on virtual machines whose wake-ups are slow: the demo's quiet
two-thread step ran at ~60k samples/s there against ~100k with this spin and ~75k with one
thread. Under load, the thread governor (:mod:`neorec.trainer.run.thread_governor`) is
what keeps the default count's speed: it trains with fewer threads while the load lasts.
Intel's runtime counts its spin in whole milliseconds, so it sleeps at once
(``KMP_BLOCKTIME=0``).

The runtimes read these variables once, when they load, so they are set in the
environment before torch (or a Numba parallel kernel) is first imported: :mod:`neorec`
does it on import, and processes started later inherit them. A user's own setting of any
of :data:`WAIT_VARIABLES` leaves all of them as they are (``OMP_WAIT_POLICY=ACTIVE``
restores long spinning, for a host that runs nothing else).
"""

from __future__ import annotations

import os
from typing import MutableMapping

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""The variables that choose how OpenMP threads wait (the standard one, GNU's and Intel's)."""

WAIT_POLICY = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}
"""What :func:`prefer_short_waits` sets."""


def prefer_short_waits(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set :data:`WAIT_POLICY` in ``environ`` unless one of :data:`WAIT_VARIABLES` is set
    already; returns whether it set it."""
    if any(name in environ for name in WAIT_VARIABLES):
        return False
    environ.update(WAIT_POLICY)
    return True
