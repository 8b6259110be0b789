"""Fused embeddings whose large tables live on the embedding store tier: the module holds a
set-associative cache of each such table's rows (with their optimizer state), a tier below
holds the rest, and the fused kernels, unchanged, see cache slots.

For every batch, before its lookup (:meth:`StoreBackedEmbeddings.admit`): the rows of the
previous batch that did not fit the cache are written back; each store table's distinct
rows are admitted to the cache (hits keep their slot, misses displace the least recently
(or frequently) used rows not in this batch, dirty ones written back to the tier); the
missing rows come from the tier, or start at their initial value (a pure function of seed,
table and row) if the tier never held them; rows whose cache set is full of this batch's
rows go to a scratch area after the cache; the batch's ids become slots. The tier reads of
batch *i+1*'s misses run in a background thread while batch *i* trains
(:meth:`read_ahead`). Each row's update is the one it gets in memory, so training through
the store gives the numbers of training in memory, bit for bit.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from neorec.common.errors import UserError
from neorec.embedding_store.cache import SetAssociativeCache
from neorec.embedding_store.segments import TierStats
from neorec.embedding_store.initial import initial_rows
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.bounds import BoundsCheck
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection, ShardView, initial_table_weight


class Tier(Protocol):
    """Where a store table's rows live below the cache: the SSD tier in this process
    (:class:`neorec.embedding_store.segments.SegmentTier`) or a store service's (its client)."""

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def write(self, rows: np.ndarray, data: np.ndarray) -> None: ...

    def flush(self, sync: bool = False) -> None: ...

    def snapshot(self, directory: Path) -> list[tuple[str, int]]: ...

    def counters(self) -> TierStats: ...

    def load(self, directory: Path, names: list[str], checked: bool = False) -> None:
        """The tier's rows become those of the segments ``names`` of ``directory``;
        ``checked``: the caller found them whole already (a tier may then skip reading
        them once more; a service's checks them whatever its client says)."""

    def close(self) -> None: ...


OpenTier = Callable[[str, int, int], Tier]
"""Opens the tier of a store table piece: ``(key, rows, row_bytes)``; the key names the
piece (``table@first_row``) wherever it lives."""


@dataclass(frozen=True)
class StoreTable:
    """A table on the store: ``cache_rows`` rows of it in the module, ``scratch_rows`` more for
    a batch's rows the cache cannot place."""

    name: str
    cache_rows: int
    scratch_rows: int
    ways: int = 32
    policy: str = "lru"


@dataclass(frozen=True)
class StorePiece:
    """A store table (or its shard) as a checkpoint sees it: rows ``[row_offset, row_offset
    + rows)`` of ``table``, ``row_bytes`` each, in ``tier``."""

    table: str
    key: str
    row_offset: int
    rows: int
    row_bytes: int
    tier: Tier


@dataclass(frozen=True)
class StoreSettings:
    """How store tables are cached and where their tiers are (a config's
    ``[embedding_store]``, resolved)."""

    open_tier: OpenTier
    ways: int = 32
    policy: str = "lru"
    scratch_rows: int = 0
    """0: twice a batch's ids of the table (``batch_size`` per feature), at most its rows."""
    batch_size: int = 0
    close: Callable[[], None] = lambda: None
    """Release what reaching the tiers holds (a store service's channel), once they are closed."""

    def table(self, name: str, rows: int, cache_fraction: float, num_features: int) -> StoreTable:
        """The cache of a table (or shard) of ``rows`` rows on the store."""
        scratch = self.scratch_rows or min(rows, 2 * self.batch_size * num_features)
        return StoreTable(name, max(self.ways, math.ceil(rows * cache_fraction)), scratch, self.ways, self.policy)


@dataclass
class StoreStats:
    """Where the training thread's time went on the store (seconds, since construction)."""

    batches: int = 0
    admit_s: float = 0.0
    """In :meth:`StoreBackedEmbeddings.admit`: everything the store adds to a step."""
    wait_s: float = 0.0
    """Waiting for the reads ahead of a batch to finish."""
    read_s: float = 0.0
    """Reading rows that were not read ahead (the first batch, evaluation, or rows the
    batch before evicted)."""

    @property
    def stall_s(self) -> float:
        """Time a step waited on the tier."""
        return self.wait_s + self.read_s


class StoreError(UserError, RuntimeError):
    """The store cannot serve a batch (e.g. more rows of one batch than the cache and
    scratch can hold); the message says what to change."""


class _Table:
    """One store table's cache, tier, and where its rows are in the module."""

    def __init__(self, spec: StoreTable, config: TableConfig, origin: tuple[int, int, int, int], table_rows: int,
                 module: FusedEmbeddingBagCollection, seed: int, open_tier: OpenTier, stats: StoreStats) -> None:
        self.spec = spec
        self.stats = stats
        self.config = config
        self.origin = origin
        """(table number, first row, first column, width) of the whole table it is part of."""
        self.table_rows = table_rows
        self.seed = seed
        self.cache = SetAssociativeCache(spec.cache_rows, spec.ways, spec.policy)
        self.slots = self.cache.slots
        self.weight = module.table_weight(config.name)
        self.states = module.table_state(config.name)
        self.slot_rows = module.slot_rows(config.name)
        self.feature_positions = [module.feature_names.index(f) for f in config.feature_names]
        self.scratch: tuple[np.ndarray, np.ndarray, bool] | None = None
        """The last batch's rows in scratch (rows, slots, whether it trained them), written
        back (if trained) at the next admit."""
        self.staged: dict[int, tuple[bool, np.ndarray]] = {}
        """Rows of the next batch read ahead from the tier: row → (found, bytes)."""
        weight_bytes = self.weight.element_size() * self.weight.shape[1]
        self.widths = [weight_bytes, *(s.shape[1] * 4 for s in self.states)]
        self.key = f"{origin_name(config.name)}@{origin[1]}"
        self.tier = open_tier(self.key, config.num_embeddings, sum(self.widths))

    # ------------------------------------------------------------------ row bytes
    def gather(self, slots: np.ndarray) -> np.ndarray:
        """uint8 ``[n, row_bytes]``: the rows at ``slots`` (weights as stored, then state)."""
        index = torch.from_numpy(slots)
        parts = [_bytes(self.weight.index_select(0, index))] + [_bytes(s.index_select(0, index)) for s in self.states]
        return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def scatter(self, slots: np.ndarray, data: np.ndarray) -> None:
        """Write rows (as :meth:`gather` gives them) into ``slots``."""
        index = torch.from_numpy(slots)
        start = 0
        for target, width in zip([self.weight, *self.states], self.widths):
            piece = np.ascontiguousarray(data[:, start : start + width])
            target.index_copy_(0, index, torch.from_numpy(piece).view(target.dtype).view(-1, target.shape[1]))
            start += width

    def initial(self, rows: np.ndarray) -> np.ndarray:
        """The bytes of never-written rows: their initial weights, zero optimizer state."""
        table, first_row, first_column, width = self.origin
        weights = torch.from_numpy(initial_rows(self.seed, table, rows + first_row, self.table_rows, width,
                                                (first_column, first_column + self.config.embedding_dim)))
        weights = weights.to(self.weight.dtype)
        parts = [_bytes(weights)] + [np.zeros((rows.size, w), dtype=np.uint8) for w in self.widths[1:]]
        return np.concatenate(parts, axis=1)

    # ------------------------------------------------------------------ batches
    def read_ahead(self, rows: np.ndarray) -> None:
        """Read from the tier the rows of the next batch the cache does not hold."""
        missing = rows[self.cache.lookup(rows) < 0]
        found, data = self.tier.read(missing)
        self.staged = {int(r): (bool(f), d) for r, f, d in zip(missing.tolist(), found, data)}

    def admit(self, rows: np.ndarray, batch: int, training: bool) -> np.ndarray:
        """Make the distinct ``rows`` of a batch available; returns their slots."""
        self.flush_scratch()
        hit = self.cache.lookup(rows) >= 0
        slots, evicted, evicted_dirty, evicted_slots = self.cache.admit(rows, batch)
        dirty = evicted_dirty & (evicted >= 0)
        if dirty.any():
            self.tier.write(evicted[dirty], self.gather(evicted_slots[dirty]))
        overflow = slots < 0
        if int(overflow.sum()) > self.spec.scratch_rows:
            raise StoreError(f"table {self.config.name!r}: {int(overflow.sum())} rows of one batch do not fit their "
                             f"cache sets or the {self.spec.scratch_rows} scratch rows; give it a larger cache or "
                             f"scratch")
        slots[overflow] = self.slots + np.arange(int(overflow.sum()))
        new = ~hit
        if new.any():
            self.scatter(slots[new], self._fetch(rows[new]))
        self.slot_rows[slots] = rows
        if training:
            self.cache.dirty[slots[~overflow]] = True
        if overflow.any():
            self.scratch = (rows[overflow], slots[overflow], training)
        self.staged = {}
        return slots

    def _fetch(self, rows: np.ndarray) -> np.ndarray:
        """The bytes of rows that are not cached: staged, else read now, else initial."""
        data = np.empty((rows.size, sum(self.widths)), dtype=np.uint8)
        unknown = []
        never = []
        for i, row in enumerate(rows.tolist()):
            staged = self.staged.get(row)
            if staged is None:
                unknown.append(i)
            elif staged[0]:
                data[i] = staged[1]
            else:
                never.append(i)
        unknown_at = np.array(unknown, dtype=np.int64)
        never_at = np.array(never, dtype=np.int64)
        if unknown_at.size:
            started = time.perf_counter()
            found, read = self.tier.read(rows[unknown_at])
            self.stats.read_s += time.perf_counter() - started
            data[unknown_at[found]] = read[found]
            never_at = np.concatenate([never_at, unknown_at[~found]])
        if never_at.size:
            data[never_at] = self.initial(rows[never_at])
        return data

    def flush_scratch(self) -> None:
        """Release the last batch's overflow rows, writing them back if it trained them
        (their copies read ahead, from before, are dropped)."""
        if self.scratch is None:
            return
        rows, slots, trained = self.scratch
        self.scratch = None
        if trained:
            self.tier.write(rows, self.gather(slots))
        for row in rows.tolist():
            self.staged.pop(row, None)

    def write_back(self) -> None:
        """Write every dirty cached row back (they stay cached, now clean)."""
        self.flush_scratch()
        dirty = np.flatnonzero(self.cache.dirty)
        if dirty.size:
            self.tier.write(self.cache.tags[dirty], self.gather(dirty))
            self.cache.dirty[dirty] = False


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """uint8 ``[n, bytes per row]`` view of a 2-D CPU tensor."""
    contiguous = tensor.contiguous()
    return contiguous.view(torch.uint8).numpy().reshape(contiguous.shape[0], -1)


def store_of(embeddings: nn.Module) -> "StoreBackedEmbeddings | None":
    """The store-backed module of a model's embeddings: the module itself, or a sharded
    module's local one; None when no table of this rank is on the store."""
    local = getattr(embeddings, "local", embeddings)
    return local if isinstance(local, StoreBackedEmbeddings) else None


def origin_name(name: str) -> str:
    """The table a local table is part of (``t_C1`` of shard ``t_C1@2``)."""
    return name.partition("@")[0]


class StoreBackedEmbeddings(nn.Module):
    """The function of ``FusedEmbeddingBagCollection(tables, optimizer)`` with the tables of
    ``store`` on the embedding store (see the module docstring), their tiers opened by
    ``settings.open_tier``.

    ``initial_weights`` (float32 ``[rows, dim]`` per table, None for store tables) and
    ``shard_origins`` are as for the fused module; ``table_rows``: per table, the rows of
    the whole table it is part of (its initial values' bound); default: its own rows.
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer: SparseOptimizer, store: Sequence[StoreTable],
                 settings: StoreSettings, *, seed: int = 0, weight_dtype: str = "fp32",
                 stochastic_rounding: bool = True, kernels: str = "auto",
                 initial_weights: Sequence[torch.Tensor | None] | None = None,
                 shard_origins: Sequence[tuple[int, int, int, int]] | None = None,
                 table_rows: Sequence[int] | None = None, bounds_check: str = "fatal") -> None:
        super().__init__()
        self._bounds = BoundsCheck(bounds_check, [f for t in tables for f in t.feature_names],
                                   [t.name for t in tables for _ in t.feature_names],
                                   [t.num_embeddings for t in tables for _ in t.feature_names])
        self.tables = tuple(tables)
        self.optimizer = optimizer
        self.seed = seed
        specs = {s.name: s for s in store}
        unknown = sorted(set(specs) - {t.name for t in tables})
        if unknown:
            raise ValueError(f"store tables the model does not have: {', '.join(unknown)}")
        origins = list(shard_origins or [(i, 0, 0, t.embedding_dim) for i, t in enumerate(tables)])
        table_rows = list(table_rows or [t.num_embeddings for t in tables])
        module_tables, initial = [], []
        for i, t in enumerate(tables):
            spec = specs.get(t.name)
            if spec is None:
                module_tables.append(t)
                given = None if initial_weights is None else initial_weights[i]
                table, first_row, first_column, width = origins[i]
                initial.append(given if given is not None else initial_table_weight(
                    table, table_rows[i], width, seed, first_row, t.num_embeddings,
                    (first_column, first_column + t.embedding_dim)))
            else:
                slots = SetAssociativeCache(spec.cache_rows, spec.ways, spec.policy).slots + spec.scratch_rows
                module_tables.append(TableConfig(t.name, slots, t.embedding_dim, t.feature_names, t.pooling,
                                                 t.learning_rate))
                initial.append(torch.zeros(slots, t.embedding_dim))  # every slot is written before it is read
        self.module = FusedEmbeddingBagCollection(
            module_tables, optimizer, seed=seed, initial_weights=initial, weight_dtype=weight_dtype,
            stochastic_rounding=stochastic_rounding, shard_origins=origins, kernels=kernels,
            slot_tables=[t.name for t in tables if t.name in specs], bounds_check="none")  # checked here, by id
        self.feature_names = self.module.feature_names
        self.output_dim = self.module.output_dim
        self.stats = StoreStats()
        self.store: dict[str, _Table] = {}
        try:
            for i, t in enumerate(tables):
                if t.name in specs:
                    self.store[t.name] = _Table(specs[t.name], t, origins[i], table_rows[i], self.module, seed,
                                                settings.open_tier, self.stats)
        except BaseException:
            self._close_tiers()  # those opened before the one that failed: nothing is left held
            raise
        self._ahead: tuple[KeyedJaggedTensor, threading.Thread] | None = None
        self._ahead_error: BaseException | None = None
        self._expected: KeyedJaggedTensor | None = None

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        self._bounds(sparse)
        slotted = self.admit(sparse)
        if self._expected is not None:
            upcoming, self._expected = self._expected, None
            self.read_ahead(upcoming)
        return self.module(slotted)

    def expect(self, sparse: KeyedJaggedTensor) -> None:
        """``sparse`` is the batch after the next one :meth:`forward` gets: its tier reads
        start once that forward has admitted its own rows, and run while it trains."""
        self._expected = sparse

    # -------------------------------------------------------------------- batches
    def _rows(self, sparse: KeyedJaggedTensor, table: _Table) -> tuple[np.ndarray, list[slice]]:
        """The ids of ``table``'s features in ``sparse`` (concatenated) and where they lie."""
        offsets = sparse.offsets().numpy()
        b = sparse.batch_size
        source = sparse.positions_of(table.config.feature_names)
        spans = [slice(int(offsets[f * b]), int(offsets[(f + 1) * b])) for f in source]
        values = sparse.values.numpy()
        ids = np.concatenate([values[s] for s in spans]) if spans else np.zeros(0, np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.config.num_embeddings):
            raise IndexError(f"table {table.config.name!r}: ids must lie in [0, {table.config.num_embeddings})")
        return ids, spans

    def read_ahead(self, sparse: KeyedJaggedTensor) -> None:
        """Start reading from the tiers the rows of ``sparse`` (the next batch) that the caches
        do not hold; its :meth:`admit` takes them. Call after the current batch's admit."""
        self._join_ahead()

        def read() -> None:
            try:
                for table in self.store.values():
                    table.read_ahead(np.unique(self._rows(sparse, table)[0]))
            except BaseException as err:  # raised by the admit that waits for it
                self._ahead_error = err

        thread = threading.Thread(target=read, daemon=True, name="store-read-ahead")
        thread.start()
        self._ahead = (sparse, thread)

    def admit(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``sparse`` with the ids of store tables replaced by the cache slots holding their
        rows (admitting the rows; see the module docstring)."""
        if not self.store:
            return sparse
        started = time.perf_counter()
        ahead = self._ahead is not None and self._ahead[0] is sparse
        self._join_ahead()
        self.stats.wait_s += time.perf_counter() - started
        if not ahead:
            for table in self.store.values():
                table.staged = {}
        training = self.training and torch.is_grad_enabled()
        self.stats.batches += 1
        values = sparse.values.numpy().copy()
        for table in self.store.values():
            ids, spans = self._rows(sparse, table)
            rows, inverse = np.unique(ids, return_inverse=True)
            slots = table.admit(rows, self.stats.batches, training)[inverse]
            start = 0
            for span in spans:
                values[span] = slots[start : start + span.stop - span.start]
                start += span.stop - span.start
        self.stats.admit_s += time.perf_counter() - started
        return KeyedJaggedTensor(sparse.keys, sparse.lengths, torch.from_numpy(values), sparse.weights)

    def _join_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[1].join()
            self._ahead = None
        if self._ahead_error is not None:
            error, self._ahead_error = self._ahead_error, None
            raise error

    # --------------------------------------------------------------- table access
    def write_back(self) -> None:
        """Write every changed row to the tiers (before a checkpoint or at the end)."""
        self._join_ahead()
        for table in self.store.values():
            table.write_back()
            table.tier.flush(sync=True)

    def report(self) -> dict[str, float]:
        """This rank's store counters since construction: cache ``hits``, ``misses``,
        ``evictions``, ``overflows`` (rows placed in scratch); seconds a step spent in the
        store (``admit_s``) and waiting on the tier (``stall_s``); the tiers' bytes read and
        written, and ``write_amplification`` (bytes written over bytes of rows written back)."""
        caches = [t.cache.counters for t in self.store.values()]
        tiers = [t.tier.counters() for t in self.store.values()]
        dirty = sum(c.dirty_bytes for c in tiers)
        written = sum(c.bytes_written for c in tiers)
        return {"hits": sum(c.hits for c in caches), "misses": sum(c.misses for c in caches),
                "evictions": sum(c.evictions for c in caches), "overflows": sum(c.overflows for c in caches),
                "batches": self.stats.batches, "admit_s": self.stats.admit_s, "stall_s": self.stats.stall_s,
                "tier_bytes_read": sum(c.bytes_read for c in tiers), "tier_bytes_written": written,
                "write_amplification": written / dirty if dirty else 0.0}

    def store_pieces(self) -> list[StorePiece]:
        """The store tables' pieces (call :meth:`write_back` first for their tiers to hold
        every row as it is now)."""
        return [StorePiece(origin_name(t.config.name), t.key, t.origin[1], t.config.num_embeddings,
                           sum(t.widths), t.tier) for t in self.store.values()]

    def clear_cache(self) -> None:
        """Forget the cached rows without writing them back (their tiers were just replaced
        by a checkpoint's)."""
        self._join_ahead()
        for table in self.store.values():
            table.cache.clear()
            table.scratch = None
            table.staged = {}

    def read_rows(self, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows of table ``name`` (as the fused module's :meth:`read_rows`), wherever they are."""
        table = self.store.get(name)
        if table is None:
            return self.module.read_rows(name, rows)
        self._join_ahead()
        table.flush_scratch()
        rows = rows.to(torch.int64).numpy()
        slots = table.cache.lookup(rows)
        data = np.empty((rows.size, sum(table.widths)), dtype=np.uint8)
        cached = slots >= 0
        if cached.any():
            data[cached] = table.gather(slots[cached])
        if (~cached).any():
            table.staged = {}
            data[~cached] = table._fetch(rows[~cached])
        weights, start = [], 0
        for target, width in zip([table.weight, *table.states], table.widths):
            piece = torch.from_numpy(np.ascontiguousarray(data[:, start : start + width])).view(target.dtype)
            weights.append(piece.view(rows.size, target.shape[1]).clone())
            start += width
        return weights[0].to(torch.float32), weights[1:]

    def write_rows(self, name: str, rows: torch.Tensor, weights: torch.Tensor, states: list[torch.Tensor]) -> None:
        """Overwrite rows ``rows`` (int64 ``[n]``, distinct) of table ``name`` with ``weights``
        ``[n, dim]`` and optimizer ``states`` (as the fused module's :meth:`write_rows`),
        wherever they are: a cached row in the cache (dirty), any other on the tier."""
        table = self.store.get(name)
        if table is None:
            self.module.write_rows(name, rows, weights, states)
            return
        self._join_ahead()
        table.flush_scratch()
        rows = rows.to(torch.int64).numpy()
        parts = [_bytes(weights.to(table.weight.dtype))] + [_bytes(s.to(torch.float32)) for s in states]
        data = np.concatenate(parts, axis=1)
        slots = table.cache.lookup(rows)
        cached = slots >= 0
        if cached.any():
            table.scatter(slots[cached], data[cached])
            table.cache.dirty[slots[cached]] = True
        if (~cached).any():
            table.tier.write(rows[~cached], data[~cached])
        table.staged = {}

    def row_zeroer(self, rows: dict[str, np.ndarray]) -> Callable[[], None]:
        """The fused module's :meth:`row_zeroer`, for rows wherever they are (a store
        table's, in the cache or on the tier, are written as zeros each call)."""
        in_memory = self.module.row_zeroer({name: r for name, r in rows.items() if name not in self.store})
        on_store = {name: torch.from_numpy(np.asarray(r, dtype=np.int64)) for name, r in rows.items()
                    if name in self.store}
        zeros: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        """Per store table, zero weights and states of its rows (shaped at the first call)."""

        def zero() -> None:
            in_memory()
            for name, at in on_store.items():
                if name not in zeros:
                    weights, states = self.read_rows(name, at)
                    zeros[name] = (torch.zeros_like(weights), [torch.zeros_like(s) for s in states])
                self.write_rows(name, at, *zeros[name])
        return zero

    def shard_views(self) -> list[ShardView]:
        """The tables held in memory as views (store tables are checkpointed with their tier)."""
        return [v for v in self.module.shard_views() if v.table not in self.store]

    def set_optimizer_steps(self, steps: int) -> None:
        self.module.set_optimizer_steps(steps)

    def local_optimizer_steps(self) -> int:
        return self.module.local_optimizer_steps()

    @property
    def optimizer_step(self) -> torch.Tensor:
        return self.module.optimizer_step

    def close(self, write_back: bool = True) -> None:
        """Close the tiers (writing every changed row back first, unless the run failed)."""
        if write_back:
            self.write_back()
        elif self._ahead is not None:
            self._ahead[1].join()
            self._ahead, self._ahead_error = None, None
        self._close_tiers()

    def _close_tiers(self) -> None:
        """Close every table's tier; the first failure is raised once all were tried (a
        failed close leaves the others' pieces released)."""
        failures = []
        for table in self.store.values():
            try:
                table.tier.close()
            except Exception as err:
                failures.append(err)
        if failures:
            raise failures[0]
