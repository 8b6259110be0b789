"""Checkpointing the tables on the embedding store.

A store table's rows live in its tier's segment files, which are never changed once
written. Its checkpoint is the tier's segments at that moment, hard-linked into the
checkpoint directory (``store/<table@row_offset>/``) after every changed row was written
back: it costs no bytes and no copy however large the table, and every checkpoint holds
the whole table (no chain to apply). Restoring links them back into the tier when the
piece is the same; a piece of another plan (another world size) is rebuilt from the rows
of the checkpoint's pieces that overlap it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from neorec.embedding_store.segments import SegmentError, segment_checksum
from neorec.trainer.checkpoint.layout import CheckpointError, FileEntry, Manifest, StoreEntry, read_store_segments
from neorec.trainer.embedding.store_backed import StorePiece

STORE_DIRECTORY = "store"


def snapshot_store(pieces: list[StorePiece], directory: Path) -> list[StoreEntry]:
    """Link each piece's tier into ``directory`` (the pieces' rows written back first)."""
    entries = []
    for piece in pieces:
        relative = f"{STORE_DIRECTORY}/{piece.key}"
        files = piece.tier.snapshot(directory / relative)  # (a store service links them there too)
        entries.append(StoreEntry(piece.table, piece.key, piece.row_offset, piece.rows, piece.row_bytes, relative,
                                  [FileEntry(name, size) for name, size in files],
                                  [segment_checksum(directory / relative / name) for name, _ in files]))
    return entries


def check_store(manifest: Manifest, pieces: list[StorePiece], memory_tables: set[str]) -> None:
    """Raise :class:`CheckpointError` when the checkpoint's store tables are not the model's
    (a table on the store in one and in memory in the other), or a piece's row size differs."""
    checkpointed = {e.table for e in manifest.store}
    for piece in pieces:
        if piece.table not in checkpointed:
            raise CheckpointError(f"table {piece.table!r} is on the embedding store, but checkpoint {manifest.name} "
                                  f"holds it in memory; resume with the same [embedding_store] tables")
        widths = {e.row_bytes for e in manifest.store if e.table == piece.table}
        if widths != {piece.row_bytes}:
            raise CheckpointError(f"table {piece.table!r}: rows of {piece.row_bytes} bytes on the store, checkpoint "
                                  f"{manifest.name} has {sorted(widths)} (another weight type or optimizer)")
    moved = sorted(checkpointed & memory_tables)
    if moved:
        raise CheckpointError(f"tables {', '.join(moved)} are in memory, but checkpoint {manifest.name} holds them on "
                              f"the embedding store; resume with the same [embedding_store] tables")


def restore_store(directory: Path, manifest: Manifest, pieces: list[StorePiece]) -> None:
    """Make each piece's tier hold the checkpoint's rows of it."""
    for piece in pieces:
        same = [e for e in manifest.store if e.key == piece.key and e.rows == piece.rows]
        if same:
            try:
                piece.tier.load(directory / same[0].directory, [f.name for f in same[0].files],
                                checked=True)  # by restore.check, before any tier loads
            except SegmentError as err:
                raise CheckpointError(str(err)) from None
            continue
        piece.tier.load(directory, [])
        for entry in manifest.store:
            if entry.table != piece.table or not _overlaps(entry, piece):
                continue
            rows, data = read_store_segments(directory, entry)
            rows = rows + entry.row_offset - piece.row_offset
            mine = (rows >= 0) & (rows < piece.rows)
            piece.tier.write(rows[mine], np.ascontiguousarray(data[mine]))
        piece.tier.flush(sync=True)


def _overlaps(entry: StoreEntry, piece: StorePiece) -> bool:
    return entry.row_offset < piece.row_offset + piece.rows and piece.row_offset < entry.row_offset + entry.rows
