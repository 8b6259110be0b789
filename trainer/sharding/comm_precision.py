"""Reduced-precision communication: float32 tensors sent as fp16 or bf16 (half the bytes on
the wire) and widened back to float32 on arrival.

Values beyond the narrow type's range saturate at its largest finite value (an fp16
gradient of 1e6 arrives as 65504, never as inf); NaN stays NaN. Used for the pooled
embeddings' all-to-all (``forward``), its gradient and the MLP gradient sums (``backward``)
as ``sharding.comm_precision`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from neorec.trainer.sharding.collectives import all_to_all

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CommPrecision:
    """The wire type of the forward all-to-all and of the backward's gradients."""

    forward: str = "fp32"
    backward: str = "fp32"

    def __post_init__(self) -> None:
        for name in (self.forward, self.backward):
            if name not in PRECISIONS:
                raise ValueError(f"communication precision must be one of {', '.join(PRECISIONS)}, got {name!r}")


FULL = CommPrecision()


def encode(tensor: torch.Tensor, precision: str) -> torch.Tensor:
    """``tensor`` (float32) in the wire type ``precision``, saturated to its range."""
    dtype = PRECISIONS[precision]
    if dtype == torch.float32:
        return tensor
    largest = torch.finfo(dtype).max
    return tensor.clamp(-largest, largest).to(dtype)


def decode(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float32)


def all_to_all_in(values: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], precision: str,
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`~neorec.trainer.sharding.collectives.all_to_all` of float32 ``values`` sent as ``precision``."""
    return decode(all_to_all(encode(values, precision), send_sizes, receive_sizes, group))


def sum_in(tensor: torch.Tensor, precision: str, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` summed over the ranks with every message in ``precision``: a reduce-scatter
    (each rank sums its slice of every rank's copy, in rank order, in float32) and an
    all-gather of the sums, both as all-to-alls. Bit-identical on every rank; on the wire
    half of a float32 ring all-reduce's bytes."""
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    sizes = [len(part) for part in torch.tensor_split(torch.arange(flat.numel()), world)]
    me = dist.get_rank(group)
    slices = all_to_all_in(flat, sizes, [sizes[me]] * world, precision, group).view(world, sizes[me])
    mine = slices.sum(0)  # every rank's copy of my slice, added in rank order
    return all_to_all_in(mine.repeat(world), [sizes[me]] * world, sizes, precision, group).view_as(tensor)


class Passenger(Protocol):
    """A 1-D float32 tensor that every rank sends, whole, to every rank in the same
    all-to-all as another collective's data, once it is complete: one collective, and one
    wait for the slowest rank, fewer (the dense gradients riding with the pooled
    embeddings' gradients: :class:`~neorec.trainer.distributed.DenseGradientSum`)."""

    def boarding(self, precision: str, group: dist.ProcessGroup | None) -> torch.Tensor | None:
        """The tensor to send now in ``precision`` over ``group``, or None (not complete yet,
        or it must travel another way)."""

    def arrived(self, copies: torch.Tensor) -> None:
        """Every rank's tensor, float32 ``[world, numel]`` in rank order."""


def all_to_all_carrying(values: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], passenger: torch.Tensor,
                        precision: str, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`all_to_all_in` of ``values`` with the 1-D ``passenger`` appended to every
    rank's piece: the pieces received (as :func:`all_to_all_in` returns them) and every
    rank's passenger, ``[world, passenger.numel()]`` in rank order."""
    riders = passenger.numel()
    sent = torch.cat([part for piece in torch.split(values, send_sizes) for part in (piece, passenger)])
    received = all_to_all_in(sent, [size + riders for size in send_sizes], [size + riders for size in receive_sizes],
                             precision, group)
    parts = torch.split(received, [part for size in receive_sizes for part in (size, riders)])
    return torch.cat(parts[0::2]), torch.stack(parts[1::2])


class AllToAllIn(torch.autograd.Function):
    """:class:`~neorec.trainer.sharding.collectives.AllToAll` with its forward sent in one
    precision and its gradient in another; a :class:`Passenger` rides with the gradient
    when it boards."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
                group: dist.ProcessGroup | None, precision: CommPrecision, passenger: Passenger | None = None) -> torch.Tensor:
        ctx.sizes = (send_sizes, receive_sizes, group, precision, passenger)
        return all_to_all_in(values, send_sizes, receive_sizes, precision.forward, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_sizes, receive_sizes, group, precision, passenger = ctx.sizes
        riding = None if passenger is None else passenger.boarding(precision.backward, group)
        if riding is None:
            return all_to_all_in(grad, receive_sizes, send_sizes, precision.backward, group), None, None, None, None, None
        grad_in, copies = all_to_all_carrying(grad, receive_sizes, send_sizes, riding, precision.backward, group)
        passenger.arrived(copies)
        return grad_in, None, None, None, None, None
