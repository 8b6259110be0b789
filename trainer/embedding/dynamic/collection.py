"""Embeddings with dynamic tables: every batch's raw ids of the dynamic tables become slots
(:class:`~neorec.trainer.embedding.dynamic.table.DynamicTable`), then the wrapped module (the
fused one, or the store-backed one) looks the slots up with its kernels, unchanged.

Training batches (module in training mode, grad enabled) admit, evict and re-initialise;
evaluation only looks up: an id without a slot reads zeros either way.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.dynamic.shards import shard_of
from neorec.trainer.embedding.dynamic.table import DynamicTable, Reinit, table_spans, with_slots
from neorec.trainer.embedding.dynamic.workers import MapShardWorkers
from neorec.trainer.embedding.fused import ShardView


class DynamicEmbeddings(nn.Module):
    """``inner`` (a module over all tables, or a rank's shards of them) behind the id → slot
    step of the map shards ``tables`` (:class:`DynamicTable` s: every map shard of a table,
    or those a rank owns); ``seed`` keys the rows of re-initialised slots.

    ``pieces``: per dynamic table, the name of ``inner``'s table holding its map shards' rows
    and that table's first row in the whole table (default: the table's own name, row 0). A
    rank of a sharded run receives, per feature, the raw ids of the global batch that belong
    to its map shards, in global batch order, so its maps decide as one process's would.

    The output is the inner module's: float32 ``[B, sum of the feature dims]``."""

    def __init__(self, inner: nn.Module, tables: Sequence[DynamicTable], seed: int,
                 pieces: dict[str, tuple[str, int]] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.dynamic: dict[str, list[DynamicTable]] = {}
        """Per dynamic table, its map shards held here, by shard index."""
        for table in sorted(tables, key=lambda t: (t.index, t.shard)):
            self.dynamic.setdefault(table.name, []).append(table)
        self.seed = seed
        self.pieces = {name: (pieces or {}).get(name, (name, 0)) for name in self.dynamic}
        self.feature_names = inner.feature_names
        self.output_dim = inner.output_dim
        features = {t.name: t.feature_names for t in inner.tables}
        self._features = {name: features[self.pieces[name][0]] for name in self.dynamic}
        self._zero_rows: dict[str, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}
        """Per map shard: its default row's number, and a zero row and zero optimizer states."""
        self._workers = MapShardWorkers()

    @property
    def local(self) -> nn.Module:
        """The module holding this rank's rows (what :func:`store_of` looks for)."""
        return getattr(self.inner, "local", self.inner)

    @property
    def optimizer_step(self) -> torch.Tensor:
        """The wrapped module's count of sparse optimizer steps."""
        return self.inner.optimizer_step

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.inner(self.remap(sparse))

    def remap(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``sparse`` with the dynamic tables' ids replaced by the rows of their slots in
        ``inner`` (ids without a slot: their map shard's default row, zeroed first); a
        training batch first updates the maps and re-initialises reused slots.

        The map shards' steps run side by side (:mod:`~neorec.trainer.embedding.dynamic.workers`);
        re-initialising and zeroing rows follow, shard by shard, in this thread."""
        training = self.training and torch.is_grad_enabled()
        values = sparse.values.numpy()
        slots = values.copy()
        offsets = sparse.offsets().numpy()
        # per map shard: its table's name, the shard, its ids, where they lie among the table's
        units: list[tuple[str, DynamicTable, np.ndarray, slice | np.ndarray]] = []
        table_ids: dict[str, tuple[list[slice], np.ndarray]] = {}
        for name, shards in self.dynamic.items():
            spans = table_spans(sparse, offsets, self._features[name])
            ids = np.concatenate([values[s] for s in spans]) if spans else np.zeros(0, np.int64)
            table_ids[name] = (spans, ids)
            units += [(name, table, ids[where], where) for table, where in _split_by_shard(ids, shards)]
        step = _train_step if training else _lookup_step
        found = self._workers.run([lambda u=u: step(u[1], u[2]) for u in units], [u[2].size for u in units])
        rows = {name: np.empty(ids.size, dtype=np.int64) for name, (_, ids) in table_ids.items()}
        for (name, table, _, where), (shard_slots, reinit) in zip(units, found):
            if reinit is not None and reinit.slots.size:
                self._reinitialise(table, reinit)
            rows[name][where] = self._rows(table, shard_slots) - self.pieces[name][1]
        for name, (spans, _) in table_ids.items():
            start = 0
            for span in spans:
                slots[span] = rows[name][start : start + span.stop - span.start]
                start += span.stop - span.start
        return with_slots(sparse, slots)

    def _rows(self, table: DynamicTable, slots: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: the table rows of a map shard's ``slots`` (int64 ``[n]``, -1: no
        slot), its default row (zeroed) for -1."""
        missing = slots < 0
        if missing.any():
            self._zero_default(table)
        return np.where(missing, table.default_row, slots + table.first_row)

    def _inner_rows(self, table: DynamicTable, rows: np.ndarray) -> tuple[str, torch.Tensor]:
        """The inner module's table holding ``table``'s rows, and ``rows`` (table rows) in it."""
        piece, first = self.pieces[table.name]
        return piece, torch.from_numpy(np.ascontiguousarray(rows - first, dtype=np.int64))

    def _reinitialise(self, table: DynamicTable, reinit: Reinit) -> None:
        piece, rows = self._inner_rows(table, reinit.slots + table.first_row)
        _, states = self.inner.read_rows(piece, rows)
        self.inner.write_rows(piece, rows, table.initial_rows(reinit, self.seed),
                              [torch.zeros_like(s) for s in states])

    def _zero_default(self, table: DynamicTable) -> None:
        """Zero a map shard's default row and its optimizer state (a step may have updated them)."""
        piece, rows = self._inner_rows(table, np.array([table.default_row]))
        if table.key not in self._zero_rows:
            weights, states = self.inner.read_rows(piece, rows)
            self._zero_rows[table.key] = (rows, torch.zeros_like(weights), [torch.zeros_like(s) for s in states])
        rows, weights, states = self._zero_rows[table.key]
        self.inner.write_rows(piece, rows, weights, states)

    def on_partition_end(self, name: str) -> None:
        """Partition ``name`` of a continuous-training run is trained (the follow loop's hook,
        :data:`~neorec.trainer.run.follow.PARTITION_END_HOOK`): tables whose TTL counts
        partitions advance their clock and evict the ids unseen for longer than it."""
        for table in self.map_shards():
            table.advance_partition()

    def map_shards(self) -> list[DynamicTable]:
        """The map shards held here, table by table, by shard index."""
        return [table for shards in self.dynamic.values() for table in shards]

    def counters(self) -> dict[str, dict[str, int]]:
        """Per dynamic table, summed over its map shards held here: ids ``admitted``,
        sightings ``rejected``, ids ``evicted``, ``live`` slots (since the run began)."""
        totals: dict[str, dict[str, int]] = {}
        for table in self.map_shards():
            total = totals.setdefault(table.name, dict.fromkeys(table.counters(), 0))
            for key, value in table.counters().items():
                total[key] += value
        return totals

    def dynamic_state(self, full: bool) -> dict[str, Any]:
        """Checkpoint state of every map shard held here, by its :attr:`DynamicTable.key`:
        what changed since the last call (everything when ``full``)."""
        return {table.key: as_tensors(table.delta(full)) for table in self.map_shards()}

    def restore_dynamic(self, chain: list[dict[str, Any]]) -> None:
        """Restore the map shards held here from the :meth:`dynamic_state` (of every rank)
        of each checkpoint of a chain."""
        for table in self.map_shards():
            table.apply([as_arrays(state[table.key]) for state in chain])

    # ------------------------------------------------------------ the wrapped module
    def shard_views(self) -> list[ShardView]:
        return self.inner.shard_views()

    def set_optimizer_steps(self, steps: int) -> None:
        self.inner.set_optimizer_steps(steps)

    def local_optimizer_steps(self) -> int:
        return self.inner.local_optimizer_steps()

    def read_rows(self, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.inner.read_rows(name, rows)

    def table_weight(self, name: str) -> torch.Tensor:
        return self.inner.table_weight(name)


def _train_step(table: DynamicTable, ids: np.ndarray) -> tuple[np.ndarray, Reinit | None]:
    """A training batch's ids of map shard ``table``: their slots (admitting and evicting)
    and the slots to re-initialise."""
    return table.train_ids(ids)


def _lookup_step(table: DynamicTable, ids: np.ndarray) -> tuple[np.ndarray, Reinit | None]:
    """An evaluation batch's ids of map shard ``table``: their slots, the map unchanged."""
    return table.map.lookup(ids), None


def _split_by_shard(ids: np.ndarray, shards: list[DynamicTable]
                    ) -> list[tuple[DynamicTable, slice | np.ndarray]]:
    """``ids`` (int64 ``[n]``) by map shard: each of ``shards`` (a table's map shards held
    here) with where its ids lie (in order); every id must be of one of them."""
    if shards[0].config.map_shards == 1:
        return [(shards[0], slice(None))]
    shard = shard_of(ids, shards[0].config.map_shards)
    parts = [(table, np.flatnonzero(shard == table.shard)) for table in shards]
    if sum(where.size for _, where in parts) != ids.size:
        raise AssertionError(f"table {shards[0].name!r}: ids of map shards not held here")
    return parts


def as_tensors(state: Any) -> Any:
    """``state`` with every numpy array as a tensor (sharing its memory): checkpoints hold
    tensors and plain values only, so they load with ``weights_only=True``."""
    if isinstance(state, dict):
        return {key: as_tensors(value) for key, value in state.items()}
    return torch.from_numpy(state) if isinstance(state, np.ndarray) else state


def as_arrays(state: Any) -> Any:
    """The inverse of :func:`as_tensors`."""
    if isinstance(state, dict):
        return {key: as_arrays(value) for key, value in state.items()}
    return state.numpy() if isinstance(state, torch.Tensor) else state
