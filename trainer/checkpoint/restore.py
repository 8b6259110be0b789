"""Restoring a checkpoint into a model of any world size and plan.

Every rank restores only its own pieces of the tables (:class:`~neorec.trainer.embedding.fused.
ShardView`), from whichever records of the checkpoint's chain overlap them: the full
checkpoint's, then each increment's, so a row ends with its newest value. No process ever
reads the whole model, only the records that overlap its shards, one at a time.

Weights and element-wise optimizer state (Adagrad, Adam) move exactly into any rows and
columns. Row-wise Adagrad keeps one value per row of a shard; a destination shard whose
columns come from several source shards (column-wise to table-wise) gets their mean
weighted by the columns each contributes, and a destination within one source shard gets
its value exactly.

Before anything is applied, every rank checks the records it will read (CRC-32, and each
file's size) and rank 0's ``dense.pt`` (SHA-256); a corrupt or truncated file is a
:class:`~neorec.trainer.checkpoint.layout.CheckpointError` naming it. With ``fallback`` the ranks
agree to restore the newest checkpoint that all of them found whole instead.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from neorec.trainer.checkpoint import records
from neorec.trainer.checkpoint.layout import (DENSE_FILE, CheckpointError, Manifest, RecordEntry, check_sizes,
                                       check_checksum, check_store_segments, complete,
                                       keeps_dense_incrementally, read_manifest, read_record)
from neorec.trainer.embedding.fused import ShardView

AgreeFn = Callable[[bool], bool]
"""True when every rank passes True (a collective in a distributed run)."""


@dataclass
class Restorable:
    """A complete checkpoint and the chain of checkpoints that restores it."""

    root: Path
    manifest: Manifest
    chain: list[Manifest]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Newer checkpoints :func:`choose` passed over, each with the reason (``checkpoint.fallback``)."""

    @property
    def directory(self) -> Path:
        return self.root / self.manifest.name


def open_checkpoint(root: Path, name: str | None = None) -> Restorable:
    """The checkpoint ``name`` (default: the newest complete one) under ``root``."""
    if name is None:
        done = complete(root)
        if not done:
            raise CheckpointError(f"{root} holds no complete checkpoint")
        name = done[-1].name
    manifest = read_manifest(root / name)
    chain = [manifest if link == manifest.name else read_manifest(root / link) for link in manifest.chain]
    return Restorable(root, manifest, chain)


def choose(root: Path, views: list[ShardView], agree: AgreeFn, fallback: bool, need_dense: bool) -> Restorable:
    """The checkpoint to restore: the newest complete one, whole for every rank; with
    ``fallback``, older ones are tried when it is not (every rank calls this alike)."""
    candidates = [p.name for p in reversed(complete(root))]
    if not candidates:
        raise CheckpointError(f"{root} holds no complete checkpoint")
    first_error: CheckpointError | None = None
    skipped: list[tuple[str, str]] = []
    for name in candidates:
        error: CheckpointError | None = None
        try:
            restorable = open_checkpoint(root, name)
            check(restorable, views, need_dense)
        except CheckpointError as err:
            error = err
            first_error = first_error or err
        if agree(error is None):
            restorable.skipped = skipped
            return restorable
        skipped.append((name, str(error) if error else "another rank found a file of it corrupt (see its error)"))
        if not fallback:
            raise first_error or CheckpointError(f"checkpoint {root / name}: another rank found a file of it corrupt "
                                                 f"(see its error)")
    raise CheckpointError(f"no checkpoint under {root} is whole; the newest failed with: {first_error}")


def check(restorable: Restorable, views: list[ShardView], need_dense: bool) -> None:
    """Check every record these ``views`` would read, and when ``need_dense`` every
    ``dense.pt`` a restore reads: the checkpoint's, and with dynamic tables those of its
    chain too (:func:`load_dense_chain`)."""
    for manifest in restorable.chain:
        directory = restorable.root / manifest.name
        check_sizes(directory, manifest)
        for entry in _overlapping(manifest, views):
            read_record(directory, entry)
    for piece in restorable.manifest.store:  # before any is linked into a tier, whose own segments it replaces
        check_store_segments(restorable.directory, piece)
    if need_dense:
        for manifest in restorable.chain if keeps_dense_incrementally(restorable.manifest) else [restorable.manifest]:
            entry = next((f for f in manifest.files if f.name == DENSE_FILE), None)
            if entry is None:
                raise CheckpointError(f"checkpoint {restorable.root / manifest.name}: its manifest lists no "
                                      f"{DENSE_FILE}")
            check_checksum(restorable.root / manifest.name, entry)


def restore_embeddings(restorable: Restorable, views: list[ShardView]) -> None:
    """Write the checkpoint's rows into ``views`` (this rank's pieces), chain in order."""
    by_table = _check_tables(restorable.manifest, views)
    for manifest in restorable.chain:
        directory = restorable.root / manifest.name
        rowwise: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per view: accumulated state, rows covered
        for entry in manifest.records:
            for index in by_table.get(entry.table, []):
                view = views[index]
                if _overlaps(entry, view):
                    rows = view.weight.shape[0]
                    accumulator = rowwise.setdefault(index, (np.zeros(rows, np.float32), np.zeros(rows, bool))) \
                        if _rowwise(view) else None
                    _apply(records.decode(read_record(directory, entry)), view, accumulator)
        for index, (accumulated, covered) in rowwise.items():
            rows = torch.from_numpy(np.flatnonzero(covered))
            views[index].states[0][:, 0].index_copy_(
                0, rows.to(views[index].weight.device), torch.from_numpy(accumulated[covered]).to(
                    views[index].weight.device))


def load_dense(restorable: Restorable, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Rank 0's dense state (MLPs, dense optimizer, RNG, position), its tensors on ``device``
    (the run's: a checkpoint written on one device restores onto another): tensors, numbers,
    strings and their dicts and lists only. The file is read without unpickling anything
    else, so a crafted file is refused, never run (:class:`CheckpointError` naming it); its
    checksum is :func:`check`'s."""
    path = restorable.directory / DENSE_FILE
    try:
        dense = torch.load(io.BytesIO(path.read_bytes()), weights_only=True, map_location=device)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} holds more than tensors and plain values, refused: {first_line}") from None
    if not isinstance(dense, dict):
        raise CheckpointError(f"{path} is not a dense state (a dict): corrupt")
    return dense


def load_dense_chain(restorable: Restorable, newest: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rank 0's dense state of every checkpoint of the chain, oldest (the full one) first:
    the state kept incrementally is spread over them. ``newest``: the checkpoint's own, when
    the caller has read it already (:func:`load_dense`)."""
    older = [load_dense(Restorable(restorable.root, manifest, [])) for manifest in restorable.chain[:-1]]
    return [*older, newest if newest is not None else load_dense(restorable)]


def _check_tables(manifest: Manifest, views: list[ShardView]) -> dict[str, list[int]]:
    by_table: dict[str, list[int]] = {}
    for index, view in enumerate(views):
        info = manifest.tables.get(view.table)
        if info is None:
            raise CheckpointError(f"checkpoint {manifest.name} has no table {view.table!r} "
                                  f"(it has {', '.join(sorted(manifest.tables))})")
        rows, cols = view.weight.shape
        if view.row_offset + rows > info["rows"] or view.col_offset + cols > info["dim"]:
            raise CheckpointError(f"table {view.table!r} is {info['rows']} x {info['dim']} in checkpoint "
                                  f"{manifest.name}, the model's is larger")
        if len(view.states) != info["states"]:
            raise CheckpointError(f"table {view.table!r}: the checkpoint's optimizer ({info['optimizer']}) keeps "
                                  f"{info['states']} state arrays, the model's {len(view.states)}")
        by_table.setdefault(view.table, []).append(index)
    return by_table


def _overlapping(manifest: Manifest, views: list[ShardView]) -> list[RecordEntry]:
    return [e for e in manifest.records if any(v.table == e.table and _overlaps(e, v) for v in views)]


def _overlaps(entry: RecordEntry, view: ShardView) -> bool:
    rows, cols = view.weight.shape
    return (entry.row_offset < view.row_offset + rows and view.row_offset < entry.row_offset + entry.rows
            and entry.col_offset < view.col_offset + cols and view.col_offset < entry.col_offset + entry.cols)


def _rowwise(view: ShardView) -> bool:
    """Whether ``view`` keeps one optimizer state value per row (row-wise Adagrad)."""
    return any(state.shape[1] != view.weight.shape[1] for state in view.states)


def _apply(source: records.ShardRows, view: ShardView, rowwise: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Copy the part of ``source`` that falls in ``view``; a row-wise state's contribution
    is added to ``rowwise`` (accumulated values, rows covered) instead."""
    rows, cols = view.weight.shape
    local = np.arange(source.count, dtype=np.int64) if source.ids is None else source.ids
    global_rows = source.row_offset + local
    keep = (global_rows >= view.row_offset) & (global_rows < view.row_offset + rows)
    targets = torch.from_numpy(global_rows[keep] - view.row_offset).to(view.weight.device)
    lo, hi = max(view.col_offset, source.col_offset), min(view.col_offset + cols, source.col_offset + source.cols)
    src_cols = slice(lo - source.col_offset, hi - source.col_offset)
    dst_cols = slice(lo - view.col_offset, hi - view.col_offset)
    weights = source.weights[keep][:, src_cols]
    if source.storage == view.storage and weights.dtype != np.float32:  # fp16/bf16 bits: exact
        values = torch.from_numpy(np.ascontiguousarray(weights).view(np.int16)).view(view.weight.dtype)
    else:
        values = torch.from_numpy(np.ascontiguousarray(records.as_float32(weights, source.storage)))
    _copy_columns(view.weight, targets, dst_cols, values)
    for state, target in zip(source.states, view.states):
        if target.shape[1] == cols:  # element-wise: the same columns
            _copy_columns(target, targets, dst_cols, torch.from_numpy(np.ascontiguousarray(state[keep][:, src_cols])))
        else:  # row-wise: weighted by the columns this source contributes
            assert rowwise is not None
            accumulated, covered = rowwise
            rows_here = targets.cpu().numpy()
            accumulated[rows_here] += state[keep][:, 0] * np.float32((hi - lo) / cols)
            covered[rows_here] = True


def _copy_columns(target: torch.Tensor, rows: torch.Tensor, columns: slice, values: torch.Tensor) -> None:
    """``target[rows, columns] = values``."""
    if columns == slice(0, target.shape[1]):
        target.index_copy_(0, rows, values.to(target.device, target.dtype))
    else:
        target[rows, columns] = values.to(target.device, target.dtype)
