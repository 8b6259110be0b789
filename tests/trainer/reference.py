"""Plain-PyTorch references for the fused embedding tests."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig


def random_kjt(tables: list[TableConfig], batch_size: int, rng: np.random.Generator,
               max_len: int = 4, weighted: bool = False) -> KeyedJaggedTensor:
    """Random ids for every feature of ``tables`` (features in a shuffled key order), with
    empty bags and repeated ids; rows drawn from a few hot ids so rows repeat across bags."""
    features = [(f, t) for t in tables for f in t.feature_names]
    order = rng.permutation(len(features))
    keys, lengths, values = [], [], []
    for i in order:
        name, table = features[i]
        keys.append(name)
        n = rng.integers(0, max_len + 1, batch_size)
        n[rng.random(batch_size) < 0.2] = 0
        lengths.append(n)
        hot = rng.integers(0, table.num_embeddings, 3)
        ids = np.where(rng.random(n.sum()) < 0.5, hot[rng.integers(0, 3, n.sum())],
                       rng.integers(0, table.num_embeddings, n.sum()))
        values.append(ids)
    values = np.concatenate(values).astype(np.int64)
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, values.size).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor(tuple(keys), torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
                             torch.from_numpy(values), weights)


def concat_kjts(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Several batches (ranks' batches of one step) as one batch of all their samples, in
    order, with the first batch's key order."""
    keys = kjts[0].keys
    lengths, values, weights = [], [], []
    for key in keys:
        for kjt in kjts:
            b = kjt.batch_size
            f = kjt.positions_of((key,))[0]
            offsets = kjt.offsets()
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            lengths.append(kjt.lengths[f * b : (f + 1) * b])
            values.append(kjt.values[lo:hi])
            if kjt.weights is not None:
                weights.append(kjt.weights[lo:hi])
    return KeyedJaggedTensor(keys, torch.cat(lengths), torch.cat(values), torch.cat(weights) if weights else None)


def reference_pooled(tables: list[TableConfig], weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor) -> torch.Tensor:
    """Pooled outputs with ``nn.functional.embedding_bag`` (autograd to ``weights``)."""
    b = kjt.batch_size
    offsets = kjt.offsets()
    outs = []
    for t in tables:
        for feature in t.feature_names:
            f = kjt.keys.index(feature)
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            bag_offsets = offsets[f * b : (f + 1) * b] - lo
            ids = kjt.values[lo:hi]
            psw = None if kjt.weights is None else kjt.weights[lo:hi]
            if t.pooling == "mean" and psw is not None:
                counts = kjt.lengths[f * b : (f + 1) * b].to(torch.float32)
                psw = psw / torch.repeat_interleave(counts, kjt.lengths[f * b : (f + 1) * b].long())
                mode = "sum"
            else:
                mode = t.pooling
            outs.append(torch.nn.functional.embedding_bag(ids, weights[t.name], bag_offsets, mode=mode,
                                                          per_sample_weights=psw))
    return torch.cat(outs, dim=1)


class ReferenceEmbeddings(nn.Module):
    """:func:`reference_pooled` as a module: one float32 parameter per table (a copy of
    ``weights``), trainable by any ``torch.optim`` optimizer."""

    def __init__(self, tables: list[TableConfig], weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tables = list(tables)
        self.weights = nn.ParameterDict({t.name: nn.Parameter(weights[t.name].detach().clone()) for t in tables})

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return reference_pooled(self.tables, dict(self.weights), kjt)


class ReferenceOptimizer:
    """The sparse optimizers' math on the rows a batch touched, written in torch."""

    def __init__(self, tables: list[TableConfig], opt: SparseOptimizer) -> None:
        self.opt = opt
        self.step = 0
        self.state1 = {}
        self.state2 = {}
        for t in tables:
            width = opt.state_width(t.embedding_dim)
            self.state1[t.name] = torch.zeros(t.num_embeddings, max(width, 1))
            self.state2[t.name] = torch.zeros(t.num_embeddings, max(width, 1))
        self.lr = {t.name: opt.learning_rate if t.learning_rate is None else t.learning_rate for t in tables}

    def apply(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], touched: dict[str, torch.Tensor]):
        self.step += 1
        o = self.opt
        for name, w in weights.items():
            rows = touched[name]
            if rows.numel() == 0:
                continue
            g = grads[name][rows] + o.weight_decay * w[rows]
            lr = self.lr[name]
            if o.kind == "sgd":
                w[rows] -= lr * g
            elif o.kind == "adagrad":
                s = self.state1[name]
                s[rows] = s[rows] * o.adagrad_decay + g * g
                w[rows] -= lr * g / (s[rows].sqrt() + o.eps)
            elif o.kind == "rowwise_adagrad":
                s = self.state1[name]
                s[rows, 0] = s[rows, 0] * o.adagrad_decay + (g * g).mean(dim=1)
                w[rows] -= lr * g / (s[rows].sqrt() + o.eps)
            else:
                m, v = self.state1[name], self.state2[name]
                m[rows] = o.beta1 * m[rows] + (1 - o.beta1) * g
                v[rows] = o.beta2 * v[rows] + (1 - o.beta2) * g * g
                step_size = lr * math.sqrt(1 - o.beta2 ** self.step) / (1 - o.beta1 ** self.step)
                w[rows] -= step_size * m[rows] / (v[rows].sqrt() + o.eps)


def touched_rows(tables: list[TableConfig], kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    b = kjt.batch_size
    offsets = kjt.offsets()
    out = {}
    for t in tables:
        ids = [kjt.values[int(offsets[kjt.keys.index(f) * b]) : int(offsets[(kjt.keys.index(f) + 1) * b])]
               for f in t.feature_names]
        out[t.name] = torch.unique(torch.cat(ids))
    return out
