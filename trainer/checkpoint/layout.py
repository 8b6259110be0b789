"""On-disk layout of a run's checkpoints, and the commit that makes one complete.

``CHECKPOINTS/step-000000120/`` holds one checkpoint: each rank's embedding file
(``rank-00001.emb``, :mod:`neorec.trainer.checkpoint.records`), rank 0's ``dense.pt`` (MLPs, dense
optimizer, RNG, position), each rank's ``rank-00001.json`` (its files with sizes and
SHA-256, the records they hold, written once those files are durable), and
``manifest.json``, written by rank 0 once every rank's record is there: to a temporary name,
fsynced, renamed into place, and the directory fsynced. A checkpoint directory without a
manifest is incomplete and never restored. ``CHECKPOINTS/LATEST`` names the newest complete
checkpoint, replaced the same way.

An incremental checkpoint holds only the rows modified since the checkpoint before it; its
manifest lists its ``chain``, from the full checkpoint it builds on to itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neorec.common.durable import write_durably
from neorec.common.errors import UserError
from neorec.embedding_store.segments import SegmentError, check_segments, read_segments, segment_checksum

FORMAT = "neorec-checkpoint/2"
MANIFEST = "manifest.json"
LATEST = "LATEST"
BEST = "BEST"
"""Names the checkpoint of the best eval AUC (``checkpoint.keep_best``)."""
DENSE_FILE = "dense.pt"
PREFIX = "step-"


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be restored: missing, incomplete, corrupt (the message names the
    file), or made for another model."""


CHAIN_LINK = re.compile(rf"{PREFIX}[0-9]{{9,}}")
"""A checkpoint's name, as a chain holds it (a sibling directory, nothing else)."""


def step_name(step: int) -> str:
    return f"{PREFIX}{step:09d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.emb"


def rank_record(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclass
class FileEntry:
    """A file of a checkpoint, its size and its SHA-256 (empty for a file of records: each
    record carries its own CRC-32)."""

    name: str
    bytes: int
    sha256: str = ""


@dataclass
class RecordEntry:
    """Where one shard's rows lie: ``file`` bytes ``[offset, offset + length)`` with CRC-32
    ``crc32``; the shard's place in its table; ``count`` rows held."""

    file: str
    offset: int
    length: int
    table: str
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    count: int
    crc32: int


@dataclass
class StoreEntry:
    """A piece of a table on the embedding store (``key``: ``table@row_offset``): rows
    ``[row_offset, row_offset + rows)`` of ``row_bytes`` bytes (weights as stored, then
    optimizer state) in the segment ``files`` of ``directory`` (relative to the checkpoint),
    linked from the tier when the checkpoint was taken; ``checksums``: the CRC-32 each
    segment's header gives, in the order of ``files``, so that one segment in another's
    place is found (empty in checkpoints written before they were kept)."""

    table: str
    key: str
    row_offset: int
    rows: int
    row_bytes: int
    directory: str
    files: list[FileEntry]
    checksums: list[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "StoreEntry":
        return cls(**{**obj, "files": [FileEntry(**f) for f in obj["files"]]})


@dataclass
class RankRecord:
    """What one rank wrote for a checkpoint."""

    rank: int
    files: list[FileEntry]
    records: list[RecordEntry]
    sparse_steps: int
    touched: dict[str, int]
    """Per table, the rows this rank modified since the last checkpoint."""
    attempt: str
    """The training attempt that wrote it: a record left by a crashed attempt at the same
    step is not this checkpoint's."""
    store: list[StoreEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "RankRecord":
        return cls(obj["rank"], [FileEntry(**f) for f in obj["files"]], [RecordEntry(**r) for r in obj["records"]],
                   obj["sparse_steps"], obj["touched"], obj["attempt"],
                   [StoreEntry.from_json(e) for e in obj.get("store", [])])


@dataclass
class Manifest:
    """A complete checkpoint: where training stood, what it holds, and its files."""

    name: str
    step: int
    epoch: int
    step_in_epoch: int
    kind: str
    """``full`` or ``incremental``."""
    chain: list[str]
    """Checkpoints to apply in order to restore this one: a full one, then increments."""
    bits: int
    world_size: int
    config: dict[str, Any]
    plan: dict[str, Any] | None
    tables: dict[str, dict[str, Any]]
    """Per table: ``rows``, ``dim``, ``storage`` (weight dtype) and ``optimizer``."""
    files: list[FileEntry]
    records: list[RecordEntry]
    sparse_steps: int
    stats: dict[str, Any] = field(default_factory=dict)
    """``bytes`` written, ``touched`` rows per table, ``snapshot_s`` (the training stall)
    and ``write_s``."""
    store: list[StoreEntry] = field(default_factory=list)
    """The pieces of the tables on the embedding store (their rows are not in ``records``)."""
    best: bool = False
    """Committed as the best model so far (``checkpoint.keep_best``): ``BEST`` is written
    after the commit, and a crash between the two must not lose which one is best."""
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Manifest":
        """The manifest ``obj`` describes; ValueError (TypeError, KeyError) where its position
        or chain is not one a checkpoint writes."""
        fields = dict(obj)
        fields["files"] = [FileEntry(**f) for f in obj["files"]]
        fields["records"] = [RecordEntry(**r) for r in obj["records"]]
        fields["store"] = [StoreEntry.from_json(e) for e in obj.get("store", [])]
        manifest = cls(**fields)
        manifest._check()
        return manifest

    def _check(self) -> None:
        for key in ("step", "epoch", "step_in_epoch", "bits", "world_size", "sparse_steps"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} is {value!r}, not a whole number")
        if self.name != step_name(self.step):
            raise ValueError(f"name {self.name!r} is not that of step {self.step}")
        if self.kind not in ("full", "incremental"):
            raise ValueError(f"kind {self.kind!r} is neither 'full' nor 'incremental'")
        chain = self.chain
        if not isinstance(chain, list) or not chain or not all(isinstance(c, str) and CHAIN_LINK.fullmatch(c)
                                                               for c in chain):
            raise ValueError(f"chain {chain!r} is not a list of checkpoint names")
        steps = [int(c[len(PREFIX):]) for c in chain]
        if chain[-1] != self.name or steps != sorted(set(steps)) or (self.kind == "full") != (len(chain) == 1):
            raise ValueError(f"chain {chain!r} does not lead from a full checkpoint to this {self.kind} one")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit(directory: Path, manifest: Manifest) -> None:
    """Make ``directory`` a complete checkpoint, then point ``LATEST`` at it."""
    write_durably(directory / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode())
    write_durably(directory.parent / LATEST, (directory.name + "\n").encode())


def best_checkpoint(root: Path) -> str | None:
    """The run's best checkpoint (None when it keeps none): the name ``BEST`` gives, or a
    newer complete checkpoint committed as the best (a crash came before its ``BEST``)."""
    path = root / BEST
    named = path.read_text(errors="replace").strip() if path.is_file() else None
    for directory in reversed(complete(root)):
        if named is not None and directory.name <= named:
            break
        try:
            if read_manifest(directory).best:
                return directory.name
        except CheckpointError:  # left for the user to look at, as prune leaves it
            continue
    return named


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is corrupt: {err}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    try:
        manifest = Manifest.from_json(obj)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt: {err}") from None
    if manifest.name != directory.name:
        raise CheckpointError(f"{path} is that of {manifest.name}, not of the directory {directory.name}")
    return manifest


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MANIFEST).is_file())


def checkpoints_root(path: str | Path) -> tuple[Path, Path | None]:
    """``(root, checkpoint)`` for a run directory, a checkpoints directory or one
    checkpoint's directory (``checkpoint`` is None unless one was named);
    :class:`CheckpointError` when ``path`` is not a directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (a run directory, its checkpoint directory or a checkpoint)")
    if (path / MANIFEST).is_file() or path.name.startswith(PREFIX):
        return path.parent, path
    if (path / "checkpoint").is_dir():
        return path / "checkpoint", None
    return path, None


def check_sizes(directory: Path, manifest: Manifest) -> None:
    """Raise :class:`CheckpointError` naming the first file missing or not of the manifest's size."""
    files = [(directory / e.name, e) for e in manifest.files]
    files += [(directory / s.directory / e.name, e) for s in manifest.store for e in s.files]
    for path, entry in files:
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if path.stat().st_size != entry.bytes:
            raise CheckpointError(f"{path} is {path.stat().st_size} bytes, the manifest says {entry.bytes}: truncated "
                                  f"or corrupt")


def read_record(directory: Path, entry: RecordEntry) -> bytes:
    """A record's bytes, checked against its CRC-32 (:class:`CheckpointError` naming the file
    when they do not match)."""
    path = directory / entry.file
    with open(path, "rb") as f:
        f.seek(entry.offset)
        data = f.read(entry.length)
    if len(data) != entry.length or zlib.crc32(data) != entry.crc32:
        raise CheckpointError(f"{path}: the rows of table {entry.table!r} at byte {entry.offset} are corrupt "
                              f"(checksum mismatch)")
    return data


def check_checksum(directory: Path, entry: FileEntry) -> None:
    """A :class:`CheckpointError` naming the file ``entry`` describes when its SHA-256 is not
    the one recorded (a file of records, recorded without one, is not read)."""
    if entry.sha256 and sha256_of(directory / entry.name) != entry.sha256:
        raise CheckpointError(f"{directory / entry.name} does not match its checksum: corrupt")


def verify(directory: Path, manifest: Manifest, dense: bool = True, segments: bool = True) -> None:
    """Raise :class:`CheckpointError` naming the first file of the checkpoint that is not
    whole: its size, its SHA-256 or the CRC-32 of a record it holds. Without ``dense`` its
    ``dense.pt``'s contents are not checked, without ``segments`` its store segments'
    contents: an older link of a chain is checked so, as a restore reads it (only the
    restored checkpoint's segments are linked into the tiers; only with dynamic tables,
    :func:`keeps_dense_incrementally`, is every ``dense.pt`` of the chain read)."""
    check_sizes(directory, manifest)
    for entry in manifest.files:
        if dense or entry.name != DENSE_FILE:
            check_checksum(directory, entry)
    for record in manifest.records:
        read_record(directory, record)
    for piece in manifest.store if segments else []:
        check_store_segments(directory, piece)


def keeps_dense_incrementally(manifest: Manifest) -> bool:
    """Whether a checkpoint's dense state is spread over its chain, so a restore reads every
    ``dense.pt`` of it: its run's dynamic tables keep their id maps so."""
    return bool((manifest.config.get("model") or {}).get("dynamic"))


def check_store_segments(directory: Path, piece: StoreEntry) -> None:
    """:class:`CheckpointError` naming the first segment of a store piece that is not whole,
    or not the segment the checkpoint was taken with."""
    paths = [directory / piece.directory / f.name for f in piece.files]
    try:
        check_segments(paths, piece.row_bytes)
        for path, expected in zip(paths, piece.checksums):
            if segment_checksum(path) != expected:
                raise CheckpointError(f"{path} is whole but not the segment this checkpoint was taken with (its "
                                      f"checksum is another's): another segment was put in its place")
    except SegmentError as err:
        raise CheckpointError(str(err)) from None


def read_store_segments(directory: Path, piece: StoreEntry) -> tuple[np.ndarray, np.ndarray]:
    """The newest copy of every row a store piece holds (int64 rows, uint8 ``[n,
    row_bytes]``); :class:`CheckpointError` naming a corrupt segment."""
    try:
        return read_segments([directory / piece.directory / f.name for f in piece.files], piece.row_bytes)
    except SegmentError as err:
        raise CheckpointError(str(err)) from None


def remove(directory: Path) -> None:
    """Delete a checkpoint: its manifest first, so that a crash midway leaves an incomplete
    checkpoint, never a complete-looking one with files missing."""
    (directory / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def prune(root: Path, keep: int, protect: set[str] = frozenset()) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints, the checkpoints their chains need and
    ``protect``; delete the other complete ones and incomplete ones older than the newest
    complete (left by a crash). Returns the names deleted."""
    done = complete(root)
    if not done:
        return []
    kept = set(protect)
    for path in done[-keep:]:
        try:
            kept.update(read_manifest(path).chain)
        except CheckpointError:  # one a resume skipped (checkpoint.fallback): left for the user to look at
            kept.add(path.name)
    newest = done[-1].name
    deleted = []
    for path in sorted(root.iterdir()):
        if not path.name.startswith(PREFIX) or path.name in kept or path.name >= newest:
            continue
        remove(path)
        deleted.append(path.name)
    return deleted
