"""Run metrics: a JSON-lines log and the evaluation of a model over a split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from ingest.metrics import binary_metrics
from trainer.batch import Batch
from trainer.model import DLRM


class MetricsLog:
    """Appends one JSON object per line to ``path`` (``metrics.jsonl`` of a run)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterable[Batch]) -> dict[str, float]:
    """``auc``, ``logloss``, ``ne``, ``calibration`` and ``rows`` over the valid samples of
    ``batches`` (the model is put in eval mode and back)."""
    was_training = model.training
    model.eval()
    labels, probabilities = [], []
    try:
        for batch in batches:
            logits = model(batch)[: batch.num_valid]
            probabilities.append(torch.sigmoid(logits).numpy().astype(np.float64))
            labels.append(batch.labels[: batch.num_valid].numpy())
    finally:
        model.train(was_training)
    y = np.concatenate(labels)
    p = np.concatenate(probabilities)
    return {**binary_metrics(y, p), "rows": int(y.size)}
