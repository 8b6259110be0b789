"""Output distribution: the pooled blocks a rank computed for the global batch go back to
the ranks whose samples they are (one all-to-all), and are assembled into the
collection's output layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from neorec.trainer.sharding.collectives import RankSlice
from neorec.trainer.sharding.comm_precision import FULL, AllToAllIn, CommPrecision, Passenger
from neorec.trainer.sharding.layout import ShardedLayout


class PooledAllToAll:
    """``[world * B, C_local]`` pooled blocks of a rank's local module (its sharded slots'
    columns first, then its replicated ones) → the rank's ``[B, output_dim]`` output.

    Row-split tables' partial sums are added in shard order after the all-to-all (a
    reduce-scatter carried by the same collective, in a fixed order); their mean pooling
    divides the sum by the bag's length afterwards. Replicated tables keep this rank's rows
    of their output (:class:`RankSlice`). Backward runs every step in reverse. The
    all-to-all and its gradient travel in ``precision``.
    """

    def __init__(self, layout: ShardedLayout, group: dist.ProcessGroup | None = None,
                 precision: CommPrecision = FULL) -> None:
        self.layout = layout
        self.group = group
        self.precision = precision
        self.passenger: Passenger | None = None
        """Rides with the gradient's all-to-all (see :class:`~neorec.trainer.sharding.comm_precision.Passenger`)."""
        self._columns: dict[torch.device, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _columns_on(self, device: torch.device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The layout's output column indices (``primary``, ``extra``) on ``device``, copied
        there once (a copy per step would make each step wait for the device)."""
        if device not in self._columns:
            layout = self.layout
            self._columns[device] = (layout.primary.to(device),
                                     [(o.to(device), c.to(device)) for o, c in layout.extra])
        return self._columns[device]

    def __call__(self, pooled: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``lengths`` int ``[F, B]``: the rank's bag lengths, features in collection order
        (for mean pooling of row-split tables)."""
        layout = self.layout
        world, me = layout.world_size, layout.rank
        sent_cols = int(layout.sharded_cols[me])
        received_cols = layout.sharded_cols.tolist()
        sharded = pooled[:, :sent_cols].contiguous().view(-1)
        received = AllToAllIn.apply(sharded, [batch_size * sent_cols] * world,
                                    [batch_size * c for c in received_cols], self.group, self.precision,
                                    self.passenger)
        blocks = [piece.view(batch_size, c) for piece, c in
                  zip(torch.split(received, [batch_size * c for c in received_cols]), received_cols)]
        if pooled.shape[1] > sent_cols:
            blocks.append(RankSlice.apply(pooled[:, sent_cols:], self.group))
        columns = torch.cat(blocks, dim=1)
        primary, extra = self._columns_on(columns.device)
        out = columns.index_select(1, primary)
        for out_cols, src_cols in extra:
            out = out.index_add(1, out_cols, columns.index_select(1, src_cols))
        if layout.mean_row_split:
            out = self._divide_by_lengths(out, lengths)
        return out

    def _divide_by_lengths(self, out: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        divisor = torch.ones_like(out)
        for start, dim, feature in self.layout.mean_row_split:
            counts = lengths[feature].to(out.dtype).clamp_(min=1)
            divisor[:, start : start + dim] = counts.unsqueeze(1)
        return out / divisor
