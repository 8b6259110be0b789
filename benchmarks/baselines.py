"""One ``nn.EmbeddingBag(sparse=True)`` per table: the plain-PyTorch reference.

It has the fused module's interface (same tables, same output layout) but trains with a
separate ``torch.optim`` optimizer over sparse gradients. Tests compare the fused kernels
against it and benchmarks use it as the baseline.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from trainer.batch import KeyedJaggedTensor
from trainer.embedding_config import TableConfig


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
