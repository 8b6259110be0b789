"""One training step, the report handed to the progress callback after it, and the thread
settings the step runs with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numba
import pyarrow
import torch
import torch.nn.functional as F

from neorec.common.cpus import available_cpus
from neorec.trainer.batch import Batch
from neorec.trainer.distributed import SINGLE_PROCESS, DenseGradientSum, DistributedContext, global_sum
from neorec.trainer.model import DLRM


@dataclass(frozen=True)
class StepReport:
    """Handed to the progress callback after every step."""

    global_step: int
    epoch: int
    loss: float
    """The mean loss of the last logging interval (``train.log_every`` steps; 0 before the
    first): reading each step's loss would make every step wait for the device."""
    qps: float
    total_steps: int
    input_wait_frac: float = 0.0
    """Of the training time so far (completed epochs), the share spent waiting for batches."""
    last_checkpoint: str = ""
    """The newest checkpoint committed ("" before the first)."""
    partition: str = ""
    """Following partitions: the partition being trained, or the last one trained while
    ``phase`` is ``waiting``."""
    marker_time: float = 0.0
    """Following partitions: when that partition's ``_SUCCESS`` marker was written
    (wall-clock seconds; the lag is measured from it)."""
    phase: str = "training"
    """``training`` (a step was taken) or ``waiting`` (for the next partition; no step)."""
    dynamic: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per dynamic table its ``admitted``, ``rejected``, ``evicted`` and ``live`` counts."""


ProgressFn = Callable[[StepReport], None]


def set_threads(threads: int, ranks_on_host: int = 1) -> int:
    """Use ``threads`` threads in torch, the Numba kernels and Arrow's decoding (0: the
    CPUs this process may use, its affinity mask under its control group's quota, shared
    by the host's ``ranks_on_host`` ranks); returns it."""
    cores = numba.config.NUMBA_NUM_THREADS  # the size of Numba's pool
    count = max(1, min(cores, available_cpus()) // ranks_on_host) if threads == 0 else min(threads, cores)
    use_threads(count)
    return count


def use_threads(count: int) -> None:
    """Run torch's operators, the Numba kernels (of the calling thread) and Arrow's decoding
    on ``count`` threads."""
    torch.set_num_threads(count)
    numba.set_num_threads(count)
    pyarrow.set_cpu_count(count)


def train_step(model: DLRM, optimizer: torch.optim.Optimizer, batch: Batch,
               context: DistributedContext = SINGLE_PROCESS, full_batches: bool = False,
               dense_sum: DenseGradientSum | None = None) -> torch.Tensor:
    """One step: forward, BCE loss, backward (which also updates the embeddings), dense
    optimizer step. Returns this rank's share of the loss (a scalar tensor; the shares of
    all ranks sum to the mean loss over the valid samples of the global batch).

    ``full_batches``: every rank's batch is known to be all valid samples (no padding), so a
    sharded step needs no all-reduce of the valid count. ``dense_sum``: a sharded step's
    sum of the dense gradients over the ranks (required when ``context`` is distributed).
    """
    if context.distributed and dense_sum is None:
        raise ValueError("a distributed step needs the dense gradients' sum over the ranks (dense_sum)")
    logits = model(batch)
    valid = batch.num_valid
    if context.distributed:
        loss = F.binary_cross_entropy_with_logits(logits[:valid], batch.labels[:valid], reduction="sum")
        if full_batches:
            if valid != batch.batch_size:
                raise AssertionError(f"a padded batch ({valid} of {batch.batch_size} valid) where none was planned")
            loss = loss / (batch.batch_size * context.world_size)
        else:
            loss = loss / global_sum(context, [float(valid)])[0]
    else:
        loss = F.binary_cross_entropy_with_logits(logits[:valid], batch.labels[:valid])
    if dense_sum is None:
        optimizer.zero_grad(set_to_none=True)
    else:
        dense_sum.zero()
    loss.backward()
    if dense_sum is not None:
        dense_sum.sum()
    optimizer.step()
    return loss.detach()
