"""Check-N-Run checkpoints (Eisenman et al., NSDI'22): per-rank shard files written in the
background, incremental (only the rows modified since the last checkpoint), optionally
quantized per row, committed by an atomic manifest, restorable into any world size.

- :mod:`~trainer.checkpoint.layout`: the directory, manifest, commit, pruning;
- :mod:`~trainer.checkpoint.records`: a shard's rows as bytes;
- :mod:`~trainer.checkpoint.quantize`: per-row quantization with a range search;
- :mod:`~trainer.checkpoint.snapshot`: the copy training waits for;
- :mod:`~trainer.checkpoint.writer`: encoding, writing and committing in the background;
- :mod:`~trainer.checkpoint.checkpointer`: when, and full or incremental;
- :mod:`~trainer.checkpoint.restore`: resharding restore of a chain.
"""

from __future__ import annotations

import torch

from trainer.checkpoint.layout import CheckpointError, checkpoints_root
from trainer.checkpoint.restore import Restorable, load_dense, open_checkpoint, restore_embeddings
from trainer.model import DLRM

__all__ = ["CheckpointError", "Restorable", "checkpoints_root", "open_checkpoint", "restore_model"]


def restore_model(restorable: Restorable, model: DLRM) -> dict:
    """Restore ``model`` (its embeddings, whatever their sharding, and its MLPs) from a
    checkpoint; returns the checkpoint's dense state (optimizer, RNG, position)."""
    embeddings = model.embeddings
    restore_embeddings(restorable, embeddings.shard_views())
    embeddings.set_optimizer_steps(restorable.manifest.sparse_steps)
    dense = load_dense(restorable)
    with torch.no_grad():
        model.bottom.load_state_dict(dense["bottom"])
        model.top.load_state_dict(dense["top"])
    return dense
