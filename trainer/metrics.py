"""Run metrics: a JSON-lines log and the evaluation of a model over a split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ingest.metrics import binary_metrics
from trainer.batch import Batch
from trainer.run_dir import RunDirError, describe


class MetricsLog:
    """Appends one JSON object per line to ``path`` (``metrics.jsonl`` of a run); with
    ``path=None`` (ranks other than 0) it writes nothing."""

    def __init__(self, path: str | Path | None) -> None:
        self._file = None
        self.path = None if path is None else Path(path)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("w")
            except OSError as err:
                raise RunDirError(f"cannot write {self.path}: {describe(err)}") from None

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; an ``OSError`` (a full disk) names the file."""
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, sort_keys=True) + "\n")
                self._file.flush()
            except OSError as err:
                raise RunDirError(f"cannot write {self.path}: {describe(err)}") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch],
             combine: Callable[[np.ndarray], np.ndarray] = lambda local: local) -> dict[str, float]:
    """``auc``, ``logloss``, ``ne``, ``calibration`` and ``rows`` over the valid samples of
    ``batches`` (the model is put in eval mode and back). ``combine`` turns this rank's
    float64 labels or probabilities into every rank's (a sharded run's gather)."""
    was_training = model.training
    model.eval()
    labels, probabilities = [], []
    try:
        for batch in batches:
            logits = model(batch)[: batch.num_valid]
            probabilities.append(torch.sigmoid(logits).cpu().numpy().astype(np.float64))
            labels.append(batch.labels[: batch.num_valid].cpu().numpy())
    finally:
        model.train(was_training)
    y = combine(np.concatenate(labels).astype(np.float64))
    p = combine(np.concatenate(probabilities))
    return {**binary_metrics(y, p), "rows": int(y.size)}
