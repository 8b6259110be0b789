"""Where a training run stands (:class:`LoopState`, all a checkpoint keeps of the loop) and
the accounting of its logging interval (:class:`Interval`: loss and throughput since the
last metrics line, over all ranks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from neorec.trainer.distributed import DistributedContext, global_sum


@dataclass
class LoopState:
    """Where training stands and what it has counted: all a resumed run needs to continue
    (timings aside)."""

    epoch: int = 0
    step_in_epoch: int = 0
    """Batches of ``epoch`` trained."""
    global_step: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    """Time spent training (the logged intervals' time, less evaluations and checkpoint
    stalls in them)."""
    wait_seconds: float = 0.0
    eval_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    """Time the loop stood still for checkpoints (snapshot, write-back; a synchronous
    save's write)."""
    interval_loss_shares: float = 0.0
    """This rank's loss shares of the steps since the last log line."""
    interval_steps: int = 0
    interval_samples: int = 0
    """This rank's valid samples of those steps."""
    interval_by_rank: list[float] = field(default_factory=list)
    """At a checkpoint: every rank's ``interval_loss_shares`` then ``interval_samples``
    (the checkpoint holds rank 0's state only), so that each rank resumes its own and the
    resumed interval's loss adds up in the same order."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    best_auc: float = -1.0
    """The best eval AUC so far (``checkpoint.keep_best``)."""
    partition: str = ""
    """Following partitions: the one being trained (``epoch`` counts those before it; its
    progressive metrics are logged), "" between partitions."""
    partitions_done: list[str] = field(default_factory=list)
    """Following partitions: those trained, in order."""
    eval_partition: str = ""
    """Following partitions: the partition whose progressive metrics ``eval_metrics`` are."""
    partition_files: dict[str, list[int]] = field(default_factory=dict)
    """Following partitions: the files of the one being trained when it was planned, each
    ``[size, CRC-32 of its footer]`` (:func:`neorec.ingest.partitions.partition_fingerprints`)."""
    split_files: dict[str, list[int]] = field(default_factory=dict)
    """Training on splits: the files of the train and eval splits when the run began, each
    ``[size, CRC-32 of its footer]`` (:func:`neorec.ingest.fingerprint.fingerprints`): a
    resumed run goes on only on the same data."""


class Interval:
    """Loss and throughput since the last log line, over all ranks; its accumulators live in
    the :class:`LoopState` (a checkpoint keeps them)."""

    def __init__(self, context: DistributedContext, state: LoopState) -> None:
        self.context = context
        self.state = state
        self.started = time.perf_counter()
        self.eval_before = state.eval_seconds
        self.checkpoint_before = state.checkpoint_seconds
        self.loss_shares = torch.tensor(state.interval_loss_shares, dtype=torch.float64, device=context.device)
        """float64 scalar on the run's device: the steps' loss shares summed there, read at
        log lines and checkpoints only (the steps in between never wait for the device)."""
        self.steps = state.interval_steps
        self.samples = state.interval_samples

    def add(self, loss_share: torch.Tensor, samples: int) -> None:
        """A step's loss share (float32 scalar on the device) and valid samples on this rank."""
        self.loss_shares += loss_share
        self.steps += 1
        self.samples += samples

    def paused(self) -> tuple[float, float]:
        """Seconds of evaluation and of checkpoint stalls since the interval began."""
        return self.state.eval_seconds - self.eval_before, self.state.checkpoint_seconds - self.checkpoint_before

    def seconds(self) -> float:
        """Training time since the interval began: its evaluations and checkpoint stalls
        are not counted."""
        return max(time.perf_counter() - self.started - sum(self.paused()), 0.0)

    def qps(self) -> float:
        """This rank's samples per second of training time times the world size (a rank's
        view, no communication)."""
        elapsed = self.seconds()
        return self.samples * self.context.world_size / elapsed if elapsed else 0.0

    def store(self) -> None:
        """Put the accumulators in the loop state, every rank's (for a checkpoint; one
        all-reduce, exact: each rank adds zeros to the others' values)."""
        world, rank = self.context.world_size, self.context.rank
        mine = [0.0] * (2 * world)
        mine[rank], mine[world + rank] = float(self.loss_shares), float(self.samples)
        self.state.interval_by_rank = global_sum(self.context, mine)
        self.state.interval_loss_shares = mine[rank]
        self.state.interval_steps = self.steps
        self.state.interval_samples = self.samples

    @staticmethod
    def resume(state: LoopState, context: DistributedContext) -> None:
        """Give this rank its own accumulators from a restored ``state`` (rank 0's). Into
        another world size, rank 0 takes the whole interval."""
        by_rank = state.interval_by_rank
        if not by_rank:  # no step since the last log line
            return
        saved_world = len(by_rank) // 2
        if saved_world == context.world_size:
            shares, samples = by_rank[context.rank], by_rank[saved_world + context.rank]
        elif context.is_main:
            shares, samples = sum(by_rank[:saved_world]), sum(by_rank[saved_world:])
        else:
            shares, samples = 0.0, 0.0
        state.interval_loss_shares, state.interval_samples = shares, int(samples)

    def close(self, checkpoint_due: bool) -> tuple[dict[str, float], bool]:
        """``loss`` (mean over the steps of the global batch's mean loss), ``steps``, global
        ``samples``, ``qps`` and ``seconds`` of training (added to the loop state, whose
        accumulators are reset), ``eval_seconds`` and ``checkpoint_seconds`` the interval
        stood still for, and whether any rank's ``checkpoint_due``: one all-reduce over the
        ranks."""
        seconds = self.seconds()
        eval_seconds, checkpoint_seconds = self.paused()
        loss_sum, samples, due = global_sum(self.context, [float(self.loss_shares), float(self.samples),
                                                           float(checkpoint_due)])
        state = self.state
        if self.steps:  # an interval without steps (after the last log line) trained nothing
            state.train_seconds += seconds
        state.samples += int(samples)
        state.interval_loss_shares, state.interval_steps, state.interval_samples = 0.0, 0, 0
        state.interval_by_rank = []
        return ({"loss": loss_sum / max(self.steps, 1), "steps": self.steps,
                 "qps": samples / seconds if seconds else 0.0, "samples": int(samples), "seconds": seconds,
                 "eval_seconds": eval_seconds, "checkpoint_seconds": checkpoint_seconds}, due > 0)
