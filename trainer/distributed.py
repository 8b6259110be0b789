"""The trainer's view of ``torch.distributed``: the process group torchrun set up, the data
parallel wrapping of the dense layers, and the few collectives the train loop needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.sharding.collectives import start_sum

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedContext:
    """Rank ``rank`` of ``world_size`` (``local_world_size`` of them on this host, where it
    is ``local_rank``); a world of one has no process group."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE_PROCESS = DistributedContext()


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def init_from_torchrun(timeout_s: float = 600.0) -> DistributedContext:
    """Join the process group torchrun describes in the environment: NCCL when CUDA is
    present, gloo otherwise."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]),
                              int(os.environ["LOCAL_RANK"]))


def shutdown(context: DistributedContext) -> None:
    if context.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap_data_parallel(model: nn.Module, rank_local: str = "embeddings") -> DistributedDataParallel:
    """``model`` in DDP, except its submodule ``rank_local`` (the sharded embeddings: each
    rank holds different shards, which DDP must neither broadcast nor all-reduce).

    The gradient all-reduce *sums* over ranks: each rank's loss is its share of the global
    mean (its samples' sum over the global sample count), so the sum is the gradient of the
    global mean, as the embedding gradients (summed by the output all-to-all) are.
    """
    local = [f"{rank_local}.{name}" for name, _ in getattr(model, rank_local).named_parameters()]
    local += [f"{rank_local}.{name}" for name, _ in getattr(model, rank_local).named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, local)
    wrapped = DistributedDataParallel(model, forward_sync_buffers=False)
    wrapped.register_comm_hook(None, _sum_gradients)
    return wrapped


def _sum_gradients(state, bucket):  # DDP checks real annotations; these would be strings here
    """DDP communication hook: the future of ``bucket``'s (a ``dist.GradBucket``) buffer
    summed over the ranks (:func:`~trainer.sharding.collectives.start_sum`)."""
    return start_sum(bucket.buffer())


def global_sum(context: DistributedContext, values: list[float]) -> list[float]:
    """Each of ``values`` summed over all ranks (float64, one all-reduce)."""
    if not context.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def check_same_steps(context: DistributedContext, steps: int, what: str) -> None:
    """Raise unless every rank plans ``steps`` steps (a rank with fewer would hang the
    others in a collective)."""
    if not context.distributed:
        return
    everyone = torch.zeros(context.world_size, dtype=torch.int64)
    dist.all_gather_single(everyone, torch.tensor([steps], dtype=torch.int64))
    if len(set(everyone.tolist())) > 1:
        raise RuntimeError(f"ranks plan different numbers of {what} steps: {everyone.tolist()} (rank: steps); "
                           "every rank must run the same number of steps")


def gather_arrays(context: DistributedContext, array: np.ndarray) -> np.ndarray:
    """1-D float64 arrays of every rank concatenated in rank order (lengths may differ)."""
    if not context.distributed:
        return array
    sizes = torch.zeros(context.world_size, dtype=torch.int64)
    dist.all_gather_single(sizes, torch.tensor([array.size], dtype=torch.int64))
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.float64)
    padded[: array.size] = torch.from_numpy(array.astype(np.float64))
    gathered = torch.zeros(context.world_size * longest, dtype=torch.float64)
    dist.all_gather_single(gathered, padded)
    pieces = gathered.view(context.world_size, longest)
    return np.concatenate([pieces[r, : int(n)].numpy() for r, n in enumerate(sizes.tolist())])
