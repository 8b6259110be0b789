"""Where a rank computes, and the few calls that exist only on CUDA.

Everything CUDA-specific the trainer does is here: choosing this rank's GPU, making it
current, and copying host batches to it from pinned memory on a side stream. On the CPU
the same functions run and do nothing device-specific, so the rest of the trainer has one
code path for both.
"""

from __future__ import annotations

from typing import Sequence

import torch

from neorec.common.errors import UserError


class DeviceError(UserError, ValueError):
    """The device a config or launch asks for does not exist or cannot be shared."""

    lasting = True


def cuda_devices() -> int:
    """GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(kind: str, local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """This rank's device: ``cpu``; ``cuda`` (GPU number ``local_rank`` of this host); or
    ``auto`` (CUDA when there is a GPU, else the CPU).

    Two ranks never share a GPU (NCCL cannot run two ranks of a group on one device):
    more ranks on this host than GPUs it sees is a :class:`DeviceError` naming both counts.
    """
    if kind not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"train.device: one of auto, cpu, cuda, got {kind!r}")
    gpus = cuda_devices()
    if kind == "auto":
        kind = "cuda" if gpus else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if gpus == 0:
        raise DeviceError("train.device is cuda, but torch sees no CUDA device")
    if local_world_size > gpus or local_rank >= gpus:
        raise DeviceError(f"{local_world_size} ranks on this host but {gpus} visible GPUs: each rank needs a GPU of "
                          f"its own (start --nproc {gpus} or fewer per node, or set CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


def make_current(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class HostToDevice:
    """Copies host tensors to ``device``: from pinned (page-locked) memory, on a CUDA side
    stream of their own, so that the batches the background batch thread copies overlap the
    steps the training thread runs. The copying thread waits for its copies to land (the
    training thread never does) and the tensors are marked as used by the compute stream, so
    their memory is not reused while a step reads them. On the CPU the tensors come back as
    they are."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if self._stream is None:
            return [None if t is None else t.to(self.device) for t in tensors]
        compute = torch.cuda.default_stream(self.device)
        with torch.cuda.stream(self._stream):
            moved = [None if t is None else t.pin_memory().to(self.device, non_blocking=True) for t in tensors]
        self._stream.synchronize()
        for t in moved:
            if t is not None:
                t.record_stream(compute)
        return moved
