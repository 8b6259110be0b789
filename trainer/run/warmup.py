"""Compile every Numba kernel a run uses once in this process, before several processes start.

Numba's on-disk cache is not safe when processes compile the same function at the same
time (numba/numba#4807: a process may crash reading a half-written entry). Launchers call
:func:`compile_kernels` first; the processes they start then only load the cache, which
training does before its first step (so that the loading does not fall on the first
steps' timings).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from neorec.common.hashing import permutation
from neorec.embedding_store.cache import SetAssociativeCache
from neorec.ingest.chunks import compile_decoding
from neorec.ingest.vocab import hash_encode
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.checkpoint.quantize import quantize
from neorec.trainer.config import TrainConfig
from neorec.trainer.embedding.bounds import BoundsCheck
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.embedding.kernels.forward import LANES
from neorec.trainer.run.build import sparse_optimizer
from neorec.trainer.sharding.input_dist import SparseAllToAll
from neorec.trainer.sharding.layout import ShardedLayout
from neorec.trainer.sharding.plan import ROW_WISE, Shard, ShardingPlan, TableSharding


def compile_kernels(config: TrainConfig | None = None) -> None:
    """Run every kernel once on tiny inputs of the types training passes, so that this
    compiles (or loads) what the run will call: the embedding lookups and fused update (of
    ``config``'s weight storage and sparse optimizer; fp32 and SGD without a config), the
    id routing, a dynamic table's id map, the store's cache, checkpoint quantization, string
    hashing, the shuffle's permutation and Parquet decoding (of the usual column types:
    :func:`~neorec.ingest.chunks.compile_decoding`)."""
    _embedding_kernels(config)
    _store_cache_kernels()
    quantize(np.zeros((2, 4), dtype=np.float32), 8)
    hash_encode(pa.array(["a", None, "b"]), rows=4, seed=0)
    permutation(0, 4)
    compile_decoding()


def _embedding_kernels(config: TrainConfig | None) -> None:
    tables = [TableConfig("t", 4, 4, ("a",))]
    kjt = KeyedJaggedTensor(("a",), torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 3]),
                            torch.ones(3))
    optimizer = sparse_optimizer(config) if config is not None else SparseOptimizer("sgd", 0.1)
    weight_dtype = config.model.weight_dtype if config is not None else "fp32"
    module = FusedEmbeddingBagCollection(tables, optimizer, weight_dtype=weight_dtype)
    module(kjt).sum().backward()
    BoundsCheck("fatal", ("a",), ("t",), (4,))(kjt)  # the store-backed collection's up-front pass
    wide = FusedEmbeddingBagCollection([TableConfig("t", 4, LANES, ("a",))], optimizer, weight_dtype=weight_dtype)
    wide(KeyedJaggedTensor(("a",), kjt.lengths, kjt.values)).sum().backward()  # wide pool in registers
    plan = ShardingPlan(1, (TableSharding("t", ROW_WISE, (Shard(0, 0, 4, 0, 4),)),))
    SparseAllToAll(ShardedLayout(tables, plan, rank=0)).route(kjt)
    dynamic = DynamicTable("t", 0, 4, DynamicTableConfig(capacity=1, min_count=2, ttl=1))
    dynamic.train_ids(np.array([0, 0, 1], dtype=np.int64))
    dynamic.map.lookup(np.array([0], dtype=np.int64))


def _store_cache_kernels() -> None:
    for policy in ("lru", "lfu"):
        cache = SetAssociativeCache(64, ways=32, policy=policy)
        rows = np.arange(3, dtype=np.int64)
        cache.admit(rows, 0)
        cache.lookup(rows)
