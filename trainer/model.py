"""DLRM (Naumov et al., 2019): bottom MLP, dot interaction with the pooled embeddings,
top MLP."""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import nn

from neorec.trainer.batch import Batch


MLP_INITS = ("normal", "uniform")


class MLP(nn.Sequential):
    """Linear layers ``sizes[0] → sizes[1] → …`` with ReLU between them (and after the last
    unless ``last_relu=False``), initialised from ``generator``:

    - ``normal``, as the DLRM reference: weights ``N(0, sqrt(2 / (fan_in + fan_out)))``,
      biases ``N(0, sqrt(1 / fan_out))``;
    - ``uniform``, PyTorch's ``nn.Linear`` default (as TorchRec's MLPs): weights Kaiming-
      uniform with ``a = sqrt(5)``, biases ``U(±1 / sqrt(fan_in))``.
    """

    def __init__(self, sizes: Sequence[int], generator: torch.Generator, last_relu: bool = True,
                 init: str = "uniform") -> None:
        if init not in MLP_INITS:
            raise ValueError(f"init must be one of {MLP_INITS}, got {init!r}")
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            # a layer of no inputs (no dense features): nothing to draw, say nothing (catch_warnings
            # is process-wide: models are built on one thread)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
                linear = nn.Linear(fan_in, fan_out)
            with torch.no_grad():
                if init == "normal":
                    linear.weight.normal_(0.0, (2.0 / (fan_in + fan_out)) ** 0.5, generator=generator)
                    linear.bias.normal_(0.0, (1.0 / fan_out) ** 0.5, generator=generator)
                elif fan_in > 0:  # (a layer of no inputs has no weights to draw)
                    nn.init.kaiming_uniform_(linear.weight, a=5**0.5, generator=generator)
                if init != "normal":
                    bound = fan_in**-0.5 if fan_in > 0 else 0.0  # no inputs (no dense features): zero bias
                    nn.init.uniform_(linear.bias, -bound, bound, generator=generator)
            layers.append(linear)
            if last_relu or i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class DotInteraction(nn.Module):
    """``[B, D]`` dense output and ``[B, F * D]`` pooled embeddings → ``[B, D + (F+1)F/2]``:
    the dense output followed by the pairwise dot products of all ``F + 1`` vectors (the
    dense one first), in the DLRM reference's order: the strictly lower triangle row by row,
    ``(1, 0), (2, 0), (2, 1), (3, 0), …``. (TorchRec's DLRM takes the same pairs as the upper
    triangle row by row, ``(0, 1), (0, 2), …``: its top MLP's first layer reads them in
    another order.)"""

    def __init__(self, num_sparse: int) -> None:
        super().__init__()
        self.num_sparse = num_sparse
        count = num_sparse + 1
        rows, cols = torch.tril_indices(count, count, offset=-1)
        # each pair's place (i, j) in the flattened [F+1, F+1] products; and each place's
        # pair, (i, j) and (j, i) alike, with the diagonal's places given the index P
        self.register_buffer("pairs", rows * count + cols, persistent=False)
        pair_of_place = torch.full((count * count,), rows.numel(), dtype=torch.int64)
        pair_of_place[rows * count + cols] = pair_of_place[cols * count + rows] = torch.arange(rows.numel())
        self.register_buffer("pair_of_place", pair_of_place, persistent=False)
        self.output_dim_extra = rows.numel()

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        batch_size, dim = dense.shape
        if pooled.shape != (batch_size, self.num_sparse * dim):
            raise ValueError(f"the interaction takes pooled embeddings [{batch_size}, {self.num_sparse} features x "
                             f"{dim}], got {list(pooled.shape)}")
        return _PairwiseDots.apply(dense, pooled, self.pairs, self.pair_of_place)


class _PairwiseDots(torch.autograd.Function):
    """:class:`DotInteraction`'s output from the vectors ``V`` float ``[B, F+1, D]`` (the
    dense one first). The products ``V Vᵀ`` are symmetric, so their gradient with respect
    to ``V`` is one product, ``(G + Gᵀ) V``, with ``G`` the pairs' gradient placed in the
    lower triangle: ``G + Gᵀ`` is one gather of the pairs' gradient (and a zero for the
    diagonal), where autograd's ``bmm`` backward would take two products and add them, and
    a gather's backward would accumulate into ``G`` (``index_add``) where each place takes
    one value. The embeddings' gradient is a slice of ``V``'s, not a copy."""

    @staticmethod
    def forward(ctx, dense: torch.Tensor, pooled: torch.Tensor, pairs: torch.Tensor,
                pair_of_place: torch.Tensor) -> torch.Tensor:
        batch_size, dim = dense.shape
        vectors = torch.cat([dense.unsqueeze(1), pooled.view(batch_size, pooled.shape[1] // dim, dim)], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        ctx.save_for_backward(vectors, pair_of_place)
        return torch.cat([dense, products.flatten(1).index_select(1, pairs)], dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the saved vectors are no function of the inputs)
    def backward(ctx, grad: torch.Tensor):
        vectors, pair_of_place = ctx.saved_tensors
        batch_size, count, dim = vectors.shape
        symmetric = nn.functional.pad(grad[:, dim:], (0, 1)).index_select(1, pair_of_place)  # [B, (F+1)^2]
        grad_vectors = torch.bmm(symmetric.view(batch_size, count, count), vectors)
        grad_dense = grad_vectors[:, 0] + grad[:, :dim]
        return grad_dense, grad_vectors[:, 1:].reshape(batch_size, (count - 1) * dim), None, None


class DLRM(nn.Module):
    """Click logits float32 ``[B]`` from a :class:`Batch`.

    ``embeddings`` maps the batch's :class:`KeyedJaggedTensor` to pooled float32
    ``[B, num_sparse * embedding_dim]`` (the fused module, a sharded one, or a reference).
    ``bottom_mlp`` and ``top_mlp`` are the output sizes of every layer, as TorchRec's
    ``DenseArch``/``OverArch`` and the DLRM reference write them: the bottom stack ends with
    ``embedding_dim``, the top stack with 1.
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
        init: str = "uniform",
    ) -> None:
        super().__init__()
        if not bottom_mlp or bottom_mlp[-1] != embedding_dim:
            raise ValueError(f"the bottom MLP must end with the embedding dimension {embedding_dim}, got {list(bottom_mlp)}")
        if not top_mlp or top_mlp[-1] != 1:
            raise ValueError(f"the top MLP must end with one output, got {list(top_mlp)}")
        width = getattr(embeddings, "output_dim", None)
        if width is not None and width != num_sparse * embedding_dim:
            raise ValueError(f"the embeddings pool {width} columns, num_sparse * embedding_dim is "
                             f"{num_sparse} * {embedding_dim} = {num_sparse * embedding_dim}")
        generator = torch.Generator().manual_seed(seed)
        self.bottom = MLP([num_dense, *bottom_mlp], generator, init=init)
        self.embeddings = embeddings
        self.interaction = DotInteraction(num_sparse)
        top_in = embedding_dim + self.interaction.output_dim_extra
        self.top = MLP([top_in, *top_mlp], generator, last_relu=False, init=init)

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
