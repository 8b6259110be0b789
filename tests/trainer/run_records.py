"""The records of a run's ``metrics.jsonl``, as the tests compare them."""

from __future__ import annotations

import json
from pathlib import Path

TIMED = ("qps", "seconds", "lag_s")
"""Fields that depend on the machine's speed or the clock (and every ``*_seconds``)."""


def logged(run_dir: Path, split: str | None = None) -> list[dict]:
    """Every record of ``RUN_DIR/metrics.jsonl`` in order (those of ``split`` only, if given)."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if split is None or line.get("split") == split]


def records(run_dir: Path, split: str | None = None) -> list[dict]:
    """:func:`logged` without the fields that depend on the machine's speed or the clock, so
    that two runs that must agree bit for bit compare equal."""
    return [{k: v for k, v in line.items() if k not in TIMED and not k.endswith("_seconds")}
            for line in logged(run_dir, split)]
