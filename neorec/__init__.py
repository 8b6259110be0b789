"""neorec: train deep learning recommendation models with disaggregated ingestion, fused
sharded embeddings and a tiered embedding store.

The public API is the names in :data:`__all__` (documented in ``docs/api.md``); they are
imported on first use, so ``import neorec`` (and ``neorec --help``) stays fast. Everything
else lives in the subpackages ``neorec.ingest``, ``neorec.trainer``,
``neorec.embedding_store``, ``neorec.orchestration``, ``neorec.protos``,
``neorec.common`` and ``neorec.configs`` (the configs neorec ships) and is internal. In a
source checkout they are the repository's top-level folders, beside this one; an installed
wheel holds them inside this package.
"""

from __future__ import annotations

import importlib
from pathlib import Path as _Path
from typing import Any

_HERE = _Path(__file__).resolve().parent
_CHECKOUT = _HERE.parent
if not (_HERE / "trainer").is_dir() and (_CHECKOUT / "trainer" / "__init__.py").is_file() \
        and (_CHECKOUT / "pyproject.toml").is_file():
    __path__.append(str(_CHECKOUT))  # a source checkout: the subpackages are its top-level folders

from neorec.common.malloc_policy import keep_freed_memory as _keep_freed_memory  # noqa: E402
from neorec.common.wait_policy import prefer_short_waits as _prefer_short_waits  # noqa: E402

_prefer_short_waits()  # before torch loads its OpenMP runtime (see neorec.common.wait_policy)
_keep_freed_memory()  # a step's freed temporaries stay mapped (see neorec.common.malloc_policy)

_PUBLIC = {
    # the batch
    "KeyedJaggedTensor": ("neorec.trainer.batch", "KeyedJaggedTensor"),
    "Batch": ("neorec.trainer.batch", "Batch"),
    # embedding bag collections and their configuration
    "TableConfig": ("neorec.trainer.embedding.config", "TableConfig"),
    "SparseOptimizer": ("neorec.trainer.embedding.config", "SparseOptimizer"),
    "FusedEmbeddingBagCollection": ("neorec.trainer.embedding.fused", "FusedEmbeddingBagCollection"),
    "ShardedEmbeddingBagCollection": ("neorec.trainer.sharding.sharded_embedding", "ShardedEmbeddingBagCollection"),
    "StoreBackedEmbeddings": ("neorec.trainer.embedding.store_backed", "StoreBackedEmbeddings"),
    "StoreTable": ("neorec.trainer.embedding.store_backed", "StoreTable"),
    "StoreSettings": ("neorec.trainer.embedding.store_backed", "StoreSettings"),
    "SegmentTier": ("neorec.embedding_store.segments", "SegmentTier"),
    # the model
    "DLRM": ("neorec.trainer.model", "DLRM"),
    # training and evaluation
    "TrainConfig": ("neorec.trainer.config", "TrainConfig"),
    "load_config": ("neorec.orchestration.config", "load_config"),
    "train": ("neorec.trainer.run.train", "train"),
    "evaluate_checkpoint": ("neorec.trainer.run.train", "evaluate_checkpoint"),
    # the planner
    "plan_tables": ("neorec.trainer.planner.planner", "plan_tables"),
    "TableSpec": ("neorec.trainer.planner.inputs", "TableSpec"),
    "Topology": ("neorec.trainer.planner.inputs", "Topology"),
    "ShardingPlan": ("neorec.trainer.sharding.plan", "ShardingPlan"),
    # data
    "Dataset": ("neorec.ingest.schema", "Dataset"),
    "SynthSpec": ("neorec.ingest.synth", "SynthSpec"),
    "generate_synthetic": ("neorec.ingest.synth", "generate"),
    # errors
    "UserError": ("neorec.common.errors", "UserError"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """Import a public name on first use (and keep it: later lookups do not come here)."""
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'neorec' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
