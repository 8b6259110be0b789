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
    seconds; with ``verify``, whether every file matches its size and SHA-256 and the
    checkpoints of its chain are complete.
    :class:`CheckpointError` when the directory holds no checkpoint, complete or not, and is
    not a run's (an empty listing for a run that has written none yet)."""
    root, _ = checkpoints_root(directory)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    checkpoints = []
    for path in complete(root):
        manifest = read_manifest(path)
        total = sum(t["rows"] for t in manifest.tables.values())
        touched = sum(manifest.stats.get("touched", {}).values())
        written = sum(r.count for r in manifest.records)
        entry = {"name": manifest.name, "step": manifest.step, "epoch": manifest.epoch, "kind": manifest.kind,
                 "chain": manifest.chain, "bits": manifest.bits, "world_size": manifest.world_size,
                 "bytes": manifest.stats.get("bytes", sum(f.bytes for f in manifest.files)),
                 "rows_written": written, "rows_touched": touched, "rows_total": total,
                 "touched_fraction": touched / total if total else 0.0,
                 "snapshot_s": manifest.stats.get("snapshot_s"), "write_s": manifest.stats.get("write_s")}
        if verify:
            try:
                for link in manifest.chain[:-1]:  # the checkpoints it is restored from, complete
                    read_manifest(root / link)
                layout.verify(path, manifest)
                entry["verified"] = True
            except CheckpointError as err:
                entry["verified"] = False
                entry["error"] = str(err)
        checkpoints.append(entry)
    incomplete = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")
                        and p not in complete(root)) if root.is_dir() else []
    if not checkpoints and not incomplete and not _holds_a_run(Path(directory), root):
        raise CheckpointError(f"{directory}: no checkpoints, and not a run directory or its checkpoint directory")
    return {"root": str(root), "latest": latest, "checkpoints": checkpoints, "incomplete": incomplete}


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
        chain = " <- ".join(reversed(c["chain"][:-1])) if len(c["chain"]) > 1 else "-"
        status = "" if "verified" not in c else ("  ok" if c["verified"] else f"  CORRUPT: {c['error']}")
        lines.append(f"{c['name']:<16} {c['step']:>8} {c['epoch']:>5} {c['kind']:<11} {c['bits']:>4} "
                     f"{c['bytes']:>13,} {c['touched_fraction']:>8.2%}  {chain}{status}")
    for name in described["incomplete"]:
        lines.append(f"{name:<16} (incomplete: no manifest; never restored)")
    return "\n".join(lines)
