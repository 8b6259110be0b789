"""The part of a checkpoint that stalls training: copying what is to be written.

A full snapshot copies every row a rank holds; an incremental one only the rows modified
since the last snapshot (each shard's ``touched`` flags, which the fused update kernels set
and the snapshot clears). Replicated (data-parallel) shards are written by rank 0 only.
The copies are numpy arrays the background writer owns: training may change the module
right after the snapshot without changing what is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from neorec.trainer.checkpoint.records import ShardRows
from neorec.trainer.embedding.fused import ShardView

RECORD_ROWS = 262_144
"""Most rows per record: a restoring rank decodes one record at a time, so its memory
stays bounded however large a table is."""


@dataclass
class ShardSnapshot:
    """A shard's rows to write and how many of its rows were modified since the last
    snapshot."""

    rows: ShardRows
    touched: int


def take_snapshot(views: list[ShardView], full: bool, rank: int) -> list[ShardSnapshot]:
    """Copy ``views``' rows (all of them when ``full``, else the touched ones) and clear
    their touched flags."""
    snapshots = []
    for view in views:
        index = view.touched.indices()
        touched = int(index.numel())
        if view.replicated and rank != 0:
            view.touched.clear()
            continue
        rows, cols = view.weight.shape
        if full:
            ids = None
            weight, states = view.weight.clone(), [s.clone() for s in view.states]
        else:
            ids = index.cpu().numpy()
            weight, states = view.weight.index_select(0, index), [s.index_select(0, index) for s in view.states]
        view.touched.clear()
        snapshots.append(ShardSnapshot(
            ShardRows(view.table, view.row_offset, rows, view.col_offset, cols, view.storage, ids,
                      _storage_array(weight), [s.cpu().numpy() for s in states]),
            touched))
    return snapshots


def _storage_array(weight: torch.Tensor) -> np.ndarray:
    """The weights as numpy: float32, or the uint16 bits of fp16/bf16."""
    weight = weight.cpu()
    if weight.dtype == torch.float32:
        return weight.numpy()
    return weight.view(torch.int16).numpy().view(np.uint16)


def split(shard: ShardRows, max_rows: int = RECORD_ROWS) -> list[ShardRows]:
    """``shard`` as records of at most ``max_rows`` rows: a full shard cut into row ranges
    (each its own shard geometry), an incremental one into runs of its ids."""
    if shard.count <= max_rows:
        return [shard]
    pieces = []
    for lo in range(0, shard.count, max_rows):
        hi = min(lo + max_rows, shard.count)
        if shard.ids is None:
            pieces.append(ShardRows(shard.table, shard.row_offset + lo, hi - lo, shard.col_offset, shard.cols,
                                    shard.storage, None, shard.weights[lo:hi], [s[lo:hi] for s in shard.states]))
        else:
            pieces.append(ShardRows(shard.table, shard.row_offset, shard.rows, shard.col_offset, shard.cols,
                                    shard.storage, shard.ids[lo:hi], shard.weights[lo:hi],
                                    [s[lo:hi] for s in shard.states]))
    return pieces
