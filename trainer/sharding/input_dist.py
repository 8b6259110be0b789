"""Input distribution: every rank's sparse ids to the ranks holding their rows, as an
all-to-all of lengths, then of ids (then of per-id weights)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.dynamic.shards import shard_of_torch
from neorec.trainer.embedding.kernels.routing import route_ids
from neorec.common.offsets import exclusive_cumsum
from neorec.trainer.sharding.collectives import PendingTensor, start_all_to_all
from neorec.trainer.sharding.layout import ShardedLayout


@dataclass
class RoutedSparse:
    """A rank's batch routed to the ranks that hold its rows, not sent yet.

    ``flagged_lengths`` int32: per destination rank, the lengths of its slots' bags then an
    invalid-batch flag; ``send_values`` int64 / ``send_weights`` float32: the ids (local to
    their shards) and weights, destination by destination, ``send_sizes[r]`` of them for
    rank ``r``; ``bad_id``: this rank's message when its batch has an invalid id.
    """

    flagged_lengths: torch.Tensor
    send_values: torch.Tensor
    send_weights: torch.Tensor | None
    send_sizes: list[int]
    bad_id: str | None
    batch_size: int


@dataclass
class LengthsInFlight:
    """The lengths all-to-all of a :class:`RoutedSparse`, started on ``group``."""

    routed: RoutedSparse
    received: PendingTensor
    group: dist.ProcessGroup | None


@dataclass
class ValuesInFlight:
    """The ids all-to-all started; ``lengths`` int32 ``[world, slots, B]`` and ``value_counts``
    int64 ``[world, slots]`` (ids per source rank and slot) already received."""

    lengths: torch.Tensor
    value_counts: torch.Tensor
    values: PendingTensor
    weights: PendingTensor | None


class SparseAllToAll:
    """Turns a rank's batch of ``B`` samples into its local fused module's input: for
    each of its slots, the bags of all ``world * B`` samples of the global batch (rank 0's
    samples first), ids made local to the shard."""

    def __init__(self, layout: ShardedLayout, torch_routing: bool = False) -> None:
        """``torch_routing``: route with torch ops (as on CUDA, where it is always used)
        rather than the Numba kernel."""
        self.layout = layout
        self.torch_routing = torch_routing
        self._source_cache: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}
        # torch routing: route r of unit u starts at key u * stride + its first row
        self._stride = max(t.num_embeddings for t in layout.tables) + 1
        unit_of_route = np.repeat(np.arange(len(layout.unit_feature)), np.diff(layout.unit_routes))
        self._torch_tables = {
            "route_keys": torch.from_numpy(unit_of_route * self._stride + layout.route_rows),
            "route_slot": torch.from_numpy(layout.route_slot),
            "route_rows": torch.from_numpy(layout.route_rows),
            "unit_feature": torch.from_numpy(layout.unit_feature),
            "unit_rows": torch.from_numpy(layout.unit_rows),
            "unit_shards": torch.from_numpy(layout.unit_shards),
            "slot_rank": torch.tensor([slot.rank for slot in layout.slots], dtype=torch.int64),
        }
        self._device_tables: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._dynamic = bool(layout.unit_shards.any())

    def __call__(self, routed: RoutedSparse, group: dist.ProcessGroup | None = None) -> KeyedJaggedTensor:
        """Send a :meth:`prepare` d batch: the all-to-alls run on ``group``. Raises
        ``IndexError`` on every rank when any rank's batch has an id outside its table
        (naming it on that rank), so no rank is left waiting in a collective.

        The same as :meth:`receive` of :meth:`send_values` of :meth:`send_lengths`: those
        stages let a caller keep the collectives of later batches in flight."""
        return self.receive(self.send_values(self.send_lengths(routed, group)))

    def prepare(self, sparse: KeyedJaggedTensor) -> RoutedSparse:
        """Route the batch's ids to their slots and build what the all-to-alls send (no
        collective: any thread may call it)."""
        layout, batch = self.layout, sparse.batch_size
        world = layout.world_size
        num_slots = len(layout.slots)
        device = sparse.values.device
        route = self._route_torch if self.torch_routing or device.type != "cpu" else self.route
        lengths, send_values, send_weights, bad_id = route(sparse)
        slot_rank = self._tables(device)["slot_rank"]
        slot_totals = lengths.view(num_slots, batch).sum(1, dtype=torch.int64)
        per_rank = torch.zeros(world, dtype=torch.int64, device=device).index_add_(0, slot_rank, slot_totals)
        # each rank's lengths for a destination end with one flag: 1 if its batch is invalid
        flagged = torch.full((num_slots * batch + world,), int(bad_id is not None), dtype=torch.int32, device=device)
        length_positions = torch.arange(num_slots * batch, device=device) + torch.repeat_interleave(slot_rank, batch)
        flagged[length_positions] = lengths
        return RoutedSparse(flagged, send_values, send_weights, per_rank.tolist(), bad_id, batch)

    def send_lengths(self, routed: RoutedSparse, group: dist.ProcessGroup | None = None) -> LengthsInFlight:
        """Start the all-to-all of the routed batch's lengths (and invalid-batch flags)."""
        layout, batch = self.layout, routed.batch_size
        mine = int(layout.slots_per_rank[layout.rank])
        received = start_all_to_all(routed.flagged_lengths, (layout.slots_per_rank * batch + 1).tolist(),
                                    [mine * batch + 1] * layout.world_size, group)
        return LengthsInFlight(routed, received, group)

    def send_values(self, lengths: LengthsInFlight) -> ValuesInFlight:
        """Wait for the lengths; raise on every rank if any rank's batch is invalid; start
        the all-to-all of the ids (and weights)."""
        layout, routed = self.layout, lengths.routed
        world, batch = layout.world_size, routed.batch_size
        received = lengths.received.wait().view(world, -1)
        received_lengths = received[:, :-1].reshape(world, int(layout.slots_per_rank[layout.rank]), batch)
        value_counts = received_lengths.sum(2, dtype=torch.int64)
        # one read from the device: every rank's invalid-batch flag and how many ids it sends
        head = torch.cat([received[:, -1].to(torch.int64), value_counts.sum(1)]).tolist()
        _raise_if_flagged(routed.bad_id, head[:world])
        value_sizes = head[world:]
        values = start_all_to_all(routed.send_values, routed.send_sizes, value_sizes, lengths.group)
        weights = None if routed.send_weights is None else start_all_to_all(
            routed.send_weights, routed.send_sizes, value_sizes, lengths.group)
        return ValuesInFlight(received_lengths, value_counts, values, weights)

    def receive(self, in_flight: ValuesInFlight) -> KeyedJaggedTensor:
        """Wait for the ids: the local module's input."""
        world, mine = in_flight.lengths.shape[:2]
        value_counts = in_flight.value_counts
        values = in_flight.values.wait()
        weights = None if in_flight.weights is None else in_flight.weights.wait()
        # received: rank-major, then slot; the local module wants slot-major, then rank
        regroup = _concat_ranges(exclusive_cumsum(value_counts.flatten()).view(world, mine).T.flatten(),
                                  value_counts.T.flatten(), values.numel())
        return KeyedJaggedTensor(
            self.layout.local_feature_names,
            in_flight.lengths.permute(1, 0, 2).flatten().contiguous(),
            values[regroup],
            None if weights is None else weights[regroup],
        )

    def route(self, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str | None]:
        """The batch's ids routed to their slots: int32 lengths ``[num_slots * B]``, local
        ids int64 and weights float32 (slot-major, then bag), and a message naming the
        first id outside its table's rows, if any."""
        layout, batch = self.layout, sparse.batch_size
        unit_source = self.feature_positions(sparse).numpy()[layout.unit_feature]
        offsets = sparse.offsets().numpy()
        capacity = int((offsets[(unit_source + 1) * batch] - offsets[unit_source * batch]).sum())
        lengths = np.empty(len(layout.slots) * batch, dtype=np.int32)
        values = np.empty(capacity, dtype=np.int64)
        weights = np.empty(capacity if sparse.weights is not None else 0, dtype=np.float32)
        id_weights = sparse.weights.numpy() if sparse.weights is not None else weights
        total, bad_unit, bad_id = route_ids(
            sparse.values.numpy(), id_weights, offsets, unit_source, layout.unit_rows, layout.unit_routes,
            layout.unit_shards,
            layout.route_rows, layout.route_slot, len(layout.slots), batch, lengths, values, weights,
        )
        message = self._bad_id_message(bad_unit, bad_id) if bad_unit >= 0 else None
        send_weights = torch.from_numpy(weights[:total]) if sparse.weights is not None else None
        return torch.from_numpy(lengths), torch.from_numpy(values[:total]), send_weights, message

    def _route_torch(self, sparse: KeyedJaggedTensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str | None]:
        """:meth:`route` in torch ops (any device): expand each unit's ids, find each id's
        route by ``searchsorted`` over ``unit * stride + first row`` (a dynamic table's raw
        id: its map shard's first row), stable-sort by slot."""
        layout, batch, device = self.layout, sparse.batch_size, sparse.values.device
        tables = self._tables(device)
        source = self.feature_positions(sparse, device)[tables["unit_feature"]]
        offsets = sparse.offsets().to(device)
        starts = offsets[source * batch]
        counts = offsets[(source + 1) * batch] - starts
        positions = _concat_ranges(starts, counts)
        unit = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts,
                                       output_size=positions.numel())
        ids = sparse.values[positions]
        rows = tables["unit_rows"][unit]
        bad = (ids < 0) | (ids >= rows)
        keys = ids  # the row an id routes by
        if self._dynamic:  # a dynamic table's raw id: its map shard's first row
            shards = tables["unit_shards"][unit]
            dynamic = shards > 0
            bad &= ~dynamic
            shards = shards.clamp(min=1)
            keys = torch.where(dynamic, shard_of_torch(ids, shards) * (rows // shards), ids)
        message = None
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0])
            message = self._bad_id_message(int(unit[first]), int(ids[first]))
            ids = torch.where(bad, 0, ids)
            keys = torch.where(bad, 0, keys)
        route = torch.searchsorted(tables["route_keys"], unit * self._stride + keys, right=True) - 1
        slot = tables["route_slot"][route]
        local_ids = ids - tables["route_rows"][route]
        if self._dynamic:
            local_ids = torch.where(dynamic, ids, local_ids)
        bag_of_value = torch.repeat_interleave(torch.arange(sparse.lengths.numel(), device=device) % batch,
                                               sparse.lengths.to(torch.int64),
                                               output_size=sparse.values.numel())[positions]
        order = torch.argsort(slot, stable=True)
        lengths = torch.bincount(slot * batch + bag_of_value, minlength=len(layout.slots) * batch)
        weights = None if sparse.weights is None else sparse.weights[positions][order]
        return lengths.to(torch.int32), local_ids[order], weights, message

    def _tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The routing index tensors on ``device`` (copied there once)."""
        if device not in self._device_tables:
            self._device_tables[device] = {k: v.to(device) for k, v in self._torch_tables.items()}
        return self._device_tables[device]

    def _bad_id_message(self, unit: int, bad_id: int) -> str:
        layout = self.layout
        feature = layout.feature_names[int(layout.unit_feature[unit])]
        return f"feature {feature!r}: id {bad_id} is outside its table's rows [0, {int(layout.unit_rows[unit])})"

    def feature_positions(self, sparse: KeyedJaggedTensor, device: torch.device | None = None) -> torch.Tensor:
        """int64 ``[F]`` on ``device`` (default: the CPU): index in the batch's keys of each
        feature of the collection (computed, and copied to a device, once per key set)."""
        device = torch.device("cpu") if device is None else device
        source = self._source_cache.get((sparse.keys, device))
        if source is None:
            source = torch.tensor(sparse.positions_of(self.layout.feature_names), dtype=torch.int64).to(device)
            self._source_cache[(sparse.keys, device)] = source
        return source


def _raise_if_flagged(own_error: str | None, flags: list[int]) -> None:
    """Raise on this rank's invalid batch, else if any rank's ``flags`` entry is set."""
    if own_error is not None:
        raise IndexError(own_error)
    if any(flags):
        ranks = [rank for rank, flag in enumerate(flags) if flag]
        raise IndexError(f"rank(s) {ranks} have ids outside their tables' rows in this batch (see their error)")


def _concat_ranges(starts: torch.Tensor, counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """int64 ``[sum(counts)]``: ``starts[0] .. starts[0] + counts[0] - 1``, then range 1's…
    ``total``: ``sum(counts)`` when the caller knows it (else read from the device)."""
    if total is None:
        total = int(counts.sum())
    shift = torch.repeat_interleave(starts - exclusive_cumsum(counts), counts, output_size=total)
    return shift + torch.arange(total, device=starts.device)
