"""torchrun as ``--nproc`` runs it: ``python -m neorec.orchestration.torchrun_main ARGS`` is
``python -m torch.distributed.run ARGS``, except that a stop by a signal (which torchrun
passes on to the ranks, then waits for them) ends with a line and status 128 + the signal's
number, not the traceback of the ``SignalException`` torchrun raises to stop itself."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun


def main() -> int:
    """Run torchrun on this process's arguments; its exit status."""
    try:
        torchrun()
    except SignalException as stop:
        print(f"torchrun: stopped on {stop.sigval.name}; the ranks were stopped first", file=sys.stderr)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
