"""Input distribution: every rank's sparse ids to the ranks holding their rows, as an
all-to-all of lengths, then of ids (then of per-id weights)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.batch import KeyedJaggedTensor
from trainer.sharding.collectives import all_to_all
from trainer.sharding.layout import ShardedLayout


class SparseAllToAll:
    """Turns a rank's batch of ``B`` samples into its local fused module's input: for
    each of its slots, the bags of all ``world * B`` samples of the global batch (rank 0's
    samples first), ids made local to the shard."""

    def __init__(self, layout: ShardedLayout, group: dist.ProcessGroup | None = None) -> None:
        self.layout = layout
        self.group = group
        self._source_cache: dict[tuple[str, ...], torch.Tensor] = {}

    def __call__(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Raises ``IndexError`` on every rank when any rank's batch has an id outside its
        table (naming it on that rank), so no rank is left waiting in a collective."""
        layout, batch = self.layout, sparse.batch_size
        world, me = layout.world_size, layout.rank
        slot_ids, local_ids, bags, weights, bad_id = self._route(sparse)
        num_slots = len(layout.slots)
        order = torch.argsort(slot_ids, stable=True)
        send_values = local_ids[order]
        send_weights = None if weights is None else weights[order]
        lengths = torch.bincount(slot_ids * batch + bags, minlength=num_slots * batch)
        slot_totals = lengths.view(num_slots, batch).sum(1)
        per_rank = torch.zeros(world, dtype=torch.int64).index_add_(0, layout.slot_rank, slot_totals)

        # each rank's lengths for a destination end with one flag: 1 if its batch is invalid
        mine = int(layout.slots_per_rank[me])
        length_sizes = (layout.slots_per_rank * batch + 1).tolist()
        flagged = torch.full((num_slots * batch + world,), int(bad_id is not None), dtype=torch.int32)
        length_positions = torch.arange(num_slots * batch) + torch.repeat_interleave(layout.slot_rank, batch)
        flagged[length_positions] = lengths.to(torch.int32)
        received = all_to_all(flagged, length_sizes, [mine * batch + 1] * world, self.group).view(world, -1)
        _raise_if_flagged(bad_id, received[:, -1])
        received_lengths = received[:, :-1].reshape(world, mine, batch)
        segments = received_lengths.sum(2, dtype=torch.int64)
        value_sizes = segments.sum(1).tolist()
        send_sizes = per_rank.tolist()
        values = all_to_all(send_values, send_sizes, value_sizes, self.group)
        received_weights = None if send_weights is None else all_to_all(send_weights, send_sizes, value_sizes,
                                                                         self.group)
        # received: rank-major, then slot; the local module wants slot-major, then rank
        regroup = _segment_gather(_exclusive_cumsum(segments.flatten()).view(world, mine).T.flatten(),
                                  segments.T.flatten())
        return KeyedJaggedTensor(
            layout.local_feature_names,
            received_lengths.permute(1, 0, 2).flatten().contiguous(),
            values[regroup],
            None if received_weights is None else received_weights[regroup],
        )

    def _route(self, sparse: KeyedJaggedTensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, str | None]:
        """Every (id, destination unit) pair of the batch: its slot, the id local to that
        slot's shard, its bag (sample) index and its weight, all ``[N_routed]``; and a
        message naming the first id outside its table's rows, if any."""
        layout, batch = self.layout, sparse.batch_size
        source = self.feature_positions(sparse)[layout.unit_feature]
        offsets = sparse.offsets()
        starts = offsets[source * batch]
        counts = offsets[(source + 1) * batch] - starts
        positions = _segment_gather(starts, counts)
        unit = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        ids = sparse.values[positions]
        rows = layout.unit_rows[unit]
        bad = (ids < 0) | (ids >= rows)
        message = None
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0])
            message = (f"feature {layout.feature_names[int(layout.unit_feature[unit[first]])]!r}: id "
                       f"{int(ids[first])} is outside its table's rows [0, {int(rows[first])})")
            ids = torch.where(bad, 0, ids)  # reported on every rank before anything is looked up
        route = torch.searchsorted(layout.route_keys, unit * layout.key_stride + ids, right=True) - 1
        bag_of_value = torch.repeat_interleave(torch.arange(sparse.lengths.numel()) % batch,
                                               sparse.lengths.to(torch.int64))
        weights = None if sparse.weights is None else sparse.weights[positions]
        return layout.route_slot[route], ids - layout.route_row[route], bag_of_value[positions], weights, message

    def feature_positions(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """int64 ``[F]``: index in the batch's keys of each feature of the collection."""
        source = self._source_cache.get(sparse.keys)
        if source is None:
            source = torch.tensor(sparse.positions_of(self.layout.feature_names), dtype=torch.int64)
            self._source_cache[sparse.keys] = source
        return source


def _raise_if_flagged(own_error: str | None, flags: torch.Tensor) -> None:
    if own_error is not None:
        raise IndexError(own_error)
    if bool(flags.any()):
        ranks = torch.nonzero(flags).flatten().tolist()
        raise IndexError(f"rank(s) {ranks} have ids outside their tables' rows in this batch (see their error)")


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _segment_gather(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[sum(counts)]``: ``starts[0] .. starts[0] + counts[0] - 1``, then segment 1's…"""
    total = int(counts.sum())
    shift = torch.repeat_interleave(starts - _exclusive_cumsum(counts), counts, output_size=total)
    return shift + torch.arange(total)
