"""What identifies a Parquet file's contents cheaply: its size and the CRC-32 of its footer.

The footer holds every row group's offsets, sizes and statistics, so two files with the
same size and footer are, for a reader, the same file; reading it costs one small read at
the end of the file. A client plans from its own copy of the files and sends their
fingerprints with each request, and a worker whose file at that name differs (rewritten,
another version of the data set) refuses the request by name instead of reading other rows.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PARQUET_MAGIC = b"PAR1"


@dataclass(frozen=True)
class Fingerprint:
    size: int
    footer_crc32: int


def fingerprint(path: str | Path) -> Fingerprint:
    """The file's fingerprint; ``OSError`` if it cannot be read, ``ValueError`` if it does
    not end like a Parquet file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 12:
            raise ValueError(f"{path}: {size} bytes is too short for a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        footer_length = int.from_bytes(tail[:4], "little")
        if tail[4:] != PARQUET_MAGIC or footer_length > size - 12:
            raise ValueError(f"{path}: no Parquet footer at the end of the file")
        f.seek(size - 8 - footer_length)
        footer = f.read(footer_length)
    return Fingerprint(size, zlib.crc32(footer))


def fingerprints(root: str | Path, names: Iterable[str]) -> dict[str, list[int]]:
    """Each of the files ``names`` (relative to ``root``) and its ``[size, footer CRC-32]``
    (JSON-ready, for a checkpoint); ``OSError`` or ``ValueError`` as :func:`fingerprint`."""
    prints = {}
    for name in names:
        found = fingerprint(Path(root) / name)
        prints[name] = [found.size, found.footer_crc32]
    return prints


def first_change(before: dict[str, list[int]], now: dict[str, list[int]]) -> tuple[str, str] | None:
    """The first file (in name order) whose fingerprint differs between ``before`` and
    ``now`` (:func:`fingerprints`), and how: ``added``, ``removed`` or ``rewritten``; None
    when none does."""
    for name in sorted(before.keys() | now.keys()):
        if before.get(name) != now.get(name):
            return name, "added" if name not in before else "removed" if name not in now else "rewritten"
    return None
