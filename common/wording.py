"""Words of the messages the commands print."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """``n`` (with thousands separators) and ``noun``, plural unless ``n`` is 1: "1 file",
    "16,000 rows"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
