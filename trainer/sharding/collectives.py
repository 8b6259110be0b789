"""Collectives the sharded module and the data-parallel layers are built from
(``torch.distributed``): all-to-alls, differentiable ones, and sums and gathers that pick
the faster way to run on the process group's backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def all_to_all(values: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send ``values[sum(send_sizes[:r]) : ...]`` (a 1-D tensor) to rank ``r``; return the
    pieces received, rank by rank (``sum(receive_sizes)`` elements). Not differentiable."""
    out = values.new_empty(sum(receive_sizes))
    dist.all_to_all_single(out, values.contiguous(), receive_sizes, send_sizes, group=group)
    return out


@dataclass
class PendingTensor:
    """A tensor an asynchronous collective is filling."""

    tensor: torch.Tensor
    work: dist.Work

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


def start_all_to_all(values: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
                     group: dist.ProcessGroup | None = None) -> PendingTensor:
    """:func:`all_to_all`, started asynchronously."""
    out = values.new_empty(sum(receive_sizes))
    work = dist.all_to_all_single(out, values.contiguous(), receive_sizes, send_sizes, group=group, async_op=True)
    return PendingTensor(out, work)


WHOLE_TENSOR_ALL_TO_ALL_BYTES = 1 << 20
"""On gloo, a sum or gather over ranks whose all-to-all would move at most this many bytes
per rank (the tensor, once per rank) runs as that one all-to-all. Gloo's all-reduce and
all-gather take several rounds of messages, each waking threads on both ends, which small
tensors pay for in latency; for large ones the rounds move fewer bytes and win
(``neorec bench collectives --nproc N`` measures both)."""


def goes_whole(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether a sum or gather of ``tensor`` over ``group`` runs as one all-to-all of the
    whole tensor (see :data:`WHOLE_TENSOR_ALL_TO_ALL_BYTES`)."""
    world = dist.get_world_size(group)
    return (dist.get_backend(group) == dist.Backend.GLOO
            and world * tensor.numel() * tensor.element_size() <= WHOLE_TENSOR_ALL_TO_ALL_BYTES)


def _exchange_whole(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> PendingTensor:
    """Every rank's ``tensor`` to every rank: ``[world, *tensor.shape]`` in rank order."""
    world, numel = dist.get_world_size(group), tensor.numel()
    pending = start_all_to_all(tensor.reshape(-1).repeat(world), [numel] * world, [numel] * world, group)
    return PendingTensor(pending.tensor.view(world, *tensor.shape), pending.work)


def start_all_to_all_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.futures.Future:
    """Start summing ``tensor`` over the ranks as one all-to-all of the whole tensor, each
    rank adding the ``world`` copies in rank order; a future of the sum, bit-identical on
    every rank."""
    pending = _exchange_whole(tensor, group)
    return pending.work.get_future().then(lambda _: pending.tensor.sum(0))


def start_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.futures.Future:
    """Start summing ``tensor`` (same shape and dtype on every rank) over the ranks; a
    future of the sum, bit-identical on every rank. Small tensors on gloo go as
    :func:`start_all_to_all_sum`, others as an all-reduce in place."""
    if goes_whole(tensor, group):
        return start_all_to_all_sum(tensor, group)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[world * tensor.shape[0], ...]``: every rank's ``tensor`` (same shape on every
    rank), in rank order. Small tensors on gloo go as one all-to-all."""
    tensor = tensor.contiguous()
    if goes_whole(tensor, group):
        return _exchange_whole(tensor, group).wait().flatten(0, 1)
    gathered = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(gathered, tensor, group=group)
    return gathered


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` whose backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.sizes = (send_sizes, receive_sizes, group)
        return all_to_all(values, send_sizes, receive_sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_sizes, receive_sizes, group = ctx.sizes
        return all_to_all(grad, receive_sizes, send_sizes, group), None, None, None


class RankSlice(torch.autograd.Function):
    """Rows ``[rank * B, (rank + 1) * B)`` of a ``[world * B, C]`` tensor that every rank
    computed identically (a replicated table's output for the global batch).

    Its gradient is the all-gather of every rank's gradient of its own slice, so each rank's
    copy receives the gradient of the whole global batch, and replicas stay identical.
    """

    @staticmethod
    def forward(ctx, replicated: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        batch = replicated.shape[0] // world
        ctx.group = group
        return replicated[rank * batch : (rank + 1) * batch]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.group), None
