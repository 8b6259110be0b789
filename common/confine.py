"""Confining a service to the directories it was started with (``--data-root``): a path a
request or a file names is resolved (``..`` and symlinks followed) before it is compared
with the roots, so no spelling of a path outside them gets in."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def resolve_roots(roots: Sequence[str | Path]) -> tuple[Path, ...]:
    """The roots as resolved absolute directories."""
    return tuple(Path(r).resolve() for r in roots)


def confined(path: str | Path, roots: Sequence[Path]) -> Path | None:
    """``path`` resolved, if it is one of ``roots`` (resolved, see :func:`resolve_roots`) or
    lies under one; else None (also for a path that cannot be resolved)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, ValueError, RuntimeError):
        return None
    return resolved if any(resolved == r or r in resolved.parents for r in roots) else None
