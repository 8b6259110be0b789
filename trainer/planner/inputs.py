"""What the planner plans for: the tables and the machines."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from neorec.trainer.embedding.config import SPARSE_OPTIMIZERS, SparseOptimizer
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.id_map import map_bytes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class TableSpec:
    """One table as the planner sees it.

    ``pooling_factor`` is the mean number of ids per bag of each of its ``num_features``
    features; ``weight_bytes`` 4 for fp32, 2 for fp16/bf16; ``optimizer`` names the fused
    sparse optimizer (its state is float32).
    """

    name: str
    rows: int
    dim: int
    num_features: int = 1
    pooling_factor: float = 1.0
    weight_bytes: int = 4
    optimizer: str = "rowwise_adagrad"
    id_counts: tuple[int, ...] = ()
    """How often each distinct row appeared in a sample of the train split, most frequent
    first (what the planner estimates a store cache's hit rate from); empty: no sample."""
    dynamic: DynamicTableConfig | None = None
    """A dynamic table's settings: its ``rows`` are its capacity and the default row, and
    its id map and admission sketch take :attr:`index_bytes` beside them."""

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0 or self.num_features <= 0:
            raise ValueError(f"table {self.name!r}: rows, dim and num_features must be positive")
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"table {self.name!r}: unknown optimizer {self.optimizer!r}")

    def state_floats(self, cols: int | np.ndarray) -> int | np.ndarray:
        """Optimizer state floats of one row of a ``cols``-column shard (as the fused
        module keeps them)."""
        optimizer = SparseOptimizer(self.optimizer)
        return optimizer.state_width(cols) * optimizer.num_states

    def row_bytes(self, cols: int | np.ndarray) -> int | np.ndarray:
        """Bytes one row of a ``cols``-column shard takes: weights, optimizer state, the
        one-byte modified mask."""
        return cols * self.weight_bytes + 4 * self.state_floats(cols) + 1

    @property
    def index_bytes(self) -> int:
        """Bytes of a dynamic table's id map and admission sketch (0 for a static table)."""
        if self.dynamic is None:
            return 0
        return self.dynamic.map_shards * map_bytes(self.dynamic.shard_capacity) + self.dynamic.sketch_bytes()

    def bytes(self) -> int:
        return self.rows * self.row_bytes(self.dim) + self.index_bytes

    def hit_rate(self, cached_fraction: float) -> float:
        """The share of lookups a cache of ``cached_fraction`` of the table's rows serves,
        were it to hold the sample's most frequent rows (no sample: that fraction)."""
        if not self.id_counts:
            return cached_fraction
        counts = np.asarray(self.id_counts, dtype=np.float64)
        return float(counts[: int(cached_fraction * self.rows)].sum() / counts.sum())


@dataclass(frozen=True)
class Topology:
    """The ranks and what they can do.

    ``group_size`` is the size of a ``table_row_wise`` group (default: a node). Bandwidths in
    bytes/s; ``lookup_bandwidth`` is the rate a rank reads and writes embedding rows at.
    """

    world_size: int
    ranks_per_node: int = 0
    memory_per_rank: int = 16 * 2**30
    group_size: int = 0
    intra_node_bandwidth: float = 10e9
    inter_node_bandwidth: float = 1.25e9
    lookup_bandwidth: float = 2e9
    store_fraction: float = 0.0
    """Cache fraction of a table the planner places on the embedding store (0: the planner
    places none there)."""
    store_bandwidth: float = 1e9
    """Bytes a rank reads and writes on its store tier per second."""

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise ValueError("world size must be positive")
        rpn = self.ranks_per_node or self.world_size
        if self.world_size % rpn:
            raise ValueError(f"{self.world_size} ranks do not split into nodes of {rpn}")
        group = self.group_size or rpn
        if self.world_size % group:
            raise ValueError(f"{self.world_size} ranks do not split into table_row_wise groups of {group}")
        if self.memory_per_rank <= 0:
            raise ValueError("memory per rank must be positive")
        object.__setattr__(self, "ranks_per_node", rpn)
        object.__setattr__(self, "group_size", group)

    def groups(self) -> list[tuple[int, ...]]:
        """The ``table_row_wise`` groups: consecutive ranks, ``group_size`` each."""
        g = self.group_size
        return [tuple(range(start, start + g)) for start in range(0, self.world_size, g)]

    def seconds_per_byte(self) -> float:
        """Time of one byte of all-to-all traffic: the share to ranks of other nodes goes at
        the inter-node bandwidth."""
        off_node = (self.world_size - self.ranks_per_node) / self.world_size
        return (1 - off_node) / self.intra_node_bandwidth + off_node / self.inter_node_bandwidth


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512MB"``, ``"1e9"`` → bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 16GiB, 512MB, 1e9)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
