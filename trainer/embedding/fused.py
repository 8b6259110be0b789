"""Table-batched embedding bags: every table of the module looked up in one kernel call,
backward fused with the sparse optimizer.

All tables' weights live in one flat float32 buffer (``weights``), their optimizer state in
``state1``/``state2``. The forward pools every bag of every feature in one parallel Numba
kernel; the backward never builds a weight gradient: it groups the batch's ids by row and
updates each touched row (and its optimizer state) in place, deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numba
import numpy as np
import torch
from torch import nn

from neorec.embedding_store.initial import initial_block
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.bounds import BoundsCheck
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.id_weight_grads import id_weight_grads
from neorec.trainer.embedding.kernels import backward as backward_kernels
from neorec.trainer.embedding.kernels import torch_ops
from neorec.trainer.embedding.kernels.forward import (bags_per_job, pooled_forward, pooled_half_sum_lanes,
                                                        pooled_sum_lanes, streams_output, sums_in_registers)
from neorec.trainer.embedding.kernels.precision import FP32, PRECISIONS
from neorec.trainer.embedding.memory import huge_page_empty
from neorec.trainer.embedding.state_dict import load_tables, save_tables
from neorec.trainer.embedding.touched import TouchedRows, bitmap_bytes, bitmap_offsets
from neorec.common.offsets import exclusive_cumsum

_STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_OPTIMIZER_CODES = {
    "sgd": backward_kernels.SGD,
    "adagrad": backward_kernels.ADAGRAD,
    "rowwise_adagrad": backward_kernels.ROWWISE_ADAGRAD,
    "adam": backward_kernels.ADAM,
}

MAX_UNREAD_CHECKS = 64
"""Torch-ops lookups whose counts of bad ids may wait unread for an update (forwards with no
backward, or several before one); at this many the next lookup reads them first."""


class FusedEmbeddingBagCollection(nn.Module):
    """Pooled embeddings of all ``tables`` for a :class:`KeyedJaggedTensor`.

    The output is float32 ``[B, sum of the dims of every feature]``: for each table in
    order, for each of its features in order, that feature's pooled ``[B, dim]`` block
    (see :attr:`feature_names` and :meth:`feature_columns`).

    In training mode (with grad enabled) ``loss.backward()`` updates the weights with
    ``optimizer``; there is no separate optimizer step. Rows updated since the last
    :meth:`clear_touched` are marked in :attr:`touched`, a bitmap
    (:mod:`~neorec.trainer.embedding.touched`; per table: :meth:`table_touched`).
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer: SparseOptimizer, *, seed: int = 0,
                 initial_weights: Sequence[torch.Tensor] | None = None, weight_dtype: str = "fp32",
                 stochastic_rounding: bool = True,
                 shard_origins: Sequence[tuple[int, int, int, int]] | None = None, kernels: str = "auto",
                 slot_tables: Sequence[str] = (), bounds_check: str = "fatal") -> None:
        """``initial_weights``: float32 ``[rows, dim]`` per table; default
        :func:`initial_table_weight` of each table from ``seed``.

        ``weight_dtype`` ``"fp16"`` or ``"bf16"`` stores the weights in half the memory
        (lookups, gradients and optimizer state stay float32); each update is rounded to
        it stochastically (from ``seed``, the step and the element) or, with
        ``stochastic_rounding=False``, to nearest even. ``shard_origins`` places each table
        in a larger one (table id, first row, first column, full width) when the tables are
        shards, so that an element's rounding noise is that of the unsharded table.

        ``kernels``: ``"numba"`` (CPU), ``"torch"`` (torch ops, any device) or ``"auto"``:
        Numba on CPU, torch ops when the module is on CUDA.

        ``slot_tables``: tables whose rows are slots of a cache (the store tier); each slot's
        row in its table is set in :meth:`slot_rows`, and rounding noise follows it.

        ``bounds_check``: ``"fatal"`` refuses a batch with an id outside its table, naming it,
        before any weight or optimizer state changes; ``"none"`` trusts the caller (the Numba
        lookup still refuses it, unnamed; the torch-ops lookup leaves such ids out and
        counts them, and :meth:`check_ids` raises) (:mod:`neorec.trainer.embedding.bounds`).
        """
        super().__init__()
        if not tables:
            raise ValueError("a fused embedding module needs at least one table")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names repeat: {names}")
        self.tables = tuple(tables)
        self.optimizer = optimizer
        self.feature_names = tuple(f for t in tables for f in t.feature_names)
        too_big = [t.name for t in tables if t.num_embeddings >= 2**31]
        if too_big:
            raise ValueError(f"tables of 2**31 rows or more are not supported: {too_big}")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"a feature looks up more than one table: {self.feature_names}")

        rows = np.array([t.num_embeddings for t in tables], dtype=np.int64)
        dims = np.array([t.embedding_dim for t in tables], dtype=np.int64)
        widths = np.array([optimizer.state_width(t.embedding_dim) for t in tables], dtype=np.int64)
        self._rows, self._dims, self._state_width = rows, dims, widths
        self._table_offsets = exclusive_cumsum(rows * dims)
        self._state_offsets = exclusive_cumsum(rows * widths)
        self._touched_offsets = bitmap_offsets(rows)
        """int64 [T + 1]: where each table's rows start in the ``touched`` bitmap (and in the torch
        ops' numbering of all rows); the last is the bitmap's size in bits."""
        self._feature_table = np.array(
            [i for i, t in enumerate(tables) for _ in t.feature_names], dtype=np.int64
        )
        self._table_features = np.cumsum([0] + [len(t.feature_names) for t in tables], dtype=np.int64)
        """int64 [T + 1]: table t's features are ``feature_names[_table_features[t]:_table_features[t + 1]]``."""
        feature_dims = dims[self._feature_table]
        self._out_columns = exclusive_cumsum(feature_dims)
        self.output_dim = int(feature_dims.sum())
        self._mean_pooling = np.array([t.pooling == "mean" for t in tables], dtype=np.bool_)
        self._learning_rates = np.array(
            [optimizer.learning_rate if t.learning_rate is None else t.learning_rate for t in tables],
            dtype=np.float32,
        )

        state_size = int((rows * widths).sum())
        if initial_weights is None:
            initial_weights = [initial_table_weight(t, n, d, seed) for t, (n, d) in enumerate(zip(rows, dims))]
        if [tuple(w.shape) for w in initial_weights] != [(int(n), int(d)) for n, d in zip(rows, dims)]:
            raise ValueError("initial_weights must be one [rows, dim] tensor per table")
        if kernels not in ("auto", "numba", "torch"):
            raise ValueError(f"kernels must be auto, numba or torch, got {kernels!r}")
        self.kernels = kernels
        if weight_dtype not in _STORAGE:
            raise ValueError(f"weight_dtype must be one of {tuple(_STORAGE)}, got {weight_dtype!r}")
        self.weight_dtype = weight_dtype
        self._precision = PRECISIONS[weight_dtype]
        # fixed by the tables and the storage: unweighted batches then pool in registers
        self._pools_in_registers = sums_in_registers(self._dims, bool(self._mean_pooling.any()))
        self._rounding_seed = seed if stochastic_rounding and weight_dtype != "fp32" else -1
        if shard_origins is None:
            shard_origins = [(t, 0, 0, int(d)) for t, d in enumerate(dims)]
        self._noise_origin = np.array(shard_origins, dtype=np.int64).reshape(len(tables), 4)
        self._slot_base = np.full(len(tables), -1, dtype=np.int64)
        for name in slot_tables:
            t = names.index(name)
            self._slot_base[t] = sum(int(rows[names.index(n)]) for n in slot_tables[: list(slot_tables).index(name)])
        self._slot_rows = np.full(sum(int(rows[names.index(n)]) for n in slot_tables), -1, dtype=np.int64)
        self.register_buffer("weights", huge_page_empty(int((rows * dims).sum()), _STORAGE[weight_dtype]))
        for offset, weight in zip(self._table_offsets.tolist(), initial_weights):
            self.weights[offset : offset + weight.numel()].copy_(weight.reshape(-1))
        self.register_buffer("state1", huge_page_empty(state_size if optimizer.num_states >= 1 else 0,
                                                       torch.float32).zero_())
        self.register_buffer("state2", huge_page_empty(state_size if optimizer.num_states >= 2 else 0,
                                                       torch.float32).zero_())
        self.register_buffer("optimizer_step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("touched", torch.zeros(bitmap_bytes(int(self._touched_offsets[-1])), dtype=torch.uint8),
                             persistent=False)
        self._anchor = torch.zeros((), requires_grad=True)
        self._bounds = BoundsCheck(bounds_check, self.feature_names,
                                   [t.name for t in tables for _ in t.feature_names],
                                   [t.num_embeddings for t in tables for _ in t.feature_names])
        self._source_cache: dict[tuple[str, ...], np.ndarray] = {}
        self._torch_tables: dict[torch.device, torch_ops.TorchTables] = {}
        self._torch_sources: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}
        self._bad_ids: torch.Tensor | None = None
        """Ids outside their table's rows that torch-ops lookups left out with ``bounds_check
        = "none"``, counted on the device (no host sync per step); :meth:`check_ids` raises
        when there were any."""
        self._unread_checks: list[_PendingIdCheck] = []
        """With ``bounds_check = "fatal"``: the torch-ops lookups' counts of bad ids not yet
        read, oldest first (read before any update, by :meth:`check_ids` and in evaluation)."""

    # ----------------------------------------------------------------------------- layout
    def feature_columns(self, feature: str) -> slice:
        """Output columns of ``feature``'s pooled embedding."""
        f = self.feature_names.index(feature)
        start = int(self._out_columns[f])
        return slice(start, start + int(self._dims[self._feature_table[f]]))

    def table_weight(self, name: str) -> torch.Tensor:
        """View ``[rows, dim]`` of table ``name``'s weights (shares storage; the storage
        dtype)."""
        return self._table_view(self._table_index(name))

    def _table_view(self, t: int) -> torch.Tensor:
        start = int(self._table_offsets[t])
        size = int(self._rows[t] * self._dims[t])
        return self.weights[start : start + size].view(int(self._rows[t]), int(self._dims[t]))

    def table_state(self, name: str) -> list[torch.Tensor]:
        """Views ``[rows, width]`` of table ``name``'s optimizer state arrays."""
        return self._state_views(self._table_index(name))

    def _state_views(self, t: int) -> list[torch.Tensor]:
        start, width = int(self._state_offsets[t]), int(self._state_width[t])
        size = int(self._rows[t]) * width
        states = [self.state1, self.state2][: self.optimizer.num_states]
        return [s[start : start + size].view(int(self._rows[t]), width) for s in states]

    def state_views(self) -> dict[str, torch.Tensor]:
        """The module's state by table, as its state dict names it (see
        :mod:`~neorec.trainer.embedding.state_dict`): views of its buffers."""
        views = {}
        for t, table in enumerate(self.tables):
            views[f"embedding_bags.{table.name}.weight"] = self._table_view(t)
            for i, state in enumerate(self._state_views(t), 1):
                views[f"embedding_bags.{table.name}.momentum{i}"] = state
        views["optimizer_step"] = self.optimizer_step
        return views

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        save_tables(self.state_views(), destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        load_tables(self.state_views(), state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)

    def read_rows(self, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copies of rows ``rows`` (int64 ``[n]``) of table ``name``: weights float32
        ``[n, dim]`` and each optimizer state array's ``[n, width]``."""
        rows = self._checked_rows(name, rows)
        return (self.table_weight(name).index_select(0, rows).to(torch.float32),
                [state.index_select(0, rows) for state in self.table_state(name)])

    def write_rows(self, name: str, rows: torch.Tensor, weights: torch.Tensor, states: list[torch.Tensor]) -> None:
        """Overwrite rows ``rows`` (int64 ``[n]``, distinct) of table ``name`` with ``weights``
        ``[n, dim]`` and optimizer ``states`` (as :meth:`read_rows` returns them)."""
        rows = self._checked_rows(name, rows)
        table_states = self.table_state(name)
        if len(states) != len(table_states):
            raise ValueError(f"table {name!r} has {len(table_states)} optimizer states, got {len(states)}")
        if torch.unique(rows).numel() != rows.numel():
            raise ValueError("rows to write must be distinct")
        self.table_weight(name).index_copy_(0, rows, weights.to(self.weights.dtype))
        for target, source in zip(table_states, states):
            target.index_copy_(0, rows, source.to(torch.float32))

    def row_zeroer(self, rows: dict[str, np.ndarray]) -> Callable[[], None]:
        """A function that sets the rows ``rows[name]`` (int64 ``[n]``) of each table
        ``name``, weights and optimizer state, to zero whenever it is called: one write per
        array for all of them, their positions found once, here."""
        tables = np.array([self._table_index(name) for name in rows], dtype=np.int64)
        table_of_row = np.repeat(tables, [len(r) for r in rows.values()]).astype(np.int64)
        at = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows.values()]) if rows else np.zeros(0, np.int64)
        outside = (at < 0) | (at >= self._rows[table_of_row])
        if outside.any():
            t = int(table_of_row[np.argmax(outside)])
            raise IndexError(f"rows of table {self.tables[t].name!r} must lie in [0, {int(self._rows[t])})")
        positions = []
        for offsets, widths in [(self._table_offsets, self._dims)] + [(self._state_offsets, self._state_width)] * self.optimizer.num_states:
            width = widths[table_of_row]
            first = offsets[table_of_row] + at * width
            positions.append(torch.from_numpy(np.repeat(first - (np.cumsum(width) - width), width)
                                              + np.arange(int(width.sum()))))

        def zero() -> None:
            for flat, elements in zip([self.weights, self.state1, self.state2], positions):
                flat.index_fill_(0, elements.to(flat.device), 0)
        return zero

    def _checked_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(torch.int64).reshape(-1)
        limit = int(self._rows[self._table_index(name)])
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= limit):
            raise IndexError(f"rows of table {name!r} must lie in [0, {limit})")
        return rows

    def table_touched(self, name: str) -> torch.Tensor:
        """bool ``[rows]``: rows of table ``name`` updated since :meth:`clear_touched`."""
        return self._touched_rows(self._table_index(name)).mask()

    def _touched_rows(self, t: int) -> TouchedRows:
        return TouchedRows.of_table(self.touched, int(self._touched_offsets[t]), int(self._rows[t]))

    def clear_touched(self) -> None:
        self.touched.zero_()

    def slot_rows(self, name: str) -> np.ndarray:
        """int64 ``[rows]`` view: the table row each slot of slot table ``name`` holds (its
        owner keeps it current)."""
        t = self._table_index(name)
        base = int(self._slot_base[t])
        if base < 0:
            raise KeyError(f"table {name!r} is not a slot table")
        return self._slot_rows[base : base + int(self._rows[t])]

    def set_optimizer_steps(self, steps: int) -> None:
        """Set the sparse optimizer's step count (restoring a checkpoint)."""
        self.optimizer_step.fill_(steps)

    def local_optimizer_steps(self) -> int:
        return int(self.optimizer_step)

    def shard_views(self) -> list["ShardView"]:
        """Every table as a :class:`ShardView` of itself (the whole table at offset 0)."""
        return [ShardView(t.name, 0, 0, self._table_view(i), self._state_views(i), self._touched_rows(i),
                          self.weight_dtype, replicated=False) for i, t in enumerate(self.tables)]

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"no table named {name!r}")

    # ---------------------------------------------------------------------------- compute
    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        if not isinstance(sparse, KeyedJaggedTensor):
            raise TypeError(f"the module looks up a KeyedJaggedTensor, got {type(sparse).__name__}")
        if self.training and torch.is_grad_enabled():
            learned = sparse.weights if sparse.weights is not None and sparse.weights.requires_grad else None
            return _FusedLookup.apply(self._anchor, self, sparse, learned)
        out, lookup = self._lookup(sparse)
        self._note_bad_ids(sparse, lookup)
        self.check_ids()
        return out

    def _note_bad_ids(self, sparse: KeyedJaggedTensor, lookup: "_LookupContext | torch_ops.TorchLookup") -> None:
        """Keep a torch-ops lookup's count of the ids outside their tables (it left them
        out) for a later read: with ``bounds_check = "fatal"`` as an unread check, whose
        copy to the host starts now and which the next update (or :meth:`check_ids`) reads
        first, so the host need not wait for the device before then; otherwise added to
        the count :meth:`check_ids` reads. Nothing for the Numba lookup, which refused such
        a batch itself."""
        if not isinstance(lookup, torch_ops.TorchLookup):
            return
        if self._bounds.mode == "fatal":
            if len(self._unread_checks) >= MAX_UNREAD_CHECKS:  # forwards with no update: read them now
                self._refuse_unread()
            self._unread_checks.append(_PendingIdCheck(self, sparse, lookup.bad_ids))
            return
        self._bad_ids = lookup.bad_ids if self._bad_ids is None else self._bad_ids + lookup.bad_ids

    def _refuse_unread(self) -> None:
        """Read the unread checks, oldest first; ``IndexError`` naming the first bad id of
        the first batch that had one."""
        unread, self._unread_checks = self._unread_checks, []
        for pending in unread:
            pending.refuse_if_bad()

    def _feature_source(self, sparse: KeyedJaggedTensor) -> np.ndarray:
        source = self._source_cache.get(sparse.keys)
        if source is None:
            source = np.array(sparse.positions_of(self.feature_names), dtype=np.int64)
            self._source_cache[sparse.keys] = source
        return source

    def _uses_torch_ops(self) -> bool:
        return self.kernels == "torch" or (self.kernels == "auto" and self.weights.device.type != "cpu")

    def _lookup(self, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, "_LookupContext | torch_ops.TorchLookup"]:
        if self._uses_torch_ops():
            out, lookup = torch_ops.pooled_forward(
                self.weights, self._tables_on(self.weights.device), self._feature_source(sparse).tolist(),
                self._module_features(sparse), sparse.lengths, sparse.values, sparse.weights, sparse.batch_size)
            return out, lookup
        batch_size = sparse.batch_size
        num_ids = sparse.values.numel()
        scaled = sparse.weights is not None or bool(self._mean_pooling.any())
        ctx = _LookupContext(
            source=self._feature_source(sparse),
            bag_offsets=sparse.offsets().numpy(),
            values=sparse.values.numpy(),
            batch_size=batch_size,
            upstream_of_id=np.empty(num_ids, dtype=np.int64),
            scale_of_id=np.empty(num_ids, dtype=np.float32) if scaled else _EMPTY_F32,
        )
        out = torch.empty(batch_size, self.output_dim, dtype=torch.float32)
        jobs = bags_per_job(len(self.feature_names) * batch_size, numba.get_num_threads())
        weights, weights16, precision = self._kernel_weights()
        if self._pools_in_registers and sparse.weights is None:
            layout = (self._table_offsets, self._dims, self._rows, self._feature_table, ctx.source, self._out_columns,
                      ctx.bag_offsets, ctx.values, batch_size, jobs, out.view(-1).numpy(), ctx.upstream_of_id,
                      streams_output(out.numpy()))
            bad = (pooled_sum_lanes(weights, *layout) if precision == FP32
                   else pooled_half_sum_lanes(weights16, precision, *layout))
        else:
            bad = pooled_forward(
                weights, weights16, precision, self._table_offsets, self._dims, self._rows, self._feature_table,
                ctx.source, self._out_columns, self._mean_pooling, ctx.bag_offsets, ctx.values,
                _EMPTY_F32 if sparse.weights is None else sparse.weights.numpy(), batch_size, jobs,
                out.view(-1).numpy(), ctx.upstream_of_id, ctx.scale_of_id,
            )
        if bad:  # nothing is written yet but the output: the check names the first bad id
            self._bounds(sparse)
            self._refuse(bad)
        return out, ctx

    def _id_weight_grads(self, sparse: KeyedJaggedTensor, grad_out: torch.Tensor) -> torch.Tensor:
        """float32 ``[n]``: the gradient of ``sparse``'s per-id weights (before the update)."""
        return id_weight_grads(self.weights, self._tables_on(self.weights.device), self._module_features(sparse),
                               sparse.lengths, sparse.values, sparse.batch_size, grad_out)

    def _tables_on(self, device: torch.device) -> torch_ops.TorchTables:
        """The layout the torch ops index, on ``device`` (copied there once)."""
        if device not in self._torch_tables:
            self._torch_tables[device] = torch_ops.TorchTables.build(
                device, self._table_offsets, self._state_offsets, self._touched_offsets, self._rows, self._dims,
                self._state_width, self._mean_pooling, self._learning_rates, self._noise_origin, self._slot_base,
                self._feature_table, self._out_columns)
        return self._torch_tables[device]

    def _module_features(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """int64 ``[F]`` on the batch's device: the module feature of each batch feature
        (-1: none)."""
        key = (sparse.keys, sparse.values.device)
        if key not in self._torch_sources:
            inverse = np.full(len(sparse.keys), -1, dtype=np.int64)
            inverse[self._feature_source(sparse)] = np.arange(len(self.feature_names))
            self._torch_sources[key] = torch.from_numpy(inverse).to(sparse.values.device)
        return self._torch_sources[key]

    def check_ids(self) -> None:
        """Raise ``IndexError`` if a torch-ops lookup since the last check (or, with
        ``bounds_check = "fatal"``, since the last update) met ids outside their table's
        rows (they were left out); reads their counts from the device."""
        self._refuse_unread()
        bad, self._bad_ids = self._bad_ids, None
        if bad is not None and int(bad):
            self._refuse(int(bad))

    def _refuse(self, bad: int) -> None:
        raise IndexError(f"{bad} ids are outside their table's rows {self._describe_ranges()}")

    def _kernel_weights(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The kernels' view of the weights: float32 array, uint16 half array (one of them
        empty) and the precision code."""
        if self._precision == FP32:
            return self.weights.numpy(), _EMPTY_U16, FP32
        return _EMPTY_F32, self.weights.view(torch.int16).numpy().view(np.uint16), self._precision

    def _describe_ranges(self) -> str:
        return ", ".join(f"{t.name}: [0, {t.num_embeddings})" for t in self.tables)

    def _backward_update(self, ctx: "_LookupContext | torch_ops.TorchLookup", grad_out: torch.Tensor) -> None:
        self._refuse_unread()  # every lookup since the last update, before anything is updated
        self.optimizer_step += 1
        if isinstance(ctx, torch_ops.TorchLookup):
            torch_ops.apply_updates(
                self.weights, [self.state1, self.state2][: self.optimizer.num_states], self.touched,
                self._tables_on(self.weights.device), ctx, grad_out, self.optimizer, self.optimizer_step,
                torch_ops.Rounding(None if self._precision == FP32 else self.weights.dtype, self._rounding_seed),
                torch.from_numpy(self._slot_rows).to(self.weights.device) if self._slot_rows.size else None,
            )
            return
        grad_rows, row_stride = _gradient_rows(grad_out)
        grouped = backward_kernels.group_by_row(ctx.values, ctx.upstream_of_id, ctx.scale_of_id, ctx.bag_offsets,
                                                ctx.batch_size, ctx.source, self._table_features, self.output_dim,
                                                row_stride)
        opt = self.optimizer
        backward_kernels.apply_updates(
            *self._kernel_weights(), self._rounding_seed, self._noise_origin, self._slot_base, self._slot_rows,
            self.state1.numpy(), self.state2.numpy(),
            self._table_offsets, self._state_offsets, self._state_width, self._touched_offsets, self._dims, *grouped,
            grad_rows, _OPTIMIZER_CODES[opt.kind], self._learning_rates,
            opt.eps, opt.beta1, opt.beta2, opt.weight_decay, opt.adagrad_decay, int(self.optimizer_step), self.touched.numpy(),
            _max_chunks(),
        )


@dataclass
class ShardView:
    """A piece of a table that a module holds, as views of the module's storage:
    ``weight`` ``[rows, cols]`` (storage dtype), each optimizer state ``[rows, width]``
    (float32) and ``touched``, the flags of the rows updated, for rows ``[row_offset, row_offset + rows)``
    and columns ``[col_offset, col_offset + cols)`` of table ``table``. A ``replicated``
    piece has an identical copy on every rank (a data-parallel table)."""

    table: str
    row_offset: int
    col_offset: int
    weight: torch.Tensor
    states: list[torch.Tensor]
    touched: TouchedRows
    storage: str
    replicated: bool


class _LookupContext:
    """Arrays of one forward call that its backward reuses."""

    __slots__ = ("source", "bag_offsets", "values", "batch_size", "upstream_of_id", "scale_of_id")

    def __init__(self, source, bag_offsets, values, batch_size, upstream_of_id, scale_of_id) -> None:
        self.source = source
        self.bag_offsets = bag_offsets
        self.values = values
        self.batch_size = batch_size
        self.upstream_of_id = upstream_of_id
        self.scale_of_id = scale_of_id


def check_ids(model: nn.Module) -> None:
    """Raise ``IndexError`` if a torch-ops lookup of any fused module in ``model`` met ids
    outside their table's rows since the last check (with ``bounds_check = "none"`` a
    training step only counts them on the device, and the loop checks at its log lines;
    with ``"fatal"`` each update reads the counts first)."""
    for module in model.modules():
        if isinstance(module, FusedEmbeddingBagCollection):
            module.check_ids()


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, module: FusedEmbeddingBagCollection, sparse: KeyedJaggedTensor,
                learned_weights: torch.Tensor | None):
        """``learned_weights``: ``sparse.weights`` when they require a gradient (an input of
        the graph then), else None."""
        out, lookup = module._lookup(sparse)
        ctx.module = module
        ctx.lookup = lookup
        ctx.sparse = sparse if learned_weights is not None else None
        module._note_bad_ids(sparse, lookup)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_out = grad_out.float()  # a no-op for float32: a slice of a wider gradient is read where it is
        module = ctx.module
        learned = module._id_weight_grads(ctx.sparse, grad_out) if ctx.sparse is not None else None  # rows unchanged
        module._backward_update(ctx.lookup, grad_out)
        return None, None, None, learned


def _gradient_rows(grad_out: torch.Tensor) -> tuple[np.ndarray, int]:
    """The upstream gradient float32 ``[B, C]`` as the update kernel reads it: a flat array
    in which sample b's row begins at ``b * S``, and the row stride S. A gradient whose rows
    are each contiguous is read where it is (the interaction's gradient of the pooled
    embeddings is a slice of the wider gradient of all its vectors, ``S > C``); any other
    is copied first."""
    if grad_out.stride(1) != 1 or grad_out.stride(0) < grad_out.shape[1]:
        grad_out = grad_out.contiguous()
    batch_size, width = grad_out.shape
    row_stride = max(grad_out.stride(0), width)  # a single row's stride may be anything
    flat = grad_out.as_strided(((batch_size - 1) * row_stride + width if batch_size else 0,), (1,))
    return flat.numpy(), row_stride


class _PendingIdCheck:
    """The refusal of a torch-ops lookup's batch if it had ids outside their tables: the
    lookup's int64 count of them is copied to the host without waiting (CUDA: into pinned
    memory, an event marking the copy's end), read only by :meth:`refuse_if_bad`."""

    def __init__(self, module: FusedEmbeddingBagCollection, sparse: KeyedJaggedTensor, bad_ids: torch.Tensor) -> None:
        self.module = module
        self.sparse = sparse
        self.event: torch.cuda.Event | None = None
        if bad_ids.device.type == "cuda":
            self.count = torch.empty((), dtype=torch.int64, pin_memory=True)
            self.count.copy_(bad_ids, non_blocking=True)  # on the current stream of bad_ids' device
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(bad_ids.device))
        else:
            self.count = bad_ids

    def refuse_if_bad(self) -> None:
        """Raise ``IndexError`` naming the batch's first bad id if the count is not zero."""
        if self.event is not None:
            self.event.synchronize()
        bad = int(self.count)
        if bad:
            self.module._bounds(self.sparse, host_kernels=False)
            self.module._refuse(bad)


def _max_chunks() -> int:
    """Chunks of the update kernel's work: a few per thread, for load balance (each chunk
    reuses one scratch gradient buffer)."""
    return 16 * numba.get_num_threads()


_EMPTY_F32 = np.zeros(0, dtype=np.float32)
_EMPTY_U16 = np.zeros(0, dtype=np.uint16)


def initial_table_weight(table_index: int, rows: int, dim: int, seed: int, row_offset: int = 0,
                         shard_rows: int | None = None, columns: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 ``[shard_rows, cols]``: rows ``[row_offset, row_offset + shard_rows)`` (default:
    all ``rows``) and ``columns`` of table number ``table_index`` as they start, uniform in
    ``±sqrt(1 / rows)`` (DLRM's init), each element a pure function of (seed, table, row,
    column) (:func:`neorec.embedding_store.initial.initial_rows`): a shard, or a row a store tier
    reads for the first time, starts where the whole table in memory would."""
    count = rows - row_offset if shard_rows is None else shard_rows
    return torch.from_numpy(initial_block(seed, table_index, row_offset, count, rows, dim, columns))
