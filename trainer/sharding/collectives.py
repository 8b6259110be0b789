"""Differentiable collectives the sharded module is built from (``torch.distributed``)."""

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
        grad = grad.contiguous()
        gathered = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_single(gathered, grad, group=ctx.group)
        return gathered, None
