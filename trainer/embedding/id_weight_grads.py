"""The gradient of a loss with respect to a batch's per-id weights (``KeyedJaggedTensor.weights``),
as ``nn.EmbeddingBag(per_sample_weights=...)`` and FBGEMM's TBE give it: a feature
processor that learns the weights (position weights, say) trains through it.

A bag pools ``sum_j w_j * row(id_j)`` (divided by its length under mean pooling), so
``d loss / d w_j`` is the dot product of the bag's output gradient with ``row(id_j)``
(divided by the bag's length under mean pooling), the rows as the forward read them: it
is computed before the fused update changes them. Torch ops, on the batch's device.
"""

from __future__ import annotations

import torch

from neorec.trainer.embedding.kernels.torch_ops import TorchTables


def id_weight_grads(weights: torch.Tensor, tables: TorchTables, module_feature_of: torch.Tensor,
                    lengths: torch.Tensor, values: torch.Tensor, batch_size: int,
                    grad_out: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]``: the gradient of each id's weight.

    ``weights``: the module's flat weights (storage dtype), laid out as ``tables`` says;
    ``module_feature_of`` int64 ``[F]``: the module feature of each batch feature (-1:
    none, its ids' gradients are 0, as are those of ids outside their table, which a lookup
    left out); ``lengths`` int32 ``[F * B]``, ``values`` int64 ``[n]``; ``grad_out`` float32
    ``[B, C]``."""
    n = values.numel()
    grads = torch.zeros(n, dtype=torch.float32, device=values.device)
    if n == 0:
        return grads
    bag_lengths = lengths.to(torch.int64)
    bag = torch.repeat_interleave(torch.arange(bag_lengths.numel(), device=values.device), bag_lengths, output_size=n)
    feature_of_id = module_feature_of[bag // batch_size]
    for f, (t, column) in enumerate(zip(tables.feature_table, tables.out_columns)):
        ids = torch.nonzero((feature_of_id == f) & (values >= 0) & (values < tables.rows[t])).squeeze(1)
        if ids.numel() == 0:
            continue
        dim = tables.dims[t]
        elements = tables.table_offsets[t] + values[ids, None] * dim + torch.arange(dim, device=values.device)
        looked_up = weights[elements].to(torch.float32)  # [m, dim]
        upstream = grad_out[bag[ids] % batch_size, column : column + dim]  # [m, dim]
        grad = (looked_up * upstream).sum(dim=1)
        grads[ids] = grad / bag_lengths[bag[ids]].to(torch.float32) if tables.means[t] else grad
    return grads
