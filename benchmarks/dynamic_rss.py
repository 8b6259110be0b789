"""Peak memory of a dynamic table, run alone in a fresh process by ``neorec bench dynamic``:
``python -m neorec.benchmarks.dynamic_rss DISTINCT CAPACITY DIM`` streams ``DISTINCT``
distinct raw ids, each seen twice (admitted at the second sighting), through the training
remap of a table of ``CAPACITY`` slots (evicting least recently used ones and
re-initialising their rows), and prints one JSON object: its RSS before the table existed
(after the imports and the kernels' compilation), its peak RSS from then on (the peak is
reset first, Linux ``/proc/self/clear_refs``), and the bytes of the table's rows, map and
sketch."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from neorec.common.hashing import splitmix64
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection

BATCH_IDS = 1 << 16


def rss_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, from ``/proc/self/status``."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(distinct: int, capacity: int, dim: int) -> dict[str, int]:
    warm = DynamicTable("warm", 0, dim, DynamicTableConfig(capacity=2, min_count=2, sketch_width=2))
    warm.train_ids(np.arange(4, dtype=np.int64))  # compile (or load) the kernels before measuring
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak starts again from the current RSS
    before = rss_bytes("VmRSS")
    table = DynamicTable("t", 0, dim, DynamicTableConfig(capacity=capacity, min_count=2))
    optimizer = SparseOptimizer("rowwise_adagrad", 0.05)
    fused = FusedEmbeddingBagCollection([TableConfig("t", table.rows, dim, ("f",))], optimizer, seed=0)
    module = DynamicEmbeddings(fused, [table], seed=0).train()
    rows_bytes = sum(v.weight.numel() * v.weight.element_size() + sum(s.numel() * 4 for s in v.states)
                     for v in fused.shard_views())
    for start in range(0, distinct, BATCH_IDS // 2):
        fresh = splitmix64(np.arange(start, min(start + BATCH_IDS // 2, distinct), dtype=np.uint64)).view(np.int64)
        ids = np.concatenate([fresh, fresh])
        sparse = KeyedJaggedTensor(("f",), torch.ones(ids.size, dtype=torch.int32), torch.from_numpy(ids))
        module.remap(sparse)  # (a training remap: the module trains and grad is enabled)
    peak = rss_bytes("VmHWM")
    bound = rows_bytes + table.map.nbytes + table.sketch.nbytes
    return {"distinct_ids": distinct, "capacity": capacity, "dim": dim, "batch_ids": BATCH_IDS,
            "peak_rss_bytes": peak, "rss_before_table_bytes": before, "growth_bytes": peak - before,
            "rows_bytes": rows_bytes, "map_bytes": table.map.nbytes, "sketch_bytes": table.sketch.nbytes,
            "table_bytes": bound, "growth_beyond_table_bytes": peak - before - bound, **table.counters()}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
