"""Restarts by torchrun's elastic agent: a restarted worker continues its job's run.

Under ``torchrun --max-restarts K`` an agent starts its workers again when one fails, and
the other nodes' agents restart theirs when they see the group re-forming
(``TORCHELASTIC_RESTART_COUNT`` counts only the first kind, so it is not the signal). The
new workers find the run directory holding the run their own job started, which a fresh
start would refuse. The job's first attempt marks the directory as claimed in the job's
store (the agents' rendezvous store, named by ``NEOREC_JOB_STORE``, which ``neorec
train`` sets when it starts torchrun for restarts or several nodes; it lives as long as
the agents do, across restarts); when rank 0 finds that mark, every
rank resumes from the newest complete checkpoint there, or starts the run over when the
job died before its first checkpoint. A directory some other run left is never taken over
this way: the store of that run's job is gone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch.distributed as dist

from neorec.common.restarts import restart_count
from neorec.common.stores import store_client
from neorec.trainer.checkpoint.layout import complete
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import DistributedContext, launched_by_torchrun
from neorec.trainer.run import run_dir as run_directory

log = logging.getLogger(__name__)

JOB_STORE = "NEOREC_JOB_STORE"
"""Names the job's rendezvous store (``HOST:PORT``; set by ``neorec train``)."""
STORE_TIMEOUT_S = 30.0


def _job_store() -> dist.Store | None:
    """The job's rendezvous store, keys under ``neorec/claimed-run-dir/`` (None: not named)."""
    address = os.environ.get(JOB_STORE)
    if not address:
        return None
    return dist.PrefixStore("neorec/claimed-run-dir/", store_client(address, STORE_TIMEOUT_S))


def _key(run_dir: Path) -> str:
    return str(run_dir.resolve())


def mark_claimed(run_dir: Path) -> None:
    """Record in the job's store that this job's run lives in ``run_dir`` (rank 0, once the
    directory is claimed; nothing outside torchrun)."""
    store = _job_store() if launched_by_torchrun() else None
    if store is not None:
        store.set(_key(run_dir), "1")


def claimed_by_this_job(run_dir: Path) -> bool:
    """Whether an earlier attempt of this job claimed ``run_dir`` (under torchrun)."""
    store = _job_store()
    return store is not None and store.check([_key(run_dir)])


def after_restart(config: TrainConfig, context: DistributedContext, overwrite: bool,
                  resume: bool) -> tuple[bool, bool]:
    """``(overwrite, resume)`` for this attempt of the job: as asked on its first attempt;
    after a restart (rank 0 finds the run directory claimed by this job), resume from the
    newest complete checkpoint (or, with none yet, start the run over). Every rank gets
    rank 0's answer (one broadcast, under torchrun only)."""
    if not launched_by_torchrun() or resume:
        return overwrite, resume
    run_dir = Path(config.run.dir)
    answer: list[tuple[bool, bool] | None] = [None]
    if context.is_main and claimed_by_this_job(run_dir):
        if complete(run_dir / run_directory.CHECKPOINTS):
            log.warning("the job's workers were restarted (restart %d on this node): resuming from the newest "
                        "checkpoint in %s", restart_count(), run_dir)
            answer = [(False, True)]
        else:
            log.warning("the job's workers were restarted (restart %d on this node): no checkpoint in %s yet, "
                        "starting the run over", restart_count(), run_dir)
            answer = [(True, False)]
    if context.distributed:
        dist.broadcast_object_list(answer, src=0)
    return answer[0] or (overwrite, resume)
