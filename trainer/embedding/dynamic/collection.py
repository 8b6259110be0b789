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
from neorec.trainer.embedding.dynamic.table import DynamicTable, Reinit, table_spans
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
        self._workers = MapShardWorkers()
        defaults: dict[str, list[int]] = {}
        for table in self.map_shards():
            piece, first = self.pieces[table.name]
            defaults.setdefault(piece, []).append(table.default_row - first)
        self._zero_defaults = inner.row_zeroer({piece: np.array(rows) for piece, rows in defaults.items()})
        """Zeroes the default rows of every map shard held here (a step may have updated them)."""

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

        The map shards' steps run side by side (:mod:`~neorec.trainer.embedding.dynamic.workers`)
        and write the rows in place where a table's ids are one run of one map shard;
        re-initialising and zeroing rows follow in this thread."""
        training = self.training and torch.is_grad_enabled()
        values = sparse.values.numpy()
        rows = values.copy()
        offsets = sparse.offsets().numpy()
        jobs: list[tuple[DynamicTable, np.ndarray, np.ndarray]] = []
        """Per map shard: its ids and where its step writes their rows."""
        scattered: list[tuple[np.ndarray, np.ndarray]] = []
        """Rows written apart, and their positions in ``rows``."""
        for name, shards in self.dynamic.items():
            spans = table_spans(sparse, offsets, self._features[name])
            if len(spans) == 1 and shards[0].config.map_shards == 1:
                jobs.append((shards[0], values[spans[0]], rows[spans[0]]))
                continue
            positions = np.concatenate([np.arange(s.start, s.stop) for s in spans])
            ids = values[positions]
            for table, where in _split_by_shard(ids, shards):
                out = np.empty(positions[where].size, dtype=np.int64)
                jobs.append((table, ids[where], out))
                scattered.append((out, positions[where]))
        step = self._train_step if training else self._lookup_step
        found = self._workers.run([lambda job=job: step(*job) for job in jobs], [job[1].size for job in jobs])
        for (table, _, _), (reinit, _) in zip(jobs, found):
            if reinit is not None and reinit.slots.size:
                self._reinitialise(table, reinit)
        if any(reads_default for _, reads_default in found):
            self._zero_defaults()
        for out, positions in scattered:
            rows[positions] = out
        return sparse.with_values(torch.from_numpy(rows))

    def _train_step(self, table: DynamicTable, ids: np.ndarray, out: np.ndarray) -> tuple[Reinit | None, bool]:
        """A training batch's ids of map shard ``table``: their rows in ``inner`` to ``out``
        (admitting and evicting); the slots to re-initialise; whether any reads the default."""
        return table.train_rows(ids, out, self.pieces[table.name][1])

    def _lookup_step(self, table: DynamicTable, ids: np.ndarray, out: np.ndarray) -> tuple[Reinit | None, bool]:
        """:meth:`_train_step` for an evaluation batch: the map unchanged."""
        return None, table.lookup_rows(ids, out, self.pieces[table.name][1])

    def _reinitialise(self, table: DynamicTable, reinit: Reinit) -> None:
        piece, first = self.pieces[table.name]
        rows = torch.from_numpy(reinit.slots + (table.first_row - first))
        _, states = self.inner.read_rows(piece, rows)
        self.inner.write_rows(piece, rows, table.initial_rows(reinit, self.seed),
                              [torch.zeros_like(s) for s in states])

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
