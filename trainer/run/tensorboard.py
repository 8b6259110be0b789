"""Optional TensorBoard event files of a run (``train.tensorboard``), through
``torch.utils.tensorboard``, which needs the ``tensorboard`` package
(``pip install 'neorec[tensorboard]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from neorec.common.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"
"""Where the event files go in the run directory."""


class Board:
    """Scalars written as TensorBoard events under ``RUN_DIR/tensorboard``."""

    def __init__(self, writer: object) -> None:
        self._writer = writer

    def record(self, record: Mapping[str, Any]) -> None:
        """A ``metrics.jsonl`` record: its numbers as ``SPLIT/KEY`` at its ``step``."""
        step = int(record.get("step", 0))
        group = record.get("split", "run")
        for key, value in record.items():
            if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{group}/{key}", float(value), step)  # type: ignore[attr-defined]
        self._writer.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Flush and close the event file and stop the writer's thread (a second close does
        nothing)."""
        self._writer.close()  # type: ignore[attr-defined]


def open_board(run_dir: Path) -> Board:
    """The run's event writer; :class:`ConfigError` when TensorBoard is not installed."""
    return Board(summary_writer()(log_dir=str(run_dir / TENSORBOARD_DIR)))


def summary_writer() -> type:
    """``torch.utils.tensorboard.SummaryWriter``; :class:`ConfigError` when TensorBoard is not
    installed (a run checks before it claims its directory)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard = true needs the tensorboard package: pip install 'neorec[tensorboard]' "
                          "(or set train.tensorboard = false)") from None
    return SummaryWriter
