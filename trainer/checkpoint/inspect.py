"""``neorec checkpoint inspect``: a run's checkpoints, their chains, sizes, bits and the
share of rows each wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neorec.trainer.checkpoint import layout
from neorec.trainer.checkpoint.layout import LATEST, CheckpointError, checkpoints_root, complete, read_manifest
from neorec.trainer.run.run_dir import CHECKPOINTS, CONFIG


def describe(directory: str | Path, verify: bool = False) -> dict[str, Any]:
    """The checkpoints under a run directory (or its checkpoints directory), oldest first:
    name, step, epoch, kind, chain, bits, bytes, rows touched of all rows, stall and write
    seconds; with ``verify``, whether it can be restored: every file of it and of the
    checkpoints of its chain matches its size and SHA-256 (``error`` says which does not).
    :class:`CheckpointError` when the directory holds no checkpoint, complete or not, and is
    not a run's (an empty listing for a run that has written none yet)."""
    root, _ = checkpoints_root(directory)
    latest = (root / LATEST).read_text(errors="replace").strip() if (root / LATEST).is_file() else None
    checkpoints = []
    found: dict[tuple[str, bool, bool], str | None] = {}
    unreadable: dict[str, str] = {}
    for path in complete(root):
        try:
            manifest = read_manifest(path)
            entry = _entry(manifest)
        except (CheckpointError, AttributeError, KeyError, TypeError, ValueError) as err:  # a damaged manifest
            unreadable[path.name] = f"{path / layout.MANIFEST}: cannot be read ({' '.join(str(err).split())})"
            checkpoints.append({"name": path.name, "verified": False, "error": unreadable[path.name]})
            continue
        if verify:
            error = _chain_error(root, manifest, found, unreadable)
            entry["verified"] = error is None
            if error is not None:
                entry["error"] = error
        checkpoints.append(entry)
    incomplete = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")
                        and p not in complete(root)) if root.is_dir() else []
    if not checkpoints and not incomplete and not _holds_a_run(Path(directory), root):
        raise CheckpointError(f"{directory}: no checkpoints, and not a run directory or its checkpoint directory")
    return {"root": str(root), "latest": latest, "checkpoints": checkpoints, "incomplete": incomplete}


def _entry(manifest: layout.Manifest) -> dict[str, Any]:
    """A checkpoint's line of the listing, from its manifest."""
    total = sum(t["rows"] for t in manifest.tables.values())
    touched = sum(manifest.stats.get("touched", {}).values())
    written = sum(r.count for r in manifest.records)
    return {"name": manifest.name, "step": manifest.step, "epoch": manifest.epoch, "kind": manifest.kind,
            "chain": manifest.chain, "bits": manifest.bits, "world_size": manifest.world_size,
            "bytes": manifest.stats.get("bytes", sum(f.bytes for f in manifest.files)),
            "rows_written": written, "rows_touched": touched, "rows_total": total,
            "touched_fraction": touched / total if total else 0.0,
            "snapshot_s": manifest.stats.get("snapshot_s"), "write_s": manifest.stats.get("write_s")}


def _chain_error(root: Path, manifest: layout.Manifest, found: dict[tuple[str, bool, bool], str | None],
                 unreadable: dict[str, str]) -> str | None:
    """Why the checkpoint ``manifest`` describes cannot be restored: the first checkpoint of
    its chain (the ones it is restored from, then itself) that is incomplete or holds a file
    that is not whole, as the restore reads each (:func:`layout.verify`); None when all are
    whole. ``found`` keeps each verdict, so that a chain's base is read once for all the
    increments on it; ``unreadable`` names the checkpoints whose manifest cannot be read."""
    incremental = layout.keeps_dense_incrementally(manifest)
    for name in manifest.chain:
        restored = name == manifest.name
        dense, segments = restored or incremental, restored  # as the restore reads this link
        key = (name, dense, segments)
        if key not in found:
            try:
                if name in unreadable:
                    raise CheckpointError(unreadable[name])
                layout.verify(root / name, manifest if restored else read_manifest(root / name), dense, segments)
                found[key] = None
            except CheckpointError as err:
                found[key] = str(err)
        if found[key] is not None:
            return found[key] if restored else f"restored from {name}, which is not whole: {found[key]}"
    return None


def _holds_a_run(directory: Path, root: Path) -> bool:
    """Whether ``directory`` is a run directory (its checkpoints perhaps not written yet) or
    its checkpoint directory."""
    return root.name == CHECKPOINTS or (directory / CONFIG).is_file() or (root / LATEST).is_file()


def render(described: dict[str, Any]) -> str:
    """``describe``'s result as a table."""
    lines = [f"checkpoints in {described['root']} (LATEST: {described['latest']})"]
    header = f"{'name':<16} {'step':>8} {'epoch':>5} {'kind':<11} {'bits':>4} {'bytes':>13} {'touched':>8}  chain"
    lines.append(header)
    for c in described["checkpoints"]:
        if "step" not in c:  # its manifest cannot be read
            lines.append(f"{c['name']:<16} CORRUPT: {c['error']}")
            continue
        chain = " <- ".join(reversed(c["chain"][:-1])) if len(c["chain"]) > 1 else "-"
        status = "" if "verified" not in c else ("  ok" if c["verified"] else f"  CORRUPT: {c['error']}")
        lines.append(f"{c['name']:<16} {c['step']:>8} {c['epoch']:>5} {c['kind']:<11} {c['bits']:>4} "
                     f"{c['bytes']:>13,} {c['touched_fraction']:>8.2%}  {chain}{status}")
    for name in described["incomplete"]:
        lines.append(f"{name:<16} (incomplete: no manifest; never restored)")
    return "\n".join(lines)
