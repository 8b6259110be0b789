"""Baselines with the fused module's interface (same tables, same output layout):

- one ``nn.EmbeddingBag(sparse=True)`` per table, the plain-PyTorch reference, trained with a
  separate ``torch.optim`` optimizer over sparse gradients (tests compare the fused kernels
  against it, benchmarks use it as a baseline);
- FBGEMM's table-batched embedding on the CPU (an optional extra), the baseline TorchRec
  users run.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

import torch
from torch import nn

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import TableConfig
from neorec.trainer.embedding.memory import huge_page_empty


class EmbeddingBagCollectionReference(nn.Module):
    """Pooled float32 ``[B, sum of feature dims]``, features ordered table by table."""

    def __init__(self, tables: Sequence[TableConfig], weights: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.tables = tuple(tables)
        self.bags = nn.ModuleDict()
        for i, t in enumerate(tables):
            bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, sparse=True)
            if weights is not None:
                with torch.no_grad():
                    bag.weight.copy_(weights[i])
            self.bags[t.name] = bag
        self.feature_names = tuple(f for t in tables for f in t.feature_names)

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        batch_size = sparse.batch_size
        offsets = sparse.offsets()
        outputs = []
        for t in self.tables:
            for feature in t.feature_names:
                f = sparse.keys.index(feature)
                lo, hi = offsets[f * batch_size], offsets[(f + 1) * batch_size]
                bag_offsets = offsets[f * batch_size : (f + 1) * batch_size] - lo
                weights = None if sparse.weights is None else sparse.weights[lo:hi]
                outputs.append(self.bags[t.name](sparse.values[lo:hi], bag_offsets, per_sample_weights=weights))
        return torch.cat(outputs, dim=1)


FBGEMM_OPTIMIZERS = {"rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD"}
"""Our sparse optimizers and FBGEMM's equivalents on the CPU (it has no CPU Adam)."""


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """FBGEMM logs every library it loads and every module's arguments at INFO on the root
    logger (which the CLI sets to INFO): raised to WARNING meanwhile."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.setLevel(level)


def fbgemm_missing() -> str | None:
    """Why FBGEMM's CPU embedding kernels cannot run here, or None when they can."""
    try:
        with _quiet_root_logger():
            import fbgemm_gpu  # noqa: F401  (registers the torch ops)
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
                SplitTableBatchedEmbeddingBagsCodegen)
    except (ImportError, OSError, RuntimeError) as err:
        return (f"fbgemm-gpu-cpu is not installed ({err}): pip install 'neorec[bench]' (in a checkout: "
                "pip install -e '.[bench]')")
    return None


class FbgemmTableBatched(nn.Module):
    """FBGEMM's table-batched embedding (``SplitTableBatchedEmbeddingBagsCodegen``) on the
    CPU, one feature per table, sum pooling, started from ``weights`` (float32 ``[rows,
    dim]`` per table); the optimizer update runs in its backward, as ours does. Same
    output layout as :class:`~neorec.trainer.embedding.fused.FusedEmbeddingBagCollection`.

    Its weights and optimizer state are moved onto transparent huge pages, as the fused
    module's are: FBGEMM does not ask for them, so on a host whose huge pages are
    ``madvise`` only its random row reads would also miss the TLB, and a comparison would
    measure page sizes rather than kernels (FBGEMM ran 13–27% slower so here: BENCHMARKS.md)."""

    def __init__(self, tables: Sequence[TableConfig], weights: Sequence[torch.Tensor], optimizer: str,
                 learning_rate: float, eps: float, weight_dtype: str = "fp32") -> None:
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                             SplitTableBatchedEmbeddingBagsCodegen)

        if any(len(t.feature_names) != 1 for t in tables):
            raise ValueError("one feature per table")
        with _quiet_root_logger():
            self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=[(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
                                 for t in tables],
                optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer]), learning_rate=learning_rate,
                eps=eps, weights_precision=SparseType.FP16 if weight_dtype == "fp16" else SparseType.FP32,
                pooling_mode=PoolingMode.SUM, device="cpu")
        with torch.no_grad():
            for target, source in zip(self.tbe.split_embedding_weights(), weights):
                target.copy_(source)
            for name in ("weights_host", "momentum1_host", "momentum2_host"):
                tensor = getattr(self.tbe, name, None)
                if tensor is not None:
                    _onto_huge_pages(tensor)

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.tbe(sparse.values, sparse.offsets())

    def table_weights(self) -> list[torch.Tensor]:
        return [w.float() for w in self.tbe.split_embedding_weights()]


def _onto_huge_pages(tensor: torch.Tensor) -> None:
    """Move ``tensor``'s elements into a copy on transparent huge pages (``huge_page_empty``),
    in place: whatever holds the tensor sees the new storage."""
    if tensor.numel() == 0:
        return
    moved = huge_page_empty(tensor.numel(), tensor.dtype).view(tensor.shape)
    moved.copy_(tensor)
    tensor.data = moved
