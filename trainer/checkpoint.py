"""Full checkpoints of a training run: model (weights and optimizer state of the fused
embeddings), dense optimizer and the data position, with a manifest written last.

A checkpoint directory is complete when its ``manifest.json`` exists; files are written
to temporary names and renamed into place, so a crash never leaves a checkpoint that
looks complete but is not.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.run_dir import RunDirError, describe

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"


@dataclass(frozen=True)
class Position:
    """Where training stands: the next step's epoch and the steps taken in total."""

    epoch: int
    global_step: int


def save(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         position: Position, config: dict[str, Any]) -> Path:
    """Write a checkpoint into ``directory`` and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / MANIFEST
    if manifest.exists():
        manifest.unlink()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
    tmp = directory / (STATE_FILE + ".tmp")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        tmp.write_bytes(buffer.getbuffer())
        _fsync_replace(tmp, directory / STATE_FILE)
    except OSError as err:
        raise RunDirError(f"cannot write {tmp}: {describe(err)}") from None
    body = {"format": "neorec-checkpoint/1", "epoch": position.epoch, "global_step": position.global_step,
            "files": [STATE_FILE], "config": config}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    _fsync_replace(tmp, manifest)
    return directory


def load(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Position:
    """Restore ``model`` (and ``optimizer``) from a complete checkpoint."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"{directory} holds no complete checkpoint (no {MANIFEST})")
    body = json.loads(manifest.read_text())
    state = torch.load(directory / STATE_FILE, weights_only=True)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return Position(epoch=body["epoch"], global_step=body["global_step"])


def _fsync_replace(tmp: Path, final: Path) -> None:
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
