"""The trainer's batch: dense features, labels and a keyed jagged block of sparse ids."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from neorec.ingest.batch import HostBatch, Provenance


@dataclass
class KeyedJaggedTensor:
    """Sparse ids of ``F`` features for ``B`` samples, lengths not offsets, feature-major.

    Attributes:
        keys: feature names, in block order.
        lengths: int32 ``[F * B]``: ``lengths[f * B + b]`` ids for sample ``b`` of feature ``f``.
        values: int64 ``[sum(lengths)]``.
        weights: optional float32 ``[sum(lengths)]`` per-id weights.
    """

    keys: tuple[str, ...]
    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Check the invariants the kernels rely on (``TypeError`` for a wrong type or
        dtype, ``ValueError`` for a wrong shape or inconsistent lengths): O(1) checks and
        one reduction over ``lengths``. Non-contiguous tensors are made contiguous."""
        if isinstance(self.keys, str):
            raise TypeError(f"keys is a sequence of feature names, got the string {self.keys!r}")
        self.keys = tuple(self.keys)
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"a feature appears twice in the keys {self.keys}")
        for name, tensor, dtype in (("lengths", self.lengths, torch.int32), ("values", self.values, torch.int64),
                                    ("weights", self.weights, torch.float32)):
            if name == "weights" and tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype != dtype:
                raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
            if tensor.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
        self.lengths, self.values = self.lengths.contiguous(), self.values.contiguous()
        if self.weights is not None:
            self.weights = self.weights.contiguous()
            if self.weights.numel() != self.values.numel():
                raise ValueError(f"{self.weights.numel()} weights for {self.values.numel()} values")
        if (self.lengths.numel() % len(self.keys) if self.keys else self.lengths.numel()):
            raise ValueError(f"{self.lengths.numel()} lengths do not split into {len(self.keys)} features")
        if self.lengths.numel():
            low, total = torch.stack([self.lengths.min().to(torch.int64), self.lengths.sum(dtype=torch.int64)]).tolist()
            if low < 0:
                raise ValueError(f"lengths must be >= 0, got {low}")
            if total != self.values.numel():
                raise ValueError(f"the lengths add up to {total} ids, values holds {self.values.numel()}")
        elif self.values.numel():
            raise ValueError(f"no lengths for {self.values.numel()} values")

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def positions_of(self, features: tuple[str, ...]) -> list[int]:
        """Index in :attr:`keys` of each of ``features``; ``KeyError`` naming a missing one."""
        missing = [f for f in features if f not in self.keys]
        if missing:
            raise KeyError(f"the batch has no feature {missing[0]!r} (it has {list(self.keys)})")
        return [self.keys.index(f) for f in features]

    def with_values(self, values: torch.Tensor) -> "KeyedJaggedTensor":
        """This block with ``values`` (int64, as many as it holds) in place of its ids: the
        lengths, already checked, are not checked again."""
        return self.copied_to(self.lengths, values, self.weights)

    def offsets(self) -> torch.Tensor:
        """int64 ``[F * B + 1]``: bag ``i`` is ``values[offsets[i]:offsets[i+1]]``."""
        offsets = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
        torch.cumsum(self.lengths, dim=0, out=offsets[1:])
        return offsets

    def to(self, device: torch.device) -> "KeyedJaggedTensor":
        return self.copied_to(self.lengths.to(device, non_blocking=True), self.values.to(device, non_blocking=True),
                              None if self.weights is None else self.weights.to(device, non_blocking=True))

    def copied_to(self, lengths: torch.Tensor, values: torch.Tensor,
                  weights: torch.Tensor | None) -> "KeyedJaggedTensor":
        """This block with copies of its tensors (e.g. on a device: same dtypes and
        shapes, ``ValueError`` otherwise). The invariants were checked when the block was
        made, so the copies' lengths are not read again (on a GPU that read would wait for
        the copies and for every kernel queued before them)."""
        for name, copied, original in (("lengths", lengths, self.lengths), ("values", values, self.values),
                                       ("weights", weights, self.weights)):
            if (copied is None) != (original is None) or copied is not None and \
                    (copied.dtype != original.dtype or copied.shape != original.shape):
                raise ValueError(f"{name}: a copy must keep the dtype and shape of {name}, {_described(original)}; "
                                 f"got {_described(copied)}")
        block = copy.copy(self)
        block.lengths, block.values, block.weights = lengths.contiguous(), values.contiguous(), \
            None if weights is None else weights.contiguous()
        return block


def _described(tensor: torch.Tensor | None) -> str:
    return "None" if tensor is None else f"{tensor.dtype} of shape {tuple(tensor.shape)}"


@dataclass
class DistributedSparse:
    """A rank's sparse input after the input all-to-all of a sharded collection
    (:mod:`neorec.trainer.sharding`): the local module's input for the global batch, and the rank's
    own int32 ``[F, B]`` bag lengths (collection feature order)."""

    local: KeyedJaggedTensor
    lengths: torch.Tensor
    batch_size: int


@dataclass
class Batch:
    """``B`` samples: ``dense`` float32 ``[B, num_dense]``, ``labels`` float32 ``[B]``,
    ``sparse`` ids; samples ``[num_valid, B)`` are padding.

    In a sharded run ``sparse`` may be the ids already sent to the ranks that hold their
    rows (a :class:`DistributedSparse`).
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor | DistributedSparse
    labels: torch.Tensor
    num_valid: int
    provenance: Provenance | None = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device) -> "Batch":
        """The batch on ``device`` (itself when it is there already)."""
        if self.labels.device == torch.device(device):
            return self
        if not isinstance(self.sparse, KeyedJaggedTensor):
            raise TypeError("move a batch to its device before its ids are distributed")
        return replace(self, dense=self.dense.to(device, non_blocking=True), sparse=self.sparse.to(device),
                       labels=self.labels.to(device, non_blocking=True))

    def moved(self, move: Callable[[Sequence[torch.Tensor | None]], list[torch.Tensor | None]]) -> "Batch":
        """The batch with its tensors passed through ``move`` (e.g. a
        :class:`~neorec.trainer.device.HostToDevice`), before its ids are distributed."""
        if not isinstance(self.sparse, KeyedJaggedTensor):
            raise TypeError("move a batch to its device before its ids are distributed")
        sparse = self.sparse
        dense, labels, lengths, values, weights = move([self.dense, self.labels, sparse.lengths, sparse.values,
                                                        sparse.weights])
        return replace(self, dense=dense, labels=labels, sparse=sparse.copied_to(lengths, values, weights))

    @classmethod
    def from_host(cls, host: HostBatch) -> "Batch":
        """Wrap a host batch's arrays without copying.

        The arrays may be read-only (batches from the reader services are views of the
        received message); a batch is an input nothing writes to, so torch's warning
        about non-writable arrays is silenced here rather than paid for with a copy.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            weights = None if host.weights is None else torch.from_numpy(host.weights)
            return cls(
                dense=torch.from_numpy(host.dense),
                sparse=KeyedJaggedTensor(host.keys, torch.from_numpy(host.lengths), torch.from_numpy(host.values),
                                         weights),
                labels=torch.from_numpy(host.labels),
                num_valid=host.num_valid,
                provenance=host.provenance,
            )
