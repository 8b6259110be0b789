"""DLRM (Naumov et al., 2019): bottom MLP, dot interaction with the pooled embeddings,
top MLP."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from trainer.batch import Batch


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (and after the last unless ``last_relu=False``),
    initialised as the DLRM reference: weights ``N(0, sqrt(2 / (fan_in + fan_out)))``,
    biases ``N(0, sqrt(1 / fan_out))``."""

    def __init__(self, sizes: Sequence[int], generator: torch.Generator, last_relu: bool = True) -> None:
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            linear = nn.Linear(fan_in, fan_out)
            with torch.no_grad():
                linear.weight.normal_(0.0, (2.0 / (fan_in + fan_out)) ** 0.5, generator=generator)
                linear.bias.normal_(0.0, (1.0 / fan_out) ** 0.5, generator=generator)
            layers.append(linear)
            if last_relu or i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class DotInteraction(nn.Module):
    """``[B, D]`` dense output and ``[B, F * D]`` pooled embeddings → ``[B, D + (F+1)F/2]``:
    the dense output followed by the pairwise dot products of all ``F + 1`` vectors
    (strictly lower triangle)."""

    def __init__(self, num_sparse: int) -> None:
        super().__init__()
        rows, cols = torch.tril_indices(num_sparse + 1, num_sparse + 1, offset=-1)
        # positions in the flattened [F+1, F+1] products: a gather whose backward is an
        # index_add (advanced indexing's backward is a much slower accumulating index_put)
        self.register_buffer("pairs", rows * (num_sparse + 1) + cols, persistent=False)
        self.output_dim_extra = rows.numel()

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        batch_size, dim = dense.shape
        vectors = torch.cat([dense.unsqueeze(1), pooled.view(batch_size, -1, dim)], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([dense, products.flatten(1).index_select(1, self.pairs)], dim=1)


class DLRM(nn.Module):
    """Click logits float32 ``[B]`` from a :class:`Batch`.

    ``embeddings`` maps the batch's :class:`KeyedJaggedTensor` to pooled float32
    ``[B, num_sparse * embedding_dim]`` (the fused module, a sharded one, or a reference).
    """

    def __init__(
        self,
        *,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        embeddings: nn.Module,
        seed: int = 0,
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.bottom = MLP([num_dense, *bottom_mlp, embedding_dim], generator)
        self.embeddings = embeddings
        self.interaction = DotInteraction(num_sparse)
        top_in = embedding_dim + self.interaction.output_dim_extra
        self.top = MLP([top_in, *top_mlp, 1], generator, last_relu=False)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters of the MLPs (trained by a dense optimizer, data parallel)."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def forward(self, batch: Batch) -> torch.Tensor:
        # embeddings first: autograd runs the later branch first, so the bottom MLP's
        # backward completes the dense gradients (and a sharded run's all-reduce starts)
        # before the embeddings' backward
        pooled = self.embeddings(batch.sparse)
        dense = self.bottom(batch.dense)
        return self.top(self.interaction(dense, pooled)).squeeze(1)
