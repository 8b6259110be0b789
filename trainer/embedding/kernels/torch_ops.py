"""The fused module's lookup and fused update in torch ops, for CUDA (and any device):
the same semantics as the Numba kernels, deterministic on every device, and free of host
synchronisation, so that a GPU step runs without waiting for the host.

Every size comes from the batch's shapes, never from its contents: there is no
``.item()``, ``nonzero``, ``unique`` or boolean indexing. Each id of the batch is
handled where it stands, one embedding dimension at a time (ids of tables of another
dimension, or of features no table here looks up, weigh zero).

Forward: gather every id's row from the flat weights, scale by the per-id weight,
``segment_reduce`` each bag (sum, then the mean's division). Update: the ids are sorted by
(table, row), stable, so a row's contributions stay in batch order; each run of one row is
summed with ``segment_reduce`` over ``n`` segments (one per id, the empty ones after the
last run); the optimizer updates every run's row. A write for a run that is not a row of
the dimension being updated repeats the write of the first run that is, so that no two
writes to one element differ. Atomics only add integers (counts, the touched bitmap's
bits), which are exact in any order, so the result does not depend on scheduling.
Half-precision weights are read as float32 and each update is rounded back
to nearest even or stochastically, with the Numba kernels' noise
(``precision.noise_of``, here in int64 ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from neorec.common.hashing import GOLDEN, MIX1, MIX2, SALT, fold_mix32_int64, signed
from neorec.trainer.embedding.config import SparseOptimizer


@dataclass(frozen=True)
class TorchTables:
    """A fused module's tables as torch ops index them, on the module's device.

    Per table (int64 ``[T]`` unless said): ``table_offsets`` (first element in the flat
    weights), ``state_offsets`` (in each flat state array), ``row_offsets`` (first bit in
    the ``touched`` bitmap, a multiple of 8; ``[T + 1]``, the last is the total), ``rows``, ``mean_pooling``
    (bool), ``learning_rates`` (float32), ``noise_origin`` (``[T, 4]``, see :func:`_round`)
    ``slot_base`` (first of the table's slot rows; -1: not a slot table) and ``group``
    (its dimension's number in ``dim_groups``); per module feature (int64 ``[F]``)
    ``feature_tables`` and ``feature_columns``. On the host: per module feature its
    ``feature_table`` and ``out_columns``; per table ``dims``, ``state_widths`` and
    ``means`` (mean pooling); ``dim_groups``: the tables of each embedding dimension.
    """

    table_offsets: torch.Tensor
    state_offsets: torch.Tensor
    row_offsets: torch.Tensor
    rows: torch.Tensor
    mean_pooling: torch.Tensor
    learning_rates: torch.Tensor
    noise_origin: torch.Tensor
    slot_base: torch.Tensor
    group: torch.Tensor
    feature_tables: torch.Tensor
    feature_columns: torch.Tensor
    feature_table: list[int]
    out_columns: list[int]
    dims: list[int]
    state_widths: list[int]
    means: list[bool]
    dim_groups: dict[int, list[int]]
    _placements: dict[tuple[int, ...], list["GroupPlacement"]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, device: torch.device, table_offsets: np.ndarray, state_offsets: np.ndarray,
              row_offsets: np.ndarray, rows: np.ndarray, dims: np.ndarray, state_widths: np.ndarray,
              mean_pooling: np.ndarray, learning_rates: np.ndarray, noise_origin: np.ndarray, slot_base: np.ndarray,
              feature_table: np.ndarray, out_columns: np.ndarray) -> "TorchTables":
        """From a fused module's layout arrays (numpy, per table / per feature)."""
        def on(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        groups: dict[int, list[int]] = {}
        for t, d in enumerate(dims.tolist()):
            groups.setdefault(int(d), []).append(t)
        group = np.array([list(groups).index(int(d)) for d in dims.tolist()], dtype=np.int64)
        return cls(on(table_offsets), on(state_offsets), on(row_offsets), on(rows),
                   on(mean_pooling), on(learning_rates), on(noise_origin), on(slot_base), on(group),
                   on(feature_table.astype(np.int64)), on(out_columns.astype(np.int64)), feature_table.tolist(),
                   out_columns.tolist(), dims.tolist(), state_widths.tolist(), mean_pooling.tolist(), groups)

    @property
    def width(self) -> int:
        """Columns of the pooled output."""
        return sum(self.dims[t] for t in self.feature_table)

    def placements(self, source: tuple[int, ...]) -> list["GroupPlacement"]:
        """Per dimension group (``dim_groups`` order), where its pooled bags go in the
        output when module feature ``f`` is batch feature ``source[f]`` (made on the device
        once per batch layout)."""
        placed = self._placements.get(source)
        if placed is None:
            device = self.rows.device
            placed = []
            for dim, members in self.dim_groups.items():
                features = [f for f, t in enumerate(self.feature_table) if t in members]
                columns = [self.out_columns[f] + c for f in features for c in range(dim)]
                means = [self.means[self.feature_table[f]] for f in features]
                placed.append(GroupPlacement(
                    torch.tensor([source[f] for f in features], dtype=torch.int64, device=device),
                    torch.tensor(columns, dtype=torch.int64, device=device),
                    torch.tensor(means, device=device)[:, None] if any(means) else None))
            self._placements[source] = placed
        return placed


@dataclass(frozen=True)
class GroupPlacement:
    """Where the pooled bags of one dimension group's module features go (device tensors):
    ``batch_features`` int64 ``[F_g]``, the batch feature of each; ``columns`` int64
    ``[F_g * dim]``, their output columns in that order; ``means`` bool ``[F_g, 1]``, which
    are mean-pooled (None: none is)."""

    batch_features: torch.Tensor
    columns: torch.Tensor
    means: torch.Tensor | None


@dataclass
class TorchLookup:
    """What a forward keeps for its update, per id of the batch (``[n]``, batch order):
    ``ids`` int64 (its row; 0 where unused), ``table`` int64, ``feature`` int64 (the module
    feature; -1: a feature no table here looks up, or an id outside its table), ``samples``
    int64 and ``scales`` float32 (per-id weight, over the bag length for mean pooling);
    ``bad_ids``: int64 scalar, the ids outside their table's rows (left out)."""

    ids: torch.Tensor
    table: torch.Tensor
    feature: torch.Tensor
    samples: torch.Tensor
    scales: torch.Tensor
    bad_ids: torch.Tensor


def pooled_forward(weights: torch.Tensor, tables: TorchTables, source: list[int], module_feature_of: torch.Tensor,
                   lengths: torch.Tensor, values: torch.Tensor, id_weights: torch.Tensor | None,
                   batch_size: int) -> tuple[torch.Tensor, TorchLookup]:
    """float32 ``[B, C]`` pooled output of the flat ``weights`` (storage dtype) for the
    batch ``lengths`` int32 ``[F * B]``, ``values`` int64 ``[n]``, ``id_weights`` float32
    ``[n]`` (feature-major); ``source[f]``: the batch feature of module feature ``f``;
    ``module_feature_of`` int64 ``[F]`` (device): its inverse, -1 for a batch feature of no
    table here."""
    device, n = values.device, values.numel()
    if batch_size == 0:  # no bags: every feature looks up nothing
        nothing = values.new_zeros(0)
        return torch.zeros(0, tables.width, dtype=torch.float32, device=device), TorchLookup(
            nothing, nothing, nothing, nothing, nothing.float(), nothing.sum())
    bag_lengths = lengths.to(torch.int64)
    bag = torch.repeat_interleave(torch.arange(bag_lengths.numel(), device=device), bag_lengths, output_size=n)
    feature = module_feature_of[bag // batch_size]
    table = tables.feature_tables[feature.clamp(min=0)]
    inside = (values >= 0) & (values < tables.rows[table])
    bad_ids = ((feature >= 0) & ~inside).sum()
    feature = torch.where(inside, feature, -1)
    used = feature >= 0
    ids = torch.where(used, values, 0)
    counts = bag_lengths.clamp(min=1).to(torch.float32)
    weight = used.to(torch.float32) if id_weights is None else torch.where(used, id_weights, 0.0)
    scales = torch.where(tables.mean_pooling[table], weight / counts[bag], weight)
    out = torch.empty(batch_size, tables.width, dtype=torch.float32, device=device)  # every column is placed
    placements = tables.placements(tuple(source))
    for g, (dim, members) in enumerate(tables.dim_groups.items()):
        in_group = used & (tables.group[table] == g)
        element = torch.where(in_group, tables.table_offsets[table] + ids * dim, 0)
        rows = weights[element[:, None] + torch.arange(dim, device=device)].float()
        rows = rows * torch.where(in_group, weight, 0.0)[:, None]
        pooled = torch.segment_reduce(rows, "sum", lengths=bag_lengths, unsafe=True) if n else \
            torch.zeros(bag_lengths.numel(), dim, device=device)
        place = placements[g]
        block = pooled.view(-1, batch_size, dim)[place.batch_features]  # [F_g, B, dim]
        if place.means is not None:  # (x / 1 is x)
            block = block / torch.where(place.means, counts.view(-1, batch_size)[place.batch_features], 1.0)[:, :, None]
        out[:, place.columns] = block.transpose(0, 1).reshape(batch_size, -1)
    return out, TorchLookup(ids, table, feature, bag % batch_size, scales, bad_ids)


@dataclass(frozen=True)
class Rounding:
    """How updated half-precision weights are stored: ``dtype`` (``None``: float32 storage)
    and the stochastic rounding seed (``< 0``: to nearest even)."""

    dtype: torch.dtype | None
    seed: int


def apply_updates(weights: torch.Tensor, states: list[torch.Tensor], touched: torch.Tensor, tables: TorchTables,
                  saved: TorchLookup, grad_out: torch.Tensor, optimizer: SparseOptimizer, step: torch.Tensor,
                  rounding: Rounding, slot_rows: torch.Tensor | None) -> None:
    """Update every row the lookup touched, in place: the flat ``weights`` (storage dtype),
    flat optimizer ``states`` (float32), the ``touched`` bitmap (uint8, see
    :mod:`~neorec.trainer.embedding.touched`).
    ``grad_out`` float32 ``[B, C]`` (any strides); ``step`` int64 scalar (device): the optimizer step;
    ``slot_rows`` int64: the table row each slot holds, for slot tables (the rounding
    noise follows the row), else None."""
    n = saved.ids.numel()
    if n == 0:
        return
    device = saved.ids.device
    total_rows = tables.row_offsets[-1]
    key = torch.where(saved.feature >= 0, tables.row_offsets[saved.table] + saved.ids, total_rows)
    sorted_key, order = torch.sort(key, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=device)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    run = torch.cumsum(starts, 0) - 1
    run_lengths = torch.zeros(n, dtype=torch.int64, device=device).index_add_(0, run, torch.ones_like(run))
    run_key = total_rows.expand(n).clone()
    run_key.scatter_(0, run, sorted_key)  # a run's positions all carry its key
    valid = run_key < total_rows
    run_table = (torch.searchsorted(tables.row_offsets, run_key, right=True) - 1).clamp(0, len(tables.dims) - 1)
    run_row = run_key - tables.row_offsets[run_table]
    positions = torch.arange(n, device=device)
    feature_columns = tables.feature_columns[saved.feature.clamp(min=0)]
    for g, (dim, members) in enumerate(tables.dim_groups.items()):
        mine = valid & (tables.group[run_table] == g)
        source = torch.where(mine, positions, torch.argmax(mine.to(torch.int8)))
        keep = mine[source]  # False only when no run is of this dimension: then every write is a no-op
        t = torch.where(keep, run_table[source], members[0])
        row = torch.where(keep, run_row[source], 0)
        id_in_group = (saved.feature >= 0) & (tables.group[saved.table] == g)
        sample = torch.where(id_in_group, saved.samples, 0)
        column = torch.where(id_in_group, feature_columns, 0)
        gathered = grad_out[sample[:, None], column[:, None] + torch.arange(dim, device=device)]  # any strides
        gathered = gathered * torch.where(id_in_group, saved.scales, 0.0)[:, None]
        grad = torch.segment_reduce(gathered[order], "sum", lengths=run_lengths, unsafe=True)[source]
        element = (tables.table_offsets[t] + row * dim)[:, None] + torch.arange(dim, device=device)
        w = weights[element].float()
        state_width = tables.state_widths[members[0]]
        state_element = (tables.state_offsets[t] + row * state_width)[:, None] + \
            torch.arange(state_width, device=device)
        current = [s[state_element] for s in states]
        new_w, new_states = _optimizer_step(w, grad, current, optimizer, tables.learning_rates[t][:, None], step)
        held = row if slot_rows is None else torch.where(tables.slot_base[t] >= 0,
                                                         slot_rows[(tables.slot_base[t] + row).clamp(min=0)], row)
        rounded = _round(new_w, rounding, step, held, tables.noise_origin[t])
        keep2 = keep[:, None]
        weights.index_put_((element,), torch.where(keep2, rounded, weights[element]))
        for target, old, new in zip(states, current, new_states):
            target.index_put_((state_element,), torch.where(keep2, new, old))
        _mark(touched, tables.row_offsets[t] + row, mine)


def _mark(touched: torch.Tensor, bits: torch.Tensor, mine: torch.Tensor) -> None:
    """Set the bits ``bits[mine]`` (int64; the ones where ``mine`` is true must be distinct)
    of the ``touched`` bitmap, without a host sync: each byte gets the sum of its bits not
    yet set (distinct powers of two, so no carry; entries outside ``mine`` add 0). An
    integer sum is exact in any order, so the atomic adds of ``index_add_`` on CUDA give one
    result (``index_put_(accumulate=True)``, which sorts first, was a GPU step's largest
    kernel: BENCHMARKS.md)."""
    byte = bits >> 3
    value = torch.ones_like(bits) << (bits & 7)
    unset = (touched[byte].to(torch.int64) & value) == 0
    touched.index_add_(0, byte, torch.where(mine & unset, value, 0).to(torch.uint8))


def _optimizer_step(w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], opt: SparseOptimizer,
                    lr: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """New float32 weights ``[n, dim]`` and optimizer states of rows ``w`` with gradient
    ``g``; ``lr`` float32 ``[n, 1]``, ``step`` int64 scalar tensor."""
    if opt.weight_decay:
        g = g + opt.weight_decay * w
    if opt.kind == "sgd":
        return w - lr * g, []
    if opt.kind == "adagrad":
        s = _decayed(states[0], opt) + g * g
        return w - lr * g / (s.sqrt() + opt.eps), [s]
    if opt.kind == "rowwise_adagrad":
        s = _decayed(states[0], opt) + (g * g).mean(dim=1, keepdim=True)
        return w - (lr / (s.sqrt() + opt.eps)) * g, [s]
    m = opt.beta1 * states[0] + (1 - opt.beta1) * g
    v = opt.beta2 * states[1] + (1 - opt.beta2) * g * g
    steps = step.to(torch.float64)
    beta1 = torch.full((), opt.beta1, dtype=torch.float64, device=w.device)  # filled there: no host copy
    beta2 = torch.full((), opt.beta2, dtype=torch.float64, device=w.device)
    step_size = (1 - beta2.pow(steps)).sqrt() / (1 - beta1.pow(steps))
    return w - (lr.double() * step_size).float() * m / (v.sqrt() + opt.eps), [m, v]


def _decayed(squares: torch.Tensor, opt: SparseOptimizer) -> torch.Tensor:
    """An Adagrad sum of squares (float32) multiplied by ``opt.adagrad_decay``, or itself
    when that is 1."""
    return squares if opt.adagrad_decay == 1 else squares * opt.adagrad_decay


def _round(w: torch.Tensor, rounding: Rounding, step: int | torch.Tensor, rows: torch.Tensor,
           origin: torch.Tensor | tuple[int, int, int, int]) -> torch.Tensor:
    """``w`` float32 ``[n, dim]`` in the storage dtype; ``rows`` int64 ``[n]`` the rows
    they are of, ``origin`` where their table lies in the whole table (table id, first row,
    first column, full width): one tuple, or int64 ``[n, 4]`` per row."""
    if rounding.dtype is None:
        return w
    nearest = w.to(rounding.dtype)
    if rounding.seed < 0:
        return nearest
    origin = torch.as_tensor(origin, dtype=torch.int64, device=w.device).reshape(-1, 4)
    table_id, row0, col0, full_width = (origin[:, i : i + 1] for i in range(4))
    element = (table_id << 40) + (row0 + rows[:, None]) * full_width + col0 + torch.arange(w.shape[1], device=w.device)
    noise = _uniform_noise(rounding.seed, step, element)
    # the two half values around w: nearest and its neighbour on w's other side
    near32 = nearest.float()
    bits = nearest.view(torch.int16).to(torch.int32) & 0x7FFF
    beyond = near32.abs() > w.abs()
    low_bits = torch.where(beyond, bits - 1, bits)
    low = _from_bits(low_bits.clamp(min=0), w, rounding.dtype)
    high = _from_bits(low_bits + 1, w, rounding.dtype)
    fraction = (w.abs().double() - low.abs().double()) / (high.abs().double() - low.abs().double())
    up = noise >= 1.0 - fraction
    exact_or_special = (near32 == w) | ~torch.isfinite(near32) | ~torch.isfinite(w)
    return torch.where(exact_or_special, nearest, torch.where(up, high, low))


def _from_bits(magnitude: torch.Tensor, sign_of: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half values of int32 magnitude bit patterns, with the sign of ``sign_of``."""
    bits = magnitude | torch.where(sign_of < 0, 0x8000, 0)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def _uniform_noise(seed: int, step: int | torch.Tensor, element: torch.Tensor) -> torch.Tensor:
    """float64 uniform [0, 1) in steps of 2**-32: the noise of ``(seed, step, element)`` as
    :func:`neorec.trainer.embedding.kernels.precision.noise_of` makes it, in int64
    (wrapping) arithmetic; ``step`` a number or an int64 scalar tensor."""
    if isinstance(step, torch.Tensor):  # the same sum modulo 2**64, in int64 ops
        start = signed(seed * GOLDEN + SALT) + step * signed(MIX1)
    else:
        start = signed(seed * GOLDEN + step * MIX1 + SALT)
    return fold_mix32_int64(start + element * signed(MIX2)).double() * (1.0 / 4294967296.0)
