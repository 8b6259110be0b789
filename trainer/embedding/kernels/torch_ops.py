"""The fused module's lookup and fused update in torch ops, for CUDA (and any device):
the same semantics as the Numba kernels, deterministic on every device.

Forward: per feature, gather the rows, scale by the per-id weights, ``segment_reduce``
each bag (sum, then the mean's division). Update: per table, the ids' gradient rows are
sorted by row (stable, so a row's contributions stay in feature, sample, position order)
and summed per row with ``segment_reduce``; the optimizer then updates the distinct rows.
No atomics anywhere, so the result does not depend on scheduling. Half-precision weights
are read as float32 and each update is rounded back to nearest even or stochastically,
with the Numba kernels' noise (``precision.noise_bits_of``, here in int64 ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.common.hashing import GOLDEN, MIX1, MIX2, SALT, mix64_int64, signed
from neorec.trainer.embedding.config import SparseOptimizer

@dataclass
class TorchLookup:
    """What a forward keeps for its update: per feature, its ids int64 ``[n_f]``, their
    bags ``[n_f]`` and scales float32 ``[n_f]`` (per-id weight, over the bag length for mean
    pooling)."""

    ids: list[torch.Tensor]
    bags: list[torch.Tensor]
    scales: list[torch.Tensor | None]


def pooled_forward(table_views: list[torch.Tensor], feature_table: list[int], source: list[int],
                   out_columns: list[int], mean_pooling: list[bool], lengths: torch.Tensor, values: torch.Tensor,
                   id_weights: torch.Tensor | None, batch_size: int) -> tuple[torch.Tensor, TorchLookup]:
    """float32 ``[B, C]`` pooled output; ``table_views[t]`` is table ``t`` ``[rows, dim]``
    (storage dtype), ``lengths``/``values``/``id_weights`` the batch (feature-major)."""
    width = sum(table_views[t].shape[1] for t in feature_table)
    out = torch.zeros(batch_size, width, dtype=torch.float32, device=values.device)
    if batch_size == 0:  # no bags: every feature looks up nothing
        nothing = values.new_zeros(0)
        return out, TorchLookup([nothing] * len(feature_table), [nothing] * len(feature_table),
                                [None] * len(feature_table))
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    starts = offsets[::batch_size].tolist()
    saved = TorchLookup([], [], [])
    for f, t in enumerate(feature_table):
        table = table_views[t]
        lo, hi = starts[source[f]], starts[source[f] + 1]
        ids = values[lo:hi]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
            raise IndexError(f"ids are outside their table's rows [0, {table.shape[0]}) (feature {f})")
        bag_lengths = lengths[source[f] * batch_size : (source[f] + 1) * batch_size].to(torch.int64)
        bags = torch.repeat_interleave(torch.arange(batch_size, device=values.device), bag_lengths)
        scale = None if id_weights is None else id_weights[lo:hi]
        if mean_pooling[t]:
            counts = bag_lengths.clamp(min=1).to(torch.float32)[bags]
            scale = 1.0 / counts if scale is None else scale / counts
        rows = table.index_select(0, ids).float()
        if id_weights is not None:
            rows = rows * id_weights[lo:hi, None]
        pooled = torch.segment_reduce(rows, "sum", lengths=bag_lengths, unsafe=True) if rows.numel() else \
            torch.zeros(batch_size, table.shape[1], device=values.device)
        if mean_pooling[t]:
            pooled = pooled / bag_lengths.clamp(min=1).to(torch.float32)[:, None]
        out[:, out_columns[f] : out_columns[f] + table.shape[1]] = pooled
        saved.ids.append(ids)
        saved.bags.append(bags)
        saved.scales.append(scale)
    return out, saved


@dataclass(frozen=True)
class Rounding:
    """How updated half-precision weights are stored: ``dtype`` (``None``: float32 storage)
    and the stochastic rounding seed (``< 0``: to nearest even)."""

    dtype: torch.dtype | None
    seed: int


def apply_updates(table_views: list[torch.Tensor], state_views: list[list[torch.Tensor]],
                  touched_views: list[torch.Tensor], feature_table: list[int], out_columns: list[int],
                  saved: TorchLookup, grad_out: torch.Tensor, optimizer: SparseOptimizer,
                  learning_rates: list[float], step: int, rounding: Rounding,
                  noise_origin: list[tuple[int, int, int, int]], slot_rows: list[torch.Tensor | None]) -> None:
    """Update every row the lookup touched, table by table, in place. ``slot_rows[t]``: the
    table row each row of table ``t`` holds when its rows are cache slots (the rounding noise
    follows the row), else None."""
    for t, table in enumerate(table_views):
        features = [f for f, ft in enumerate(feature_table) if ft == t]
        if not features:
            continue
        dim = table.shape[1]
        ids = torch.cat([saved.ids[f] for f in features])
        if ids.numel() == 0:
            continue
        pieces = []
        for f in features:
            g = grad_out[saved.bags[f], out_columns[f] : out_columns[f] + dim]
            pieces.append(g if saved.scales[f] is None else g * saved.scales[f][:, None])
        grads = torch.cat(pieces)
        sorted_ids, order = torch.sort(ids, stable=True)
        rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        grad = torch.segment_reduce(grads[order], "sum", lengths=counts, unsafe=True)
        weights = table.index_select(0, rows).float()
        new_weights = _optimizer_step(weights, grad, [s.index_select(0, rows) for s in state_views[t]],
                                      state_views[t], rows, optimizer, learning_rates[t], step)
        held = rows if slot_rows[t] is None else slot_rows[t].to(rows.device)[rows]
        table.index_copy_(0, rows, _round(new_weights, rounding, step, held, noise_origin[t]))
        touched_views[t].index_fill_(0, rows, 1)


def _optimizer_step(w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], state_views: list[torch.Tensor],
                    rows: torch.Tensor, opt: SparseOptimizer, lr: float, step: int) -> torch.Tensor:
    """New float32 weights of ``rows``; writes their new optimizer state."""
    if opt.weight_decay:
        g = g + opt.weight_decay * w
    if opt.kind == "sgd":
        return w - lr * g
    if opt.kind == "adagrad":
        s = states[0] + g * g
        state_views[0].index_copy_(0, rows, s)
        return w - lr * g / (s.sqrt() + opt.eps)
    if opt.kind == "rowwise_adagrad":
        s = states[0] + (g * g).mean(dim=1, keepdim=True)
        state_views[0].index_copy_(0, rows, s)
        return w - (lr / (s.sqrt() + opt.eps)) * g
    m = opt.beta1 * states[0] + (1 - opt.beta1) * g
    v = opt.beta2 * states[1] + (1 - opt.beta2) * g * g
    state_views[0].index_copy_(0, rows, m)
    state_views[1].index_copy_(0, rows, v)
    step_size = (1 - opt.beta2 ** step) ** 0.5 / (1 - opt.beta1 ** step)
    return w - lr * step_size * m / (v.sqrt() + opt.eps)


def _round(w: torch.Tensor, rounding: Rounding, step: int, rows: torch.Tensor,
           origin: tuple[int, int, int, int]) -> torch.Tensor:
    """``w`` float32 ``[n, dim]`` in the storage dtype."""
    if rounding.dtype is None:
        return w
    nearest = w.to(rounding.dtype)
    if rounding.seed < 0:
        return nearest
    table_id, row0, col0, full_width = origin
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


def _uniform_noise(seed: int, step: int, element: torch.Tensor) -> torch.Tensor:
    """float64 uniform [0, 1): splitmix64 of ``(seed, step, element)`` as
    :func:`neorec.trainer.embedding.kernels.precision.noise_bits_of` over 2**53, in int64 (wrapping) arithmetic."""
    z = mix64_int64(signed(seed * GOLDEN + step * MIX1 + SALT) + element * signed(MIX2))
    return ((z >> 11) & ((1 << 53) - 1)).double() * (1.0 / 9007199254740992.0)
