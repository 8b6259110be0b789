"""The trainer's view of ``torch.distributed``: the process group torchrun set up, the data
parallel gradient sum of the dense layers, the few collectives the train loop needs, and
heartbeats that name a rank gone silent when a collective times out."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from neorec.trainer.device import make_current, resolve_device
from neorec.trainer.sharding.collectives import goes_whole, start_sum
from neorec.trainer.sharding.comm_precision import sum_in

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedContext:
    """Rank ``rank`` of ``world_size`` (``local_world_size`` of them on this host, where it
    is ``local_rank``), computing on ``device``; a world of one has no process group."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    heartbeat: "Heartbeat | None" = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE_PROCESS = DistributedContext()
HEARTBEAT_INTERVAL_S = 1.0


def single_process(device_kind: str = "auto") -> DistributedContext:
    return DistributedContext(device=resolve_device(device_kind))


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def init_from_torchrun(device_kind: str = "auto", timeout_s: float = 300.0) -> DistributedContext:
    """Join the process group torchrun describes in the environment: NCCL on CUDA, gloo on
    the CPU. A collective that waits more than ``timeout_s`` for another rank fails."""
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = resolve_device(device_kind, local_rank, local_world_size)
    make_current(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    heartbeat = Heartbeat(dist.get_rank(), dist.get_world_size())
    return DistributedContext(dist.get_rank(), dist.get_world_size(), local_world_size, local_rank, device, heartbeat)


COLLECTIVE_SETTLE_S = 0.2
"""How long :func:`shutdown` leaves the GIL to gloo's worker threads before the process
goes on to exit."""


def shutdown(context: DistributedContext) -> None:
    """Stop the heartbeat and leave the process group.

    A gloo worker thread drops its last reference to a finished collective's tensors after
    the caller has returned from it, and when Python no longer holds them that needs the
    GIL. If the interpreter is already finalizing, the thread is ended inside a destructor
    that cannot unwind, and the process aborts ("terminate called without an active
    exception") after a run that succeeded. Sleeping releases the GIL, so the workers
    finish that while the interpreter is whole.
    """
    if context.heartbeat is not None:
        context.heartbeat.stop()
    if context.distributed and dist.is_initialized():
        time.sleep(COLLECTIVE_SETTLE_S)
        dist.destroy_process_group()


class Heartbeat:
    """Every rank writes the time to torchrun's rendezvous store every second, from a thread
    of its own; a rank whose heartbeat is old has stopped (SIGSTOP) or hung. The store is a
    second client of the one torchrun serves (``MASTER_ADDR:MASTER_PORT``), so it answers
    while the ranks' collectives are stuck."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=30))
        self._store = dist.PrefixStore(f"neorec/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', '')}", store)
        self._stopping = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        self._store.set(str(self.rank), repr(time.time()))

    def _run(self) -> None:
        while not self._stopping.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._beat()
            except (RuntimeError, OSError):  # the store went away: the job is ending
                return

    def silent_ranks(self, older_than_s: float) -> dict[int, float]:
        """Ranks whose last heartbeat is older than ``older_than_s`` seconds (or missing),
        with its age in seconds (inf when missing)."""
        now = time.time()
        silent = {}
        for rank in range(self.world_size):
            try:
                age = now - float(self._store.get(str(rank)).decode()) if self._store.check([str(rank)]) else float("inf")
            except (RuntimeError, OSError, ValueError):
                age = float("inf")
            if age > older_than_s:
                silent[rank] = age
        return silent

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


class RankSilentError(RuntimeError):
    """A collective failed because another rank stopped answering; the message names it."""


def explain_collective_failure(context: DistributedContext, error: RuntimeError) -> RuntimeError:
    """``error`` (raised by a collective) with the ranks that went silent named, when some
    did; else ``error`` itself."""
    if context.heartbeat is None:
        return error
    silent = context.heartbeat.silent_ranks(older_than_s=3 * HEARTBEAT_INTERVAL_S)
    silent.pop(context.rank, None)
    if not silent:
        return error
    ages = ", ".join(f"rank {r} ({'never' if a == float('inf') else f'{a:.0f} s ago'})" for r, a in silent.items())
    explained = RankSilentError(f"rank {context.rank}: a collective failed because other ranks went silent (stopped, "
                                f"hung or dead); last heartbeat of {ages}. Cause: {' '.join(str(error).split())[:300]}")
    explained.__cause__ = error
    return explained


class DenseGradientSum:
    """Data parallelism of the dense layers (the MLPs): after each backward, their gradients
    summed over the ranks in one collective.

    Every rank starts from rank 0's parameters (broadcast once, here) and applies the same
    summed gradients, so the ranks' dense layers stay equal. The gradients live in one flat
    ``[sum of numel]`` buffer of the parameters' dtype; each parameter's ``grad`` is a view
    of it that autograd accumulates into, so a step's sum is one collective over the
    buffer: :func:`~neorec.trainer.sharding.collectives.start_sum` (on gloo, small MLPs as
    one all-to-all), or :func:`~neorec.trainer.sharding.comm_precision.sum_in` in reduced
    ``precision``; bit-identical on every rank. The sum *adds* the ranks' gradients: each
    rank's loss is its share of the global mean (its samples' sum over the global sample
    count), so the sum is the gradient of the global mean, as the embedding gradients
    (summed by the output all-to-all) are.

    In a sharded model the sum need not be a collective of its own: the gradients are a
    :class:`~neorec.trainer.sharding.comm_precision.Passenger` of the pooled embeddings'
    backward all-to-all (``ShardedEmbeddingBagCollection.carry_in_backward``). They board
    it when every parameter's gradient is complete by then (DLRM looks its embeddings up
    before its MLPs run, so autograd finishes the MLPs' backward first) and the buffer is
    small enough to go whole (:func:`~neorec.trainer.sharding.collectives.goes_whole`);
    each rank then adds the ``world`` copies in rank order, the same bits as the sum's own
    all-to-all. Every rank decides alike (the graph, and so autograd's order, is the same
    on every rank), as the collective's sizes require. Otherwise :meth:`sum` runs the
    collective after the backward. On 2 ranks sharing 2 cores each wait for the slower
    rank costs more than the bytes: one wait fewer per step is +5 to +26% QPS
    (``neorec train --nproc 2``, BENCHMARKS.md).
    """

    def __init__(self, parameters: list[nn.Parameter], precision: str = "fp32",
                 group: dist.ProcessGroup | None = None) -> None:
        self.parameters = list(parameters)
        dtypes = {p.dtype for p in self.parameters}
        if len(dtypes) != 1:
            raise ValueError(f"the dense parameters must share one dtype to be summed as one buffer, got {dtypes}")
        self.precision = precision
        self.group = group
        first = self.parameters[0]
        self._sizes = [p.numel() for p in self.parameters]
        self.flat = torch.zeros(sum(self._sizes), dtype=first.dtype, device=first.device)
        self._views = [piece.view_as(p) for piece, p in zip(torch.split(self.flat, self._sizes), self.parameters)]
        self._complete = 0
        """Parameters whose gradient autograd completed since :meth:`zero` (each leaf's
        gradient is accumulated once per backward)."""
        self._summed = False
        for p in self.parameters:
            p.register_post_accumulate_grad_hook(self._completed)
        self._broadcast_parameters()
        self.zero()

    def _broadcast_parameters(self) -> None:
        with torch.no_grad():
            values = torch.cat([p.detach().reshape(-1) for p in self.parameters])
            dist.broadcast(values, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
            for p, piece in zip(self.parameters, torch.split(values, self._sizes)):
                p.copy_(piece.view_as(p))

    def zero(self) -> None:
        """Zero the gradients (before a backward), each ``grad`` a view of the buffer again."""
        self.flat.zero_()
        self._complete = 0
        self._summed = False
        for p, view in zip(self.parameters, self._views):
            if p.grad is not view:
                p.grad = view

    def _completed(self, parameter: nn.Parameter) -> None:
        self._complete += 1

    def boarding(self, precision: str, group: dist.ProcessGroup | None) -> torch.Tensor | None:
        """The gradient buffer, when it can ride with a collective in ``precision`` over
        ``group`` now (the :class:`~neorec.trainer.sharding.comm_precision.Passenger` protocol)."""
        complete = self._complete == len(self.parameters) and not self._summed
        same_way = (precision == self.precision and self.flat.dtype == torch.float32
                    and (group or dist.group.WORLD) == (self.group or dist.group.WORLD))
        return self.flat if complete and same_way and goes_whole(self.flat, group) else None

    def arrived(self, copies: torch.Tensor) -> None:
        """Every rank's gradients, ``[world, numel]``: their sum in rank order."""
        torch.sum(copies, 0, out=self.flat)
        self._summed = True

    def sum(self) -> None:
        """Replace the gradients by their sum over the ranks (after a backward), unless they
        rode with the backward's all-to-all."""
        if self._summed:
            return
        self._summed = True
        if self.precision == "fp32":
            summed = start_sum(self.flat, self.group).wait()
        else:
            summed = sum_in(self.flat, self.precision, self.group)
        if summed.data_ptr() != self.flat.data_ptr():
            self.flat.copy_(summed)


def global_sum(context: DistributedContext, values: list[float]) -> list[float]:
    """Each of ``values`` summed over all ranks (float64, one all-reduce)."""
    if not context.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=context.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def check_same_steps(context: DistributedContext, steps: int, what: str) -> None:
    """Raise unless every rank plans ``steps`` steps (a rank with fewer would hang the
    others in a collective)."""
    if not context.distributed:
        return
    everyone = torch.zeros(context.world_size, dtype=torch.int64, device=context.device)
    dist.all_gather_single(everyone, torch.tensor([steps], dtype=torch.int64, device=context.device))
    if len(set(everyone.tolist())) > 1:
        raise RuntimeError(f"ranks plan different numbers of {what} steps: {everyone.tolist()} (rank: steps); "
                           "every rank must run the same number of steps")


def check_same_local_world(context: DistributedContext) -> None:
    """Raise unless every node runs the same number of ranks (the planner's node topology
    and hierarchical sharding assume it)."""
    everyone = torch.zeros(context.world_size, dtype=torch.int64, device=context.device)
    dist.all_gather_single(everyone, torch.tensor([context.local_world_size], dtype=torch.int64,
                                                  device=context.device))
    if len(set(everyone.tolist())) > 1:
        raise RuntimeError(f"nodes run different numbers of ranks ({everyone.tolist()}, LOCAL_WORLD_SIZE by rank): "
                           "start every node with the same --nproc (or set sharding.ranks_per_node)")


def gather_arrays(context: DistributedContext, array: np.ndarray) -> np.ndarray:
    """1-D float64 arrays of every rank concatenated in rank order (lengths may differ)."""
    if not context.distributed:
        return array
    device = context.device
    sizes = torch.zeros(context.world_size, dtype=torch.int64, device=device)
    dist.all_gather_single(sizes, torch.tensor([array.size], dtype=torch.int64, device=device))
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.float64, device=device)
    padded[: array.size] = torch.from_numpy(array.astype(np.float64)).to(device)
    gathered = torch.zeros(context.world_size * longest, dtype=torch.float64, device=device)
    dist.all_gather_single(gathered, padded)
    pieces = gathered.view(context.world_size, longest).cpu()
    return np.concatenate([pieces[r, : int(n)].numpy() for r, n in enumerate(sizes.tolist())])
