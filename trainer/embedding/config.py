"""Configuration of embedding tables and of the sparse optimizer fused into their backward."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

POOLINGS = ("sum", "mean")
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
WEIGHT_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Embedding weight storage types and their bytes per element."""


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: ``num_embeddings`` rows of ``embedding_dim`` floats.

    ``feature_names`` are the batch keys whose ids look this table up (each feature gives
    one pooled output of ``embedding_dim`` columns). ``learning_rate`` overrides the
    optimizer's for this table.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str = "sum"
    learning_rate: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a table's name must be a non-empty string, got {self.name!r}")
        for key in ("num_embeddings", "embedding_dim"):
            value = getattr(self, key)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"table {self.name!r}: {key} must be a positive integer, got {value!r}")
        if isinstance(self.feature_names, str):
            raise ValueError(f"table {self.name!r}: feature_names is a sequence of names, got the string "
                             f"{self.feature_names!r} (write ({self.feature_names!r},))")
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        if not self.feature_names:
            raise ValueError(f"table {self.name!r}: no feature looks it up")
        if not all(isinstance(f, str) and f for f in self.feature_names):
            raise ValueError(f"table {self.name!r}: feature names must be non-empty strings, got {self.feature_names}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.learning_rate is not None:
            _check(f"table {self.name!r}: learning_rate", self.learning_rate, positive=True)


@dataclass(frozen=True)
class SparseOptimizer:
    """The optimizer applied to embedding rows inside the backward pass.

    State per row: ``sgd`` none; ``adagrad`` a sum of squares per element;
    ``rowwise_adagrad`` one mean of squares per row; ``adam`` first and second moments per
    element (bias-corrected with the module's step count, as ``torch.optim.SparseAdam``).
    ``weight_decay`` adds ``weight_decay * w`` to the gradient of each updated row.
    ``adagrad_decay`` (``adagrad`` and ``rowwise_adagrad``) multiplies a row's sum of
    squares by it before each update of the row adds the new squares, so the sum stays
    bounded (about ``g**2 / (1 - adagrad_decay)``) and the row's step size stops shrinking
    towards zero; 1 is plain Adagrad.
    """

    kind: str = "rowwise_adagrad"
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    adagrad_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse optimizer must be one of {SPARSE_OPTIMIZERS}, got {self.kind!r}")
        _check("sparse optimizer learning_rate", self.learning_rate, positive=True)
        _check("sparse optimizer eps", self.eps, positive=self.kind != "sgd")  # a zero gradient's 0 / (0 + eps)
        _check("sparse optimizer weight_decay", self.weight_decay)
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not 0 <= value < 1:  # (a NaN fails too) 1 - beta ** step is a bias correction's divisor
                raise ValueError(f"sparse optimizer {key} must lie in [0, 1), got {value}")
        if not 0 < self.adagrad_decay <= 1:
            raise ValueError(f"sparse optimizer adagrad_decay must lie in (0, 1], got {self.adagrad_decay}")

    def state_width(self, dim: int) -> int:
        """State floats per row in each state array."""
        return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": dim}[self.kind]

    @property
    def num_states(self) -> int:
        return {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}[self.kind]


def _check(what: str, value: float, positive: bool = False) -> None:
    """ValueError unless ``value`` is a finite number, positive or at least 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise ValueError(f"{what} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
