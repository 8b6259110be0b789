"""Compile every Numba kernel once in this process, before several processes start.

Numba's on-disk cache is not safe when processes compile the same function at the same
time (numba/numba#4807: a process may crash reading a half-written entry). Launchers call
:func:`compile_kernels` first; the processes they start then only load the cache, which
training does before its first step (so that the loading does not fall on the first
steps' timings).
"""

from __future__ import annotations

import numpy as np
import torch

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.sharding.input_dist import SparseAllToAll
from neorec.trainer.sharding.layout import ShardedLayout
from neorec.trainer.sharding.plan import ROW_WISE, Shard, ShardingPlan, TableSharding


def compile_kernels() -> None:
    """Run the lookup, the fused update, the id routing and a dynamic table's id map once
    on a tiny table (the argument types are the ones training uses, so this compiles or
    loads what it will call)."""
    tables = [TableConfig("t", 4, 4, ("a",))]
    kjt = KeyedJaggedTensor(("a",), torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 3]),
                            torch.ones(3))
    module = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", 0.1))
    module(kjt).sum().backward()
    plan = ShardingPlan(1, (TableSharding("t", ROW_WISE, (Shard(0, 0, 4, 0, 4),)),))
    SparseAllToAll(ShardedLayout(tables, plan, rank=0)).route(kjt)
    dynamic = DynamicTable("t", 0, 4, DynamicTableConfig(capacity=1, min_count=2, ttl=1))
    dynamic.train_ids(np.array([0, 0, 1], dtype=np.int64))
    dynamic.map.lookup(np.array([0], dtype=np.int64))
