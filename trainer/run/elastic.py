"""Restarts by torchrun's elastic agent: a restarted worker continues its job's run.

Under ``torchrun --max-restarts K`` the agent starts the whole worker group again when a
worker fails (``TORCHELASTIC_RESTART_COUNT`` counts the restarts). Such a worker finds the
run directory holding the run its own job started, which a fresh start would refuse. The
job's first attempt marks the directory as claimed in the job's store (the TCP store
torchrun serves the workers at ``MASTER_ADDR:MASTER_PORT``, which lives as long as the
agents do, across restarts); a restarted worker whose job claimed the directory resumes
from the newest complete checkpoint there, or starts the run over when the job died
before its first checkpoint. A directory some other run left is never taken over this way:
the store of that run's job is gone.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from neorec.trainer.checkpoint.layout import complete
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import DistributedContext, launched_by_torchrun
from neorec.trainer.run import run_dir as run_directory

log = logging.getLogger(__name__)

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
STORE_TIMEOUT_S = 30.0


def restart_count() -> int:
    """How many times the elastic agent restarted this worker's group (0: first attempt,
    or not under torchrun)."""
    return int(os.environ.get(RESTART_COUNT, "0"))


def _job_store() -> dist.Store:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return dist.PrefixStore("neorec/claimed-run-dir/", store)


def _key(run_dir: Path) -> str:
    return str(run_dir.resolve())


def mark_claimed(run_dir: Path) -> None:
    """Record in the job's store that this job's run lives in ``run_dir`` (rank 0, once the
    directory is claimed; nothing outside torchrun)."""
    if launched_by_torchrun():
        _job_store().set(_key(run_dir), "1")


def claimed_by_this_job(run_dir: Path) -> bool:
    """Whether an earlier attempt of this job claimed ``run_dir``."""
    return launched_by_torchrun() and _job_store().check([_key(run_dir)])


def after_restart(config: TrainConfig, context: DistributedContext, overwrite: bool,
                  resume: bool) -> tuple[bool, bool]:
    """``(overwrite, resume)`` for this attempt: as asked on the first attempt; on a
    restarted worker whose job claimed the run directory, resume from its newest complete
    checkpoint (or, with none yet, start the run over)."""
    count = restart_count()
    run_dir = Path(config.run.dir)
    if count == 0 or resume or not claimed_by_this_job(run_dir):
        return overwrite, resume
    if complete(run_dir / run_directory.CHECKPOINTS):
        if context.is_main:
            log.warning("restart %d of the job: resuming from the newest checkpoint in %s", count, run_dir)
        return False, True
    if context.is_main:
        log.warning("restart %d of the job: no checkpoint in %s yet, starting the run over", count, run_dir)
    return True, False
