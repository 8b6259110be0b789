"""torchrun as ``--nproc`` runs it: ``python -m neorec.orchestration.torchrun_main ARGS`` is
``python -m torch.distributed.run ARGS``, but ends in a line rather than a traceback:

- stopped by a signal (which torchrun passes on to the ranks, then waits for them): its
  ``SignalException`` (or, before the ranks start, a ``KeyboardInterrupt``), status 128 +
  the signal's number;
- a rank failed: its ``ChildFailedError`` (whose table repeats what the ranks printed),
  status 1, with each failed rank's exit status or signal on one line.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import main as torchrun


def main() -> int:
    """Run torchrun on this process's arguments; its exit status."""
    try:
        torchrun()
    except SignalException as stop:
        print(f"torchrun: stopped on {stop.sigval.name}; the ranks were stopped first", file=sys.stderr)
        return 128 + int(stop.sigval)
    except KeyboardInterrupt:  # before torchrun's own handlers (at a rendezvous, say): no rank had started
        print("torchrun: stopped on SIGINT before the ranks started", file=sys.stderr)
        return 128 + signal.SIGINT
    except ChildFailedError as failed:
        first, _ = failed.get_first_failure()
        ranks = [_ending(rank, failure) + (" (the first)" if rank == first and len(failed.failures) > 1 else "")
                 for rank, failure in sorted(failed.failures.items())]
        print(f"torchrun: {'; '.join(ranks)}", file=sys.stderr)
        return 1
    return 0


def _ending(rank: int, failure: ProcessFailure) -> str:
    """How rank ``rank`` ended, in words."""
    if failure.exitcode < 0:
        return f"rank {rank} (pid {failure.pid}) was ended by {failure.signal_name()}"
    return f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}"


if __name__ == "__main__":
    sys.exit(main())
