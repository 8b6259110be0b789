"""Run metrics: a JSON-lines log and the evaluation of a model over a split."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from neorec.ingest.metrics import binary_metrics
from neorec.trainer.batch import Batch
from neorec.common.errors import describe
from neorec.trainer.run.run_dir import RunDirError

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON object per line to ``path`` (``metrics.jsonl`` of a run); with
    ``path=None`` (ranks other than 0) it writes nothing. ``keep_bytes``: continue a log
    whose first ``keep_bytes`` bytes are kept (a resumed run; what a killed run wrote after
    its checkpoint is cut); None starts an empty one."""

    def __init__(self, path: str | Path | None, keep_bytes: int | None = None) -> None:
        self._file = None
        self._failed = False
        self.path = None if path is None else Path(path)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Also called with every record written (e.g. a TensorBoard writer)."""
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if keep_bytes is None:
                    self._file = self.path.open("w")
                else:
                    keep_bytes = self._whole_lines(keep_bytes)
                    self._file = self.path.open("r+" if self.path.exists() else "w")
                    self._file.truncate(keep_bytes)
                    self._file.seek(keep_bytes)
            except OSError as err:
                raise RunDirError(f"cannot write {self.path}: {describe(err)}") from None

    def _whole_lines(self, keep_bytes: int) -> int:
        """``keep_bytes``, or when the log is shorter than that (lines a power loss or a
        person took after the checkpoint recorded its length), its whole lines: the run
        goes on without the records lost, said in a warning."""
        try:
            with self.path.open("rb") as f:
                held = f.read(keep_bytes)
        except FileNotFoundError:
            held = b""
        if len(held) == keep_bytes:
            return keep_bytes
        whole = held.rfind(b"\n") + 1
        log.warning("%s holds %d of the %d bytes the checkpoint counted: the records after its %d whole lines are "
                    "lost, and the log goes on from there", self.path, len(held), keep_bytes, held.count(b"\n"))
        return whole

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def size(self) -> int:
        """Bytes written so far (the log's length)."""
        return 0 if self._file is None else self._file.tell()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; an ``OSError`` (a full disk) names the file."""
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, sort_keys=True) + "\n")
                self._file.flush()
            except OSError as err:
                self._failed = True
                raise RunDirError(f"cannot write {self.path}: {describe(err)}") from None
            for listener in self.listeners:
                listener(record)

    def close(self) -> None:
        """Close the file; a record a failed ``write`` left buffered (already reported) is
        dropped rather than raised again."""
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError as err:
            if not self._failed:
                raise RunDirError(f"cannot write {self.path}: {describe(err)}") from None


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
