"""A dynamic table's state (map, admission sketch, clock) and the step that turns a batch's
raw ids into slots before the fused kernel runs.

A table of ``S`` map shards (:mod:`~neorec.trainer.embedding.dynamic.shards`; 1 unless
sharded) holds ``S * (Cs + 1)`` rows, ``Cs = capacity // S``: map shard ``s`` owns the block
of rows from ``s * (Cs + 1)``, a row per slot, then its *default* row, which every id of the
shard without a slot reads; it is zero whenever a batch reads it (its update is discarded:
it is zeroed again before the next lookup that reads it). A :class:`DynamicTable` is one map
shard's state: its own map, sketch, clock and counters.

A slot that held another id before is re-initialised before its new id reads it: its row
becomes the initial row of "virtual row" ``generation * rows + row`` of the table (``row``
its row in the whole table; :func:`neorec.embedding_store.initial.initial_rows`, a pure
function of seed, table and that row; generation 0 is the table's initial weights) and its
optimizer state zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from neorec.embedding_store.initial import initial_rows
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.dynamic.admission import CountMinSketch
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.id_map import REJECTED, IdMap, remap_train


@dataclass
class Reinit:
    """Slots (int64 ``[k]``, distinct) to re-initialise before a batch's lookup, with the
    generation (int64 ``[k]``) each starts."""

    slots: np.ndarray
    generations: np.ndarray


class DynamicTable:
    """Map, sketch and clock of map shard ``shard`` of the dynamic table ``name`` (number
    ``index`` in the model: its initial rows' key) of ``dim`` columns."""

    def __init__(self, name: str, index: int, dim: int, config: DynamicTableConfig, shard: int = 0) -> None:
        config.validate()
        if not 0 <= shard < config.map_shards:
            raise ValueError(f"map shard {shard} of table {name!r}: it has {config.map_shards}")
        self.name = name
        self.index = index
        self.dim = dim
        self.config = config
        self.shard = shard
        self.capacity = config.shard_capacity
        """Slots of this map shard."""
        self.first_row = shard * config.block_rows
        """The table row of this map shard's slot 0."""
        self.map = IdMap(self.capacity)
        self.sketch = CountMinSketch(config.sketch_columns() if config.min_count > 1 else 1,
                                     config.sketch_depth if config.min_count > 1 else 1, index)
        self.clock = 0
        """The TTL and sketch half-life clock: steps trained, or partitions ended (``ttl_unit``)."""

    @property
    def key(self) -> str:
        """The name of this map shard's state in checkpoints: the table's, or ``table/shard``
        when it has several."""
        return self.name if self.config.map_shards == 1 else f"{self.name}/{self.shard}"

    @property
    def rows(self) -> int:
        """Rows of the whole table: per map shard a slot per id and the default row."""
        return self.config.rows

    @property
    def default_row(self) -> int:
        """The table row this map shard's ids without a slot read (zeros)."""
        return self.first_row + self.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of the map and the sketch."""
        return self.map.nbytes + self.sketch.nbytes

    def train_ids(self, ids: np.ndarray) -> tuple[np.ndarray, Reinit]:
        """Slots (int64 ``[n]``, in this map shard, -1: reads zeros) of a training batch's
        ``ids`` (int64 ``[n]``, this shard's, in batch order), admitting and evicting on the
        way; the slots to re-initialise."""
        slots = np.empty(ids.size, dtype=np.int64)
        reinit, _ = self._train(ids, slots, 0, -1)
        return slots, reinit

    def train_rows(self, ids: np.ndarray, out: np.ndarray, offset: int) -> tuple[Reinit, bool]:
        """:meth:`train_ids`, writing to ``out`` (int64 ``[n]``) each id's table row minus
        ``offset``: its slot's row, or the default row; also whether any id reads the
        default row."""
        reinit, rejected = self._train(ids, out, self.first_row - offset, self.default_row - offset)
        return reinit, rejected > 0

    def lookup_rows(self, ids: np.ndarray, out: np.ndarray, offset: int) -> bool:
        """:meth:`train_rows` for an evaluation batch: the map does not change."""
        return self.map.lookup_into(ids, out, self.first_row - offset, self.default_row - offset) > 0

    def _train(self, ids: np.ndarray, out: np.ndarray, base: int, missing: int) -> tuple[Reinit, int]:
        """The training step of ``ids`` into ``out`` (``base`` + slot, ``missing``); how many
        ids read ``missing``."""
        if self.config.ttl and self.config.ttl_unit == "steps":
            self.map.expire(self.clock, self.config.ttl)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        reinit = np.empty(min(ids.size, self.capacity), dtype=np.int64)
        generations = np.empty_like(reinit)
        m, s = self.map, self.sketch
        m.make_room(ids.size)
        rejected = int(m.stats[REJECTED])
        count = remap_train(m.entries, m.meta, m.live, m.recency, m.free, m.cursors, m.stats, s.counts, s.dirty,
                            np.int64(s.shift), s.salts, ids, np.int64(self.config.min_count), np.int64(self.clock),
                            np.int64(base), np.int64(missing), out, reinit, generations)
        if self.config.ttl_unit == "steps":
            self._tick()
        return Reinit(reinit[:count], generations[:count]), int(m.stats[REJECTED]) - rejected

    def advance_partition(self) -> None:
        """A partition of a continuous-training run ended: with ``ttl_unit = "partitions"``
        the clock moves on and ids unseen for more than ``ttl`` partitions leave."""
        if self.config.ttl_unit == "partitions":
            self._tick()
            if self.config.ttl:
                self.map.expire(self.clock, self.config.ttl)

    def _tick(self) -> None:
        """The clock moves on; every ``sketch_half_life`` ticks the sketch's counts halve."""
        self.clock += 1
        if self.config.sketch_half_life and self.clock % self.config.sketch_half_life == 0:
            self.sketch.halve()

    def initial_rows(self, reinit: Reinit, seed: int) -> torch.Tensor:
        """float32 ``[k, dim]``: the rows ``reinit``'s slots start their generation with."""
        virtual = reinit.generations * self.rows + self.first_row + reinit.slots
        return torch.from_numpy(initial_rows(seed, self.index, virtual, self.rows, self.dim))

    def counters(self) -> dict[str, int]:
        return self.map.counters()

    def delta(self, full: bool) -> dict[str, Any]:
        """What changed since the last delta (everything when ``full``): checkpoint state."""
        return {"clock": self.clock, "map": self.map.delta(full), "sketch": self.sketch.delta(full)}

    def apply(self, deltas: list[dict[str, Any]]) -> None:
        """Restore from the :meth:`delta` of each checkpoint of a chain, oldest (full) first."""
        for delta in deltas:
            self.map.apply(delta["map"])
            self.sketch.apply(delta["sketch"])
            self.clock = delta["clock"]
        self.map.rebuild()
        self.map.freed[:] = 0
        self.sketch.dirty[:] = 0


def table_spans(sparse: KeyedJaggedTensor, offsets: np.ndarray, features: tuple[str, ...]) -> list[slice]:
    """Where the ids of ``features`` lie in ``sparse.values``, feature by feature
    (``offsets``: ``sparse.offsets()`` as numpy)."""
    b = sparse.batch_size
    return [slice(int(offsets[f * b]), int(offsets[(f + 1) * b])) for f in sparse.positions_of(features)]
