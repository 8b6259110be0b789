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
from neorec.trainer.embedding.dynamic.table import DynamicTable, Reinit, table_spans, with_slots
from neorec.trainer.embedding.fused import ShardView


class DynamicEmbeddings(nn.Module):
    """``inner`` (a module over all tables, whose dynamic ones hold ``capacity + 1`` rows) behind
    the id → slot step of ``tables``; ``seed`` keys the rows of re-initialised slots.

    The output is the inner module's: float32 ``[B, sum of the feature dims]``."""

    def __init__(self, inner: nn.Module, tables: Sequence[DynamicTable], seed: int) -> None:
        super().__init__()
        self.inner = inner
        self.dynamic = {t.name: t for t in tables}
        self.seed = seed
        self.feature_names = inner.feature_names
        self.output_dim = inner.output_dim
        features = {t.name: t.feature_names for t in inner.tables}
        self._features = {name: features[name] for name in self.dynamic}
        self._zero_rows: dict[str, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}
        """Per table: its default row's number, and a zero row and zero optimizer states."""

    @property
    def local(self) -> nn.Module:
        """The module holding this rank's rows (what :func:`store_of` looks for)."""
        return getattr(self.inner, "local", self.inner)

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.inner(self.remap(sparse))

    def remap(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``sparse`` with the dynamic tables' ids replaced by their slots (ids without a slot:
        the default row, zeroed first); a training batch first updates the maps and
        re-initialises reused slots."""
        training = self.training and torch.is_grad_enabled()
        values = sparse.values.numpy()
        slots = values.copy()
        offsets = sparse.offsets().numpy()
        for name, table in self.dynamic.items():
            spans = table_spans(sparse, offsets, self._features[name])
            ids = np.concatenate([values[s] for s in spans]) if spans else np.zeros(0, np.int64)
            if training:
                found, reinit = table.train_ids(ids)
                if reinit.slots.size:
                    self._reinitialise(table, reinit)
            else:
                found = table.map.lookup(ids)
            missing = found < 0
            if missing.any():
                found[missing] = table.default_row
                self._zero_default(table)
            start = 0
            for span in spans:
                slots[span] = found[start : start + span.stop - span.start]
                start += span.stop - span.start
        return with_slots(sparse, slots)

    def _reinitialise(self, table: DynamicTable, reinit: Reinit) -> None:
        rows = torch.from_numpy(reinit.slots)
        _, states = self.inner.read_rows(table.name, rows)
        self.inner.write_rows(table.name, rows, table.initial_rows(reinit, self.seed),
                              [torch.zeros_like(s) for s in states])

    def _zero_default(self, table: DynamicTable) -> None:
        """Zero the default row and its optimizer state (a step may have updated them)."""
        if table.name not in self._zero_rows:
            rows = torch.tensor([table.default_row], dtype=torch.int64)
            weights, states = self.inner.read_rows(table.name, rows)
            self._zero_rows[table.name] = (rows, torch.zeros_like(weights), [torch.zeros_like(s) for s in states])
        rows, weights, states = self._zero_rows[table.name]
        self.inner.write_rows(table.name, rows, weights, states)

    def on_partition_end(self, name: str) -> None:
        """Partition ``name`` of a continuous-training run is trained (the follow loop's hook,
        :data:`~neorec.trainer.run.follow.PARTITION_END_HOOK`): tables whose TTL counts
        partitions advance their clock and evict the ids unseen for longer than it."""
        for table in self.dynamic.values():
            table.advance_partition()

    def counters(self) -> dict[str, dict[str, int]]:
        """Per dynamic table: ids ``admitted``, sightings ``rejected``, ids ``evicted``,
        ``live`` slots (since the run began)."""
        return {name: table.counters() for name, table in self.dynamic.items()}

    def dynamic_state(self, full: bool) -> dict[str, Any]:
        """Checkpoint state of every dynamic table: what changed since the last call
        (everything when ``full``)."""
        return {name: _as_tensors(table.delta(full)) for name, table in self.dynamic.items()}

    def restore_dynamic(self, chain: list[dict[str, Any]]) -> None:
        """Restore the tables from the :meth:`dynamic_state` of each checkpoint of a chain."""
        for name, table in self.dynamic.items():
            table.apply([_as_arrays(state[name]) for state in chain])

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


def _as_tensors(state: Any) -> Any:
    """``state`` with every numpy array as a tensor (sharing its memory): checkpoints hold
    tensors and plain values only, so they load with ``weights_only=True``."""
    if isinstance(state, dict):
        return {key: _as_tensors(value) for key, value in state.items()}
    return torch.from_numpy(state) if isinstance(state, np.ndarray) else state


def _as_arrays(state: Any) -> Any:
    """The inverse of :func:`_as_tensors`."""
    if isinstance(state, dict):
        return {key: _as_arrays(value) for key, value in state.items()}
    return state.numpy() if isinstance(state, torch.Tensor) else state
