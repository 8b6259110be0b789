"""Binary-classification metrics on numpy arrays (exact, vectorized).

They live in ``ingest`` because the synthetic data generator scores its planted teacher
with them; the trainer's evaluation uses the same functions.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-7


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U, ties counted one half). float64 result in [0, 1]."""
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    positives = float(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # average 1-based rank of each distinct score
    ends = np.cumsum(counts)
    average_rank = ends - (counts - 1) / 2.0
    rank_sum = float(np.dot(labels, average_rank[inverse]))
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def log_loss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean binary cross-entropy (natural log), probabilities clipped to [1e-7, 1 - 1e-7]."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probabilities, dtype=np.float64).reshape(-1), _EPS, 1 - _EPS)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def normalized_entropy(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Log loss divided by the entropy of the label rate (He et al., 2014); lower is better."""
    rate = float(np.clip(np.mean(labels), _EPS, 1 - _EPS))
    base = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    return float(log_loss(labels, probabilities) / base)


def calibration(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean predicted probability over the label rate (1 is perfectly calibrated)."""
    return float(np.mean(probabilities) / max(float(np.mean(labels)), _EPS))


def binary_metrics(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, float]:
    """``auc``, ``logloss``, ``ne`` and ``calibration`` of predictions."""
    return {
        "auc": auc(labels, probabilities),
        "logloss": log_loss(labels, probabilities),
        "ne": normalized_entropy(labels, probabilities),
        "calibration": calibration(labels, probabilities),
    }
