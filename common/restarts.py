"""Which attempt of a job under torchrun's ``--max-restarts`` a process belongs to (read
without importing torch: the ``neorec`` command asks before its commands load it)."""

from __future__ import annotations

import os

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of its elastic agent's restarts of its workers, set in their environment."""


def restart_count() -> int:
    """How many times the elastic agent restarted this worker's group (0: first attempt,
    or not under torchrun). Restarts for a group that re-formed after another node's
    failure are not counted."""
    return int(os.environ.get(RESTART_COUNT, "0"))
